from agents.broker_urls import redacted


def test_a_url_shown_without_its_password() -> None:
    assert redacted("redis://dynaplane:s3cret@10.0.0.1:6379/0") == "redis://dynaplane:***@10.0.0.1:6379/0"
    assert redacted("rediss://:s3cret@broker:6380/1") == "rediss://:***@broker:6380/1"
    assert redacted("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert redacted("postgres://postgres@127.0.0.1:5432/test") == "postgres://postgres@127.0.0.1:5432/test"
