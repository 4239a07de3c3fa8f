"""Errors of the transition engine: each says what failed and on which rank/tensor."""
from __future__ import annotations


class EngineError(RuntimeError):
    """A switch cannot go on (plan mismatch, dead peer, verification failure)."""
