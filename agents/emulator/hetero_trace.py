"""What a traced step of a heterogeneous (per-module) layout contains: the interface between
hetero_tracer.py and hetero_sim.py (pure: no torch).

A multimodal model's step is three traced parts (issue 8, PAPERS.md section 2):
- `encoder`: one encoder rank's whole step (encoder + projector forward over the rank's
  encoder-dp share of the global batch, its backward, the encoder optimizer and its
  data-parallel gradient reduction) as a one-stage StageTrace; the encoder runs
  unpipelined (the trainer's rule), and TP/DP replicas are symmetric;
- `llm`: the LLM's pipeline as an ordinary Trace (one micro-batch per stage class, its
  first stage taking the image tokens before the text, seq = image tokens + text);
- `boundary_forward` / `boundary_backward`: the boundary communicator's point-to-point
  transfers of the whole batch, one tuple per traced rank (that rank's sends and recvs).
  A rank's exchange takes max(its sends, its recvs) (links are full duplex); the
  exchange ends when the slowest traced rank's does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from agents.emulator.errors import EmulatorError, require
from agents.emulator.trace import CommOp, StageTrace, Trace, op_from_dict, op_to_dict, stage_from_dict, stage_to_dict

FORMAT_VERSION = 1


@dataclass(frozen=True)
class HeteroTrace:
    model: str
    layout: str
    colocated: bool
    encoder: StageTrace
    encoder_tp: int
    encoder_dp: int
    encoder_zero: int
    encoder_samples: int          # images the traced encoder rank encodes per step
    image_tokens: int             # tokens one image becomes (patches + class token)
    llm: Trace
    boundary_forward: tuple[tuple[CommOp, ...], ...] = ()
    boundary_backward: tuple[tuple[CommOp, ...], ...] = ()

    def __post_init__(self) -> None:
        for key in ("boundary_forward", "boundary_backward"):
            object.__setattr__(self, key, tuple(tuple(ops) for ops in getattr(self, key)))
            for ops in getattr(self, key):
                for op in ops:
                    require(isinstance(op, CommOp) and op.kind in ("send", "recv"),
                            f"{key}: {op!r} is not a send/recv CommOp")
        require(isinstance(self.encoder, StageTrace), "encoder must be a StageTrace")
        require(isinstance(self.llm, Trace), "llm must be a Trace")
        for key in ("encoder_tp", "encoder_dp", "image_tokens"):
            value = getattr(self, key)
            require(isinstance(value, int) and value >= 1, f"{key}={value!r} must be a positive integer")
        require(isinstance(self.encoder_samples, int) and self.encoder_samples >= 0,
                f"encoder_samples={self.encoder_samples!r} must be an integer >= 0")

    @property
    def encoder_world(self) -> int:
        return self.encoder_tp * self.encoder_dp

    @property
    def world(self) -> int:
        return self.llm.world if self.colocated else self.llm.world + self.encoder_world

    def to_json(self) -> str:
        data = {k: getattr(self, k) for k in ("model", "layout", "colocated", "encoder_tp", "encoder_dp",
                                              "encoder_zero", "encoder_samples", "image_tokens")}
        data.update(version=FORMAT_VERSION, encoder=stage_to_dict(self.encoder), llm=self.llm.to_dict(),
                    boundary_forward=[[op_to_dict(op) for op in ops] for ops in self.boundary_forward],
                    boundary_backward=[[op_to_dict(op) for op in ops] for ops in self.boundary_backward])
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "HeteroTrace":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EmulatorError(f"hetero trace is not JSON: {exc}") from exc
        version = data.pop("version", None)
        require(version == FORMAT_VERSION, f"hetero trace format version={version!r}, this code reads {FORMAT_VERSION}")
        data["encoder"] = stage_from_dict(data["encoder"])
        data["llm"] = Trace.from_dict(data["llm"])
        for key in ("boundary_forward", "boundary_backward"):
            data[key] = tuple(tuple(op_from_dict(op) for op in ops) for ops in data[key])
        return cls(**data)
