"""The numbers that bound API inputs (no imports: DRF's settings load the parsers and the
pagination that use them)."""
from __future__ import annotations

INT32_MAX = 2**31 - 1  # PostgreSQL's integer: every count and step column
MAX_SEQ_LEN = 1_048_576
# Plans computed inside a request (plan previews, resize, survivors): the 405B dp=64 -> 48
# switch (8,192 ranks) plans in about 1 s here; 16,384 ranks bound a request to seconds.
MAX_PLAN_WORLD = 16_384
MAX_PAGE = 1000        # rows of one list page
MAX_JSON_DEPTH = 32    # nesting of a JSON body
