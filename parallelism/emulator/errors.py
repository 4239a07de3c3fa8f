"""The one error type of the emulator's pure core."""
from __future__ import annotations


class EmulatorError(ValueError):
    """Bad input to the emulator; the message names the value."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise EmulatorError(message)
