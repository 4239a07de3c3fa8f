"""The one error type of the pure core."""
from __future__ import annotations


class LayoutError(ValueError):
    """Bad user input to the layout core; the message names the rule and the values."""


def require(condition: bool, message: str) -> None:
    """Raise LayoutError(message) unless `condition` holds."""
    if not condition:
        raise LayoutError(message)
