"""The one error type of a dataset that cannot be used, with the file and the rule it breaks."""
from __future__ import annotations


class DatasetError(ValueError):
    """A dataset file, manifest or setting that cannot be used; the message names the file and the rule."""
