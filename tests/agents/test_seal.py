"""Agent tokens, keys and seals (agents/seal.py): a seal made for one (node, task, body) holds for
exactly that one, after the body's JSON round trip through the broker, and for no other."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from agents.seal import (AgentKey, SealError, key_of_token, seal, seal_read, seal_valid, token_new)

JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=20)
BODIES = st.dictionaries(st.text(max_size=8), JSON, max_size=6)


def test_a_token_gives_the_same_key_every_time_and_two_tokens_differ() -> None:
    token = token_new()
    assert token.startswith("dpa_") and len(token) == 4 + 16 + 1 + 43
    assert key_of_token(token) == key_of_token(f"  {token}\n")  # as pasted from a terminal
    other = token_new()
    assert key_of_token(other).key_id != key_of_token(token).key_id
    assert key_of_token(other).secret != key_of_token(token).secret
    assert token.split("_")[2] not in repr(key_of_token(token)) and key_of_token(token).secret.hex() not in repr(
        key_of_token(token))


@pytest.mark.parametrize("bad", ["", "dpa_", "dpa_0123456789abcdef_short", "xyz_0123456789abcdef_" + "a" * 43,
                                 "dpa_0123456789ABCDEF_" + "a" * 43, "dpa_0123456789abcdef_" + "a" * 42 + "!"])
def test_a_malformed_token_is_refused_naming_the_form(bad: str) -> None:
    with pytest.raises(SealError, match="'dpa_' \\+ 16 hex digits"):
        key_of_token(bad)


def test_a_key_travels_to_the_ranks_as_text_and_back() -> None:
    key = key_of_token(token_new())
    assert AgentKey.decode(key.encode()) == key
    for bad in ("", key.key_id, f"{key.key_id}:zz", f"nothex:{key.secret.hex()}"):
        with pytest.raises(SealError):
            AgentKey.decode(bad)


@settings(max_examples=200, deadline=None)
@given(body=BODIES, node=st.sampled_from(["node-1", "host-2"]), task=st.sampled_from(["control.job_report", "x"]))
def test_a_seal_holds_after_the_json_round_trip(body: dict, node: str, task: str) -> None:
    key = key_of_token(token_new())
    made = seal(key, node, task, body)
    carried = json.loads(json.dumps({"args": [body], "kwargs": {"seal": made}}))  # what the broker hands over
    received = seal_read(carried["kwargs"]["seal"])
    assert seal_valid(key.secret, received, task, carried["args"][0])


@settings(max_examples=200, deadline=None)
@given(body=BODIES, other=BODIES)
def test_a_seal_holds_for_no_other_body_task_node_or_key(body: dict, other: dict) -> None:
    key = key_of_token(token_new())
    received = seal_read(seal(key, "node-1", "t", body))
    assert seal_valid(key.secret, received, "t", other) == (json.dumps(other, sort_keys=True) == json.dumps(body, sort_keys=True))
    assert not seal_valid(key.secret, received, "u", body)
    assert not seal_valid(key_of_token(token_new()).secret, received, "t", body)
    moved = seal_read({**seal(key, "node-1", "t", body), "node": "node-2"})
    assert not seal_valid(key.secret, moved, "t", body)


@pytest.mark.parametrize("bad, rule", [
    (None, "no seal"), ("x", "exactly 'node', 'key' and 'sig'"), ({"node": "n", "key": "k"}, "exactly"),
    ({"node": "", "key": "0" * 16, "sig": "0" * 64}, "seal.node"),
    ({"node": "n", "key": "XYZ", "sig": "0" * 64}, "seal.key is 16 hex digits"),
    ({"node": "n", "key": "0" * 16, "sig": "0" * 63}, "seal.sig is 64 hex digits"),
    ({"node": "n", "key": "0" * 16, "sig": "0" * 64, "extra": 1}, "exactly"),
])
def test_a_malformed_seal_is_refused_naming_the_rule(bad, rule: str) -> None:
    with pytest.raises(SealError, match=rule):
        seal_read(bad)


def test_without_a_key_there_is_no_seal() -> None:
    assert seal(None, "node-1", "t", {}) is None
