"""The bounds and rules every API input passes before any work is done (issue 11): one
place, so that job creation, resize, plan previews and emulation refuse the same things
with the same words. Each refusal is an InvalidInput (HTTP 400) naming the field and the
rule, never a server path.

- integers stay within the database's column range (INT32_MAX);
- a layout spans at most parallelism.layout.spec.MAX_WORLD GPUs (checked while parsing), and a
  plan computed inside a request at most MAX_PLAN_WORLD ranks;
- a model is a catalog name or a config stored under the models folder, never a path on
  the server (catalog.get_config(paths=False));
- a checkpoint folder lies under the checkpoint root (settings.DYNAPLANE_CHECKPOINT_ROOT);
- a training setting is one the trainer can run: the batch splits over micro-batches and
  data parallelism, a model with learned positions has a row for every token.
"""
from __future__ import annotations

import os

from django.conf import settings

from parallelism.layout.catalog import get_config, model_from_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.model_config import ModelConfig
from parallelism.layout.placement import Placement, batch_dp, place
from parallelism.layout.spec import MAX_WORLD
from parallelism.layout.tensors import Model
from controlplane.common.errors import InvalidInput
from controlplane.common.limits import INT32_MAX, MAX_PLAN_WORLD, MAX_SEQ_LEN  # noqa: F401 (the API's bounds, here)

MAX_GPUS = MAX_WORLD


def whole_number(text: str, maximum: int = INT32_MAX) -> int | None:
    """A query parameter's non-negative integer (ASCII digits, at most `maximum`), else None.
    (str.isdigit() also takes '²', which int() then refuses.)"""
    if not text or len(text) > len(str(maximum)) or not all("0" <= c <= "9" for c in text):
        return None
    value = int(text)
    return value if value <= maximum else None


def model_config(name: str) -> ModelConfig:
    """The model named by an API input: a catalog name or a stored config."""
    try:
        return get_config(name, paths=False)
    except LayoutError as exc:
        raise InvalidInput({"model": [str(exc)]}) from None


def model_of(name: str) -> Model:
    """The model named by an API input (or stored with a job), resolved once: a request
    resolves it at its entry and passes the value down, so that every check and plan of the
    request sees the same config (a stored config.json may be replaced meanwhile)."""
    return model_from_config(model_config(name))


def placement_of(model: Model, layout: str, field: str = "layout") -> Placement:
    """The model's placement under a layout string (parsed within MAX_WORLD)."""
    try:
        return place(model, layout)
    except LayoutError as exc:
        raise InvalidInput({field: [str(exc)]}) from None


def plan_world_check(src: Placement, dst: Placement, field: str = "layout") -> None:
    """Refuse a plan too large to compute inside a request, before computing it."""
    world = max(src.world, dst.world)
    if world > MAX_PLAN_WORLD:
        raise InvalidInput({field: [f"a switch between {src.world} and {dst.world} ranks is planned inside the "
                                    f"request only up to {MAX_PLAN_WORLD} ranks (`dynaplane plan` has no limit)"]})


def training_problems(config: ModelConfig, placement: Placement, *, global_batch: int, micro_batch: int,
                      seq_len: int) -> dict[str, list[str]]:
    """What keeps the trainer (or the emulator, which traces it) from running this setting."""
    problems: dict[str, list[str]] = {}
    dp = batch_dp(placement)  # heterogeneous layouts: the LLM's dp splits the batch
    if global_batch % (micro_batch * dp):
        problems["global_batch"] = [f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch} "
                                    f"x dp={dp} (layout {placement.layout})"]
    if config.llm.positions and seq_len > config.llm.positions:
        problems["seq_len"] = [f"seq_len={seq_len} exceeds the {config.llm.positions} learned positions of "
                               f"{config.name}"]
    return problems


def checkpoint_folder(value: str, field: str) -> str:
    """A checkpoint folder given by an API input, as an absolute path under the checkpoint
    root: relative paths are taken from the root; nothing may lead out of it."""
    root = os.path.realpath(settings.DYNAPLANE_CHECKPOINT_ROOT)
    if "\x00" in value:
        raise InvalidInput({field: ["must not contain NUL characters"]})
    path = os.path.realpath(os.path.join(root, value))
    if os.path.commonpath([root, path]) != root:
        raise InvalidInput({field: [f"{value!r} is outside the checkpoint root; give a folder under it (a path "
                                    f"relative to the root, or an absolute one inside it)"]})
    return path
