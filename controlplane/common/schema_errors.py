"""The error responses of every API operation, in the OpenAPI schema (issue 11: a schema
fuzzer found 26 status codes the schema did not document). drf-spectacular documents what a
view returns when it succeeds; the errors come from DRF and from our services alike for
every operation of a kind, so one postprocessing hook (drf-spectacular's extension point
for the finished schema) adds them: reads can answer 400 (a bad query parameter), 404 (a
detail route's object) and 406; writes also 401 and 403 (no or a bad token, CSRF), 409 (the
object's state forbids it) and 415 (a body that is not JSON or a form)."""
from __future__ import annotations

ERROR = {
    "type": "object",
    "description": "`{\"detail\": \"...\"}`, or for a 400 the messages of each field that broke a rule: "
                   "`{\"field\": [\"message\", ...]}`",
    "additionalProperties": True,
}
READ = {"400": "a query parameter broke a rule", "404": "no such object", "406": "cannot answer in that media type"}
WRITE = {**READ, "400": "the input broke a rule (each field names its rule)",
         "401": "no valid token or session", "403": "not allowed (a session write without its CSRF token)",
         "409": "the object's current state forbids it", "415": "the body is not JSON or a form"}


def add_error_responses(result: dict, generator, request, public) -> dict:
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            responses = operation.setdefault("responses", {})
            for code, why in (READ if method == "get" else WRITE).items():
                responses.setdefault(code, {"description": why, "content": ref})
    return result
