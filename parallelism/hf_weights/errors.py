"""The one error type of Hugging Face weights in and out."""
from __future__ import annotations


class HFWeightsError(ValueError):
    """A Hugging Face checkpoint (or an export request) this library will not read or write;
    the message names the file, the tensor and the rule it breaks."""
