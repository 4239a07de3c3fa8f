"""DRF pieces that bound what one request can make the server do (issue 11): list pages of
at most MAX_PAGE rows from an offset within the database's range, and JSON bodies nested at
most MAX_JSON_DEPTH deep (deeper ones made Python's decoder raise RecursionError: a 500)."""
from __future__ import annotations

import json

from rest_framework.exceptions import ParseError
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.parsers import JSONParser

from controlplane.common.limits import INT32_MAX, MAX_JSON_DEPTH, MAX_PAGE


class BoundedPagination(LimitOffsetPagination):
    """`?limit` is capped at MAX_PAGE (DRF's max_limit); an `?offset` beyond the database's
    integer range reads as the end of the list instead of an SQL error."""

    max_limit = MAX_PAGE

    def get_offset(self, request) -> int:
        return min(super().get_offset(request), INT32_MAX)


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings (a linear scan, before any decoding)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


class BoundedJSONParser(JSONParser):
    """DRF's JSON parser, refusing bodies nested deeper than MAX_JSON_DEPTH (400)."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read() if stream is not None else b""
        try:
            text = raw.decode((parser_context or {}).get("encoding") or "utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"JSON parse error - the body is not UTF-8: {exc.reason}") from None
        if _depth(text) > MAX_JSON_DEPTH:
            raise ParseError(f"JSON parse error - nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            return json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")
