"""A request that names a model (an emulation, a search, a trace, a training run) resolves
the name once, when it is made, and carries the resolved ModelConfig as a value from then
on: every step after it reads `request.model_config` / `request.tensors` instead of looking
the name up again, so a stored config.json edited mid-request cannot change the model under
a running request. The value is derived from `model` alone (not an argument), so a request
made with dataclasses.replace(request, model=...) resolves its own model again."""
from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from parallelism.layout.catalog import get_config, model_from_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.model_config import ModelConfig
from parallelism.layout.tensors import Model


class NamesAModel:
    """Mixin for a frozen dataclass with a field `model: str` (a catalog name, a stored
    config's name, or, from the CLI, a config.json path) and `model_config` declared with
    resolved_field(). `model_error`: the error type an unknown model raises at construction,
    with get_config's message."""

    model_error: ClassVar[type[Exception]] = LayoutError

    def __post_init__(self) -> None:
        try:
            resolved = get_config(self.model)  # type: ignore[attr-defined]
        except LayoutError as exc:
            raise self.model_error(str(exc)) from None
        object.__setattr__(self, "model_config", resolved)

    @property
    def tensors(self) -> Model:
        """The model's logical tensors (built once per config, catalog.model_from_config)."""
        return model_from_config(self.model_config)  # type: ignore[attr-defined]


def resolved_field():
    """The dataclass field a NamesAModel request declares for its resolved config: set by
    __post_init__, not an argument, not part of equality or of repr."""
    return field(default=None, init=False, compare=False, repr=False)


__all__ = ["ModelConfig", "NamesAModel", "resolved_field"]
