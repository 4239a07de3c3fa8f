"""Open reads shown as open in the API docs (issue 46). drf-spectacular lists an operation that
anyone may call (DYNAPLANE_OPEN_READS: GETs on a stack only this machine reaches) as
`security: [{tokenAuth: []}, {cookieAuth: []}, {}]`, i.e. "a token, a session, or nothing", and
Swagger UI draws a lock on every operation with a security list: the open reads looked locked.
This postprocessing hook (drf-spectacular's extension point for the finished schema) says
"nothing needed" (`security: []`) for exactly those; with reads closed they keep their lock."""
from __future__ import annotations

METHODS = ("get", "post", "put", "patch", "delete", "head", "options")


def open_operations_need_no_security(result: dict, generator, request, public) -> dict:
    for operations in result.get("paths", {}).values():
        for method, operation in operations.items():
            if method in METHODS and {} in operation.get("security", []):
                operation["security"] = []
    return result
