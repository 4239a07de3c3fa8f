"""ParallelTrainer: one rank of a decoder LLM trained on a layout (docs/contracts.md sections 1-2)
with torch's own parallelism: DTensor tensor parallelism (`parallelize_module`), a
replicated / ZeRO-1 data-parallel optimizer (parallelism/training/zero.py) and
`torch.distributed.pipelining` for pp > 1. gloo on CPU, NCCL on CUDA, one code path.

A trainer is always built from local shards (one tensor per (tensor, state) box the rank
holds, parallelism/engine/shards.py): from initial values at the start, from the transition
engine's output after a switch. The shards are adopted, not copied, and `hand_over()`
returns them and drops every other reference, so a switch can free what it has sent.

Mesh: (pp, dp, tp) over ranks 0..world-1, which is the contract's rank order
`tp_rank + tp * (d + dp * cp * pp_rank)` with the data index d = cp_rank + cp * dp_rank:
the mesh's "dp" dimension is d, dp*cp long, because the planner replicates or ZeRO-chunks
every state over dp x cp, so that is the optimizer's group (gradients averaged, ZeRO chunks).
Context parallelism (cp > 1) splits each sequence over the cp consecutive data indices of a
dp replica (parallelism/training/context_parallel.py). Every rank of the process group,
member or not, builds the mesh (creating process groups is collective); ranks outside it
hold no state in this layout.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from parallelism.engine.shards import DTYPES, Key, LocalShard, box_shape, rank_boxes, trainer_states
from parallelism.engine.zero_pages import untouched_zeros
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field
from parallelism.layout.placement import Placement, place
from parallelism.layout.shards import b_dim, chunk
from parallelism.layout.spec import DEFAULT_MODULE, ModuleLayout
from parallelism.layout.tensors import STATES
from parallelism.training.context_parallel import ContextShard, context_group, parallelize_context, split_sequence
from parallelism.training.data import DataPosition, check_training_data, sample_digest, training_data
from parallelism.training.expert_parallel import parallelize_moe
from parallelism.training.init import initial_value
from parallelism.training.kv_heads import ReplicatedHeadsColwise, head_groups, is_replicated, replicated_units
from parallelism.training.model import build_training_model
from parallelism.training.stage import DecoderStage
from parallelism.training.fsdp import FullyShardedState, State
from parallelism.training.zero import ParamSlot, Replicas, ShardedAdamW, chunk_rows


TIED_WEIGHT = "llm.embed.weight"  # a tied model's embedding, also its output head
HEAD_NORMS = (".attn.q_norm.weight", ".attn.k_norm.weight")  # per-head norms (Qwen3): one weight for every head


class TrainingError(ValueError):
    """A layout or run setting the trainer cannot train, with the reason."""


@dataclass(frozen=True)
class TrainConfig(NamesAModel):
    model: str = "tiny-gpt"
    global_batch: int = 8
    seq_len: int = 32
    micro_batches: int = 2
    seed: int = 0
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 5
    total_steps: int = 100   # length of the cosine schedule
    weight_decay: float = 0.01
    # Megatron-style sequence parallelism (Korthikanti et al. 2022): with tp > 1, norms and
    # residual adds run on seq/tp positions; the TP all-reduces become reduce-scatter +
    # all-gather. Same state layout, so switches are unaffected.
    sequence_parallel: bool = False
    # A dataset directory (parallelism/datasets/manifest.py) to train on; None: the synthetic
    # tokens of parallelism/training/data.py. Either way sample i is a pure function of (data, seed, i).
    dataset: str | None = None
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once (NamesAModel)

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine decay to min_lr_ratio * lr at total_steps: a pure function
        of the step, so carrying the step count carries the schedule."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainScalars:
    """What a switch carries besides the tensors: step (also the LR schedule's position),
    the data position and the RNG state of the ranks."""

    step: int = 0
    data: DataPosition = field(default_factory=DataPosition)
    rng: Tensor = field(default_factory=torch.get_rng_state)


@dataclass(frozen=True)
class StepResult:
    step: int
    loss: float | None  # None: not summed yet (ParallelTrainer.trained)
    seconds: float
    tokens: int
    # What this rank read: global samples first_sample .. first_sample + samples - 1, and a digest
    # of their identities (data.sample_digest): the record that proves the sample order.
    first_sample: int = -1
    samples: int = 0
    sample_digest: str = ""


def check_trainable(config: TrainConfig, placement: Placement) -> None:
    """Raise TrainingError naming the first setting this trainer cannot train."""
    layout = placement.layout
    if len(layout.modules) != 1 or layout.modules[0].module != DEFAULT_MODULE:
        raise TrainingError(f"{layout}: per-module (heterogeneous) layouts are not trained yet (issue 8)")
    ml = next(iter(placement.modules.values()))
    mc = config.model_config
    if mc.encoder is not None:
        raise TrainingError(f"{config.model} is multimodal; the parallel trainer trains decoder-only models")
    check_interleaved(config, ml)
    if ml.cp > 1 and mc.llm.attention_sinks:
        raise TrainingError(f"{config.model}: attention sinks with context parallelism (cp={ml.cp}) are not "
                            "trained: each chunk's softmax would count the sink once")
    window = mc.llm.sliding_window if mc.llm.window_layers else 0
    if ml.cp > 1 and 0 < window < config.seq_len:
        raise TrainingError(f"{config.model}: sliding-window attention ({window} keys) with context parallelism "
                            f"(cp={ml.cp}) is not trained: a chunk's window would reach into its neighbour's")
    if config.seq_len % ml.cp:
        raise TrainingError(f"context parallelism splits the sequence over cp={ml.cp}: seq {config.seq_len} "
                            f"is not a multiple of {ml.cp}")
    if config.sequence_parallel and ml.tp > 1:
        if config.seq_len % (ml.tp * ml.cp):
            chunks = f"each of the cp={ml.cp} chunks of " if ml.cp > 1 else ""
            raise TrainingError(f"sequence parallelism splits {chunks}the sequence over tp={ml.tp}: "
                                f"seq {config.seq_len} is not a multiple of {ml.cp * ml.tp}")
    per_rank = config.global_batch / ml.dp
    if config.global_batch % (ml.dp * config.micro_batches):
        raise TrainingError(f"global batch {config.global_batch} must divide into dp={ml.dp} x "
                            f"{config.micro_batches} micro-batches (got {per_rank:g} samples per dp rank)")
    try:
        check_training_data(config)
    except ValueError as exc:
        raise TrainingError(f"dataset {config.dataset}: {exc}") from None


def check_interleaved(config: TrainConfig, ml: ModuleLayout, module: str = "") -> None:
    """torch's ScheduleInterleaved1F1B rule for a layout with vpp > 1 (`module`: the name the
    message gives it, a multimodal model's module)."""
    if ml.vpp > 1:
        rounds = max(1, config.micro_batches // ml.pp)
        if config.micro_batches % rounds:
            prefix = f"{module}: " if module else ""
            raise TrainingError(f"{prefix}vpp={ml.vpp}: the interleaved schedule runs the {config.micro_batches} "
                                f"micro-batches in rounds of pp={ml.pp}; micro-batches must be a multiple of {rounds} "
                                f"(micro-batches // pp)")


def pipeline_schedule(chunks: list[nn.Module], pp: int, micro: int, group, loss_fn):
    """torch.distributed.pipelining's schedule of one pipeline rank: 1F1B (GPipe when
    micro-batches < pp) over its one stage, or, with several chunks (vpp > 1), the
    interleaved 1F1B over its virtual stages, chunk.index of pp*len(chunks) (the planner's
    numbering: chunk c on pipeline rank c % pp). `loss_fn` divides by the micro-batches:
    the gradient hooks take every gradient as it is produced, so the schedule's own
    scale_grads would see none."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    device = torch.device(device_type())
    if len(chunks) > 1:
        virtual = pp * len(chunks)
        stages = [PipelineStage(chunk, chunk.index, virtual, device, group=group) for chunk in chunks]
        return ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn, scale_grads=False)
    (stage,) = chunks
    schedule = Schedule1F1B if micro >= pp else ScheduleGPipe
    return schedule(PipelineStage(stage, stage.index, pp, device, group=group), micro, loss_fn=loss_fn,
                    scale_grads=False)


@dataclass(frozen=True)
class LayoutMeshes:
    """The (pp, dp, tp) mesh of a layout (its "dp" dimension the data index over dp x cp),
    its one-dimensional slices, and a group over all its ranks. Built once, outside any
    FakeTensorMode (slicing a mesh runs real tensor ops)."""

    mesh: DeviceMesh
    tp: DeviceMesh
    dp: DeviceMesh
    pp: DeviceMesh
    everyone: object  # ProcessGroup over ranks 0..world-1
    # A tied embedding and head with pp > 1: this rank and its peer on the other end stage
    # (the same dp and tp coordinates), which sum their gradients of the shared weight
    # (Megatron-LM's embedding group). None elsewhere.
    embedding: object | None = None
    # kv heads fewer than tp: the TP ranks holding this rank's kv head, which sum their
    # gradients of it (parallelism/training/kv_heads.py). None elsewhere.
    kv_heads: object | None = None
    # ep > 1: the (pp, edp, ep, tp) mesh, the dp ranks cut as d = edp_index * ep + ep_index:
    # `ep` is the all-to-all group of this rank's experts' owners, `expert_dp` the ranks
    # holding the same experts (parallelism/training/expert_parallel.py). None elsewhere.
    ep: object | None = None
    expert_dp: DeviceMesh | None = None
    # cp > 1: the cp ranks splitting this rank's sequences (consecutive data indices of one
    # dp replica, the same pp and tp coordinates). None elsewhere.
    cp: object | None = None

    @classmethod
    def build(cls, placement: Placement) -> LayoutMeshes:
        """Collective over the default group: every process builds it, member of the layout or not."""
        ml = next(iter(placement.modules.values()))
        tied = any(t.split.place == "first+last" for t in placement.model.tensors)  # held by both end stages
        data = ml.dp * ml.cp  # the data index d = cp_rank + cp * dp_rank
        ranks = torch.arange(ml.world).view(ml.pp, data, ml.tp)
        mesh = DeviceMesh(device_type(), ranks, mesh_dim_names=("pp", "dp", "tp"))
        everyone = dist.new_group(ranks=list(range(ml.world)))
        embedding = None
        if tied and ml.pp > 1:  # the end stages' ranks at each (dp, tp): torch makes every pair, returns ours
            pairs = [[int(ranks[0, d, t]), int(ranks[-1, d, t])] for d in range(data) for t in range(ml.tp)]
            embedding, _ = dist.new_subgroups_by_enumeration(pairs)
        units = replicated_units(placement)
        kv_heads = head_groups(ranks, units) if units is not None else None
        experts = None
        if ml.ep > 1:
            experts = DeviceMesh(device_type(), ranks.view(ml.pp, data // ml.ep, ml.ep, ml.tp),
                                 mesh_dim_names=("pp", "edp", "ep", "tp"))
        context = context_group(ranks, ml.cp) if ml.cp > 1 else None
        if mesh.get_coordinate() is None:
            return cls(mesh, mesh, mesh, mesh, everyone)
        return cls(mesh, mesh["tp"], mesh["dp"], mesh["pp"], everyone, embedding, kv_heads,
                   experts["ep"].get_group() if experts is not None else None,
                   experts["edp"] if experts is not None else None, context)


def device_type() -> str:
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def tp_plan(stage: DecoderStage, sequence_parallel: bool = False, kv_units: int | None = None) -> dict:
    """DTensor's tensor-parallel plan of a stage. With sequence parallelism the residual
    stream between sublayers is the rank's [B, T/tp, H] slice (Shard(1)): norms run on it
    (SequenceParallel), each sublayer all-gathers its input (PrepareModuleInput) and
    reduce-scatters its output (RowwiseParallel to Shard(1)), as Megatron-LM does.
    `kv_units`: the kv heads when fewer than tp: k and v keep the rank's replicated head
    (ReplicatedHeadsColwise).
    A sublayer with several column-parallel projections of one input (q, k, v; a gated MLP's
    gate and up) takes that input as a DTensor (PrepareModuleInput), so their input gradients
    (Partial) are summed locally and meet in one all-reduce (or, with sequence parallelism,
    one reduce-scatter), as Megatron's fused QKV projection does; each projection converting
    a plain tensor itself would all-reduce its own gradient (three per attention block)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    if stage.tied and stage.last and not stage.first:  # the head's copy of a tied embedding: vocab rows split
        plan["llm.embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if stage.first:
        if stage.llm.seq_scatter is not None:  # learned positions (or image tokens): all-reduce, add them, split
            plan["llm.embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            plan["llm.seq_scatter"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        else:
            plan["llm.embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if stage.last:
        if sequence_parallel:
            plan["llm.final_norm"] = SequenceParallel()
        if stage.llm.head is not None:
            plan["llm.head"] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    for i, layer in stage.llm.layers.items():
        p = f"llm.layers.{i}"
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
            norms = ("attn_norm", "mlp_norm") if hasattr(layer, "attn_norm") else ("ln1", "ln2")  # llama / gpt
            plan.update({f"{p}.{norms[0]}": SequenceParallel(), f"{p}.{norms[1]}": SequenceParallel(),
                         f"{p}.attn": gather,
                         # a MoE layer's block takes the gathered sequence too (expert_parallel.py)
                         f"{p}.{'moe' if getattr(layer, 'moe', None) is not None else 'mlp'}": PrepareModuleInput(
                             input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        for proj in ("q", "k", "v"):
            plan[f"{p}.attn.{proj}"] = ColwiseParallel()
        if kv_units is not None:
            plan[f"{p}.attn.k"] = plan[f"{p}.attn.v"] = ReplicatedHeadsColwise(kv_units)
        if not sequence_parallel:
            plan[f"{p}.attn"] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                   desired_input_layouts=(Replicate(), None))
        plan[f"{p}.attn.o"] = RowwiseParallel(output_layouts=seq)
        if getattr(layer, "mlp", None) is not None:
            if hasattr(layer.mlp, "up"):  # llama style, with or without a gate
                plan.update({f"{p}.mlp.up": ColwiseParallel(), f"{p}.mlp.down": RowwiseParallel(output_layouts=seq)})
                if layer.mlp.gate is not None:
                    plan[f"{p}.mlp.gate"] = ColwiseParallel()
                if not sequence_parallel:
                    plan[f"{p}.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                          desired_input_layouts=(Replicate(),))
            else:
                plan.update({f"{p}.mlp.fc1": ColwiseParallel(), f"{p}.mlp.fc2": RowwiseParallel(output_layouts=seq)})
    return plan


def shard_sinks(stage: nn.Module, tp: int, tp_rank: int) -> None:
    """Keep each attention's sink logits of the rank's query heads (a plain parameter: the
    heads' slice is the rank's own, its gradient needs no sum over tp)."""
    for module in stage.modules():
        sinks = getattr(module, "sinks", None)
        if isinstance(sinks, nn.Parameter):
            lo, hi = chunk(sinks.shape[0], tp, tp_rank)
            module.sinks = nn.Parameter(sinks.detach().narrow(0, int(lo), int(hi - lo)).clone(),
                                        requires_grad=sinks.requires_grad)


def _local(p: Tensor) -> Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def initial_shards(placement: Placement, rank: int, seed: int) -> dict[Key, LocalShard]:
    """This rank's boxes of a freshly initialized model (parallelism/training/init.py values):
    master = the fp32 value, param = its bf16 cast, Adam moments zero."""
    spec = placement.model
    out: dict[Key, LocalShard] = {}
    full: dict[int, Tensor] = {}
    for (index, state), box in rank_boxes(placement, rank).items():
        tensor = spec.tensors[index]
        shape = box_shape(tensor, box)
        if state in ("exp_avg", "exp_avg_sq"):
            data = untouched_zeros(shape, DTYPES[state])
        else:
            if index not in full:
                full[index] = initial_value(tensor.name, tensor.shape, seed)
            whole = (0, tensor.shape[0], 0, tensor.shape[b_dim(tensor)] if b_dim(tensor) is not None else 0)
            data = LocalShard(tensor, state, whole, full[index]).region(box).to(DTYPES[state]).contiguous()
        out[(index, state)] = LocalShard(tensor, state, box, data)
    return out


class ParallelTrainer:
    """One rank's training program for `layout` (a rank outside the layout's world gets
    `active == False` and holds nothing)."""

    def __init__(self, config: TrainConfig, layout: str, rank: int, shards: dict[Key, LocalShard],
                 scalars: TrainScalars | None = None, meshes: LayoutMeshes | None = None) -> None:
        self.config, self.rank = config, rank
        self.spec = config.tensors
        self.placement = place(self.spec, layout)
        check_trainable(config, self.placement)
        self.ml = next(iter(self.placement.modules.values()))
        self.scalars = scalars or TrainScalars()
        # The last step whose update is done, its loss not yet summed: a rank whose peer is
        # lost in the loss all-reduce still tells what it trained (agents/runtime/train_loop.py).
        self.trained: StepResult | None = None
        self.on_update: Callable[[int], None] | None = None  # fault injection: (step) once it is trained
        self.meshes = meshes or LayoutMeshes.build(self.placement)  # collective
        coordinate = self.meshes.mesh.get_coordinate()
        self.active = coordinate is not None
        if not self.active:
            return
        # data_rank: the data index d = cp_rank + cp * dp_rank (docs/contracts.md section 2).
        self.pp_rank, self.data_rank, self.tp_rank = coordinate
        self.dp_rank, self.cp_rank = divmod(self.data_rank, self.ml.cp)
        self.data = training_data(config)
        # zero=3 keeps fp32 parameters (FSDP2's shards are the masters); otherwise the model is bf16.
        dtype = torch.float32 if self.ml.zero == 3 else torch.bfloat16
        model = build_training_model(config.model_config, device="meta", dtype=dtype)
        sequence_parallel = config.sequence_parallel and self.ml.tp > 1
        self.stage = DecoderStage(model, self.pp_rank, self.ml.pp,
                                  sequence_shards=self.ml.tp if sequence_parallel else 1, virtual=self.ml.vpp)
        del model
        if self.ml.tp > 1:
            parallelize_module(self.stage, self.meshes.tp,
                               tp_plan(self.stage, sequence_parallel, replicated_units(self.placement)))
            shard_sinks(self.stage, self.ml.tp, self.tp_rank)
        # MoE layers: experts sharded over tp and ep, tokens sent to their owners (expert_parallel.py).
        self.routers: list[str] = []
        if config.model_config.llm.experts and (self.ml.tp > 1 or self.ml.ep > 1):
            self.routers = parallelize_moe(self.stage, tp_mesh=self.meshes.tp if self.ml.tp > 1 else None,
                                           sequence_parallel=sequence_parallel, ep_group=self.meshes.ep,
                                           ep=self.ml.ep, ep_rank=self.data_rank % self.ml.ep)
        # Context parallelism: attention over the cp group's gathered K/V, positions offset.
        self.context = (ContextShard(self.meshes.cp, self.ml.cp, self.cp_rank) if self.ml.cp > 1 else None)
        if self.context is not None:
            parallelize_context(self.stage, self.context)
        # Interleaved: the virtual stages this rank runs, pp_rank + k*pp (built on the stage's own modules).
        self.chunks = ([self.stage.chunk(self.pp_rank + k * self.ml.pp) for k in range(self.ml.vpp)]
                       if self.ml.vpp > 1 else [self.stage])
        state = self._states_by_name(shards)
        self.ties = self._ties()
        if self.ml.zero == 3:
            self.optimizer = FullyShardedState(self.stage, self.meshes.dp, torch.device(device_type()), state,
                                               lr=config.lr, weight_decay=config.weight_decay,
                                               step=self.scalars.step, rank=rank, ties=self.ties, roots=self.chunks,
                                               experts=self.meshes.expert_dp)
        else:
            self._adopt(state)
        self.pipeline = self._build_pipeline() if self.ml.pp > 1 else None

    def _ties(self) -> dict[str, object]:
        """{parameter name: group} of the weights whose copies sum their gradients: a tied
        embedding's two end stages, the TP ranks sharing a replicated kv head, the TP
        replicas of a MoE router (its gradient is a partial sum over tp, expert_parallel.py)."""
        ties = {}
        if self.ml.tp > 1:
            # Qwen3's per-head q/k norms are replicated too, and each TP rank's heads give part of their gradient.
            norms = [name for name, _ in self.stage.named_parameters() if name.endswith(HEAD_NORMS)]
            ties.update({name: self.meshes.tp.get_group() for name in [*self.routers, *norms]})
        if self.meshes.embedding is not None:
            ties[TIED_WEIGHT] = self.meshes.embedding
        if self.meshes.kv_heads is not None:
            replicated = {t.name for t in self.spec.tensors if is_replicated(t, self.ml.tp)}
            ties.update({name: self.meshes.kv_heads for name, _ in self.stage.named_parameters() if name in replicated})
        return ties

    # --- state in and out ---------------------------------------------------------
    def _states_by_name(self, shards: dict[Key, LocalShard]) -> dict[str, State]:
        """(param, master, exp_avg, exp_avg_sq) local boxes by parameter name, checked complete
        (empty tensors where the rank's chunk is empty)."""
        try:
            states = trainer_states(self.placement, self.rank, shards)
        except KeyError as exc:
            raise TrainingError(exc.args[0]) from None
        return {self.spec.tensors[i].name: tensors for i, tensors in states.items()}

    def _adopt(self, state: dict[str, State]) -> None:
        """zero < 3: install the bf16 boxes as the parameters and the fp32 chunks as the
        optimizer's masters and moments (no copies)."""
        holders = self.ml.dp * self.ml.cp  # the ranks holding the same boxes: dp x cp
        D = holders if self.ml.zero >= 1 else 1
        # Expert parallelism: the experts' boxes are held by the ranks with the same data index
        # mod ep (`expert_dp`), which ZeRO chunks them over (docs/contracts.md section 2).
        experts = {t.name for t in self.spec.tensors if t.split.ep_dim is not None} if self.ml.ep > 1 else set()
        expert_dp = holders // self.ml.ep
        expert_replicas = (Replicas(self.meshes.expert_dp.get_group() if expert_dp > 1 else None, expert_dp)
                           if experts else None)
        slots, moments = [], {}
        for name, p in list(self.stage.named_parameters()):
            data, master, exp_avg, exp_avg_sq = state[name]
            local_shape = tuple(_local(p).shape)
            if tuple(data.shape) != local_shape:
                raise TrainingError(f"rank {self.rank}: {name} param box {tuple(data.shape)} does not match "
                                    f"the parameter's local shape {local_shape}")
            new = (DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride()) if isinstance(p, DTensor) else data)
            module_name, _, attr = name.rpartition(".")
            self.stage.get_submodule(module_name).register_parameter(attr, nn.Parameter(new))
            expert = name in experts
            parts, part = (expert_dp if D > 1 else 1, self.data_rank // self.ml.ep) if expert else (D, self.data_rank)
            rows = chunk_rows(local_shape[0], parts, part if parts > 1 else 0)
            if master.shape[0] != rows[1] - rows[0]:
                raise TrainingError(f"rank {self.rank}: {name} master box has {master.shape[0]} rows, the "
                                    f"ZeRO chunk {rows}")
            slots.append(ParamSlot(name, data, rows, master, replicas=expert_replicas if expert else None))
            moments[name] = (exp_avg, exp_avg_sq)
        self.optimizer = ShardedAdamW(slots, self.meshes.dp.get_group() if holders > 1 else None, holders,
                                      lr=self.config.lr, weight_decay=self.config.weight_decay, moments=moments,
                                      step=self.scalars.step, ties=self.ties)
        by_name = {s.name: s for s in slots}
        for name, p in self.stage.named_parameters():
            p.register_post_accumulate_grad_hook(self._grad_hook(by_name[name]))

    def _grad_hook(self, slot: ParamSlot):
        def hook(p: Tensor) -> None:
            grad = p.grad
            # DTensor may hand back a gradient in another placement than its parameter's (the
            # row-parallel embedding's comes back replicated): take this rank's shard of it.
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                grad = grad.redistribute(p.device_mesh, p.placements)
            local = _local(grad)
            if tuple(local.shape) != tuple(slot.local.shape):
                raise TrainingError(f"rank {self.rank}: {slot.name} gradient {tuple(local.shape)} does not match "
                                    f"the parameter box {tuple(slot.local.shape)}")
            self.optimizer.accumulate(slot, local)
            p.grad = None
        return hook

    @property
    def torn(self) -> bool:
        """True while the optimizer is between updating its states and publishing the new
        parameters: a failure then leaves this rank's state half stepped."""
        return bool(getattr(self.optimizer, "updating", False))

    def hand_over(self) -> tuple[dict[Key, LocalShard], TrainScalars]:
        """This rank's state as local shards; the trainer is unusable afterwards (it keeps no
        reference, so the transition engine can free each shard after sending it)."""
        if not self.active:
            return {}, self.scalars
        index_of = {t.name: i for i, t in enumerate(self.spec.tensors)}
        boxes = rank_boxes(self.placement, self.rank)
        out: dict[Key, LocalShard] = {}
        for name, tensors in self.optimizer.hand_over().items():
            index = index_of[name]
            for state, data in zip(STATES, tensors):
                key = (index, state)
                if key in boxes:  # an empty chunk is no shard (docs/contracts.md section 3)
                    out[key] = LocalShard(self.spec.tensors[index], state, boxes[key], data.detach())
        self.optimizer, self.stage, self.pipeline, self.chunks = None, None, None, []
        self.active = False
        return out, self.scalars

    # --- training -----------------------------------------------------------------
    def _build_pipeline(self):
        """parallel.pipeline_schedule over this rank's stage, or its virtual stages pp_rank + k*pp."""
        micro = self.config.micro_batches

        def loss_fn(logits, y):
            return cross_entropy_loss(logits, y) / micro

        return pipeline_schedule(self.chunks, self.ml.pp, micro, self.meshes.pp.get_group(), loss_fn)

    def _local_batch(self) -> tuple[Tensor, Tensor]:
        """The dp replica's samples; under context parallelism this rank's chunk of their sequences."""
        per_dp = self.config.global_batch // self.ml.dp
        first = self.scalars.data.samples + self.dp_rank * per_dp
        tokens, targets = self.data.batch(first, per_dp)
        self.read = {"first_sample": first, "samples": per_dp,
                     "sample_digest": sample_digest(self.data, first, per_dp)}
        return split_sequence(tokens, targets, self.context) if self.context is not None else (tokens, targets)

    def step(self) -> StepResult | None:
        """One optimizer step over the global batch; the loss is the global mean (every rank
        of the layout returns it). Ranks outside the layout return None."""
        if not self.active:
            return None
        started = time.perf_counter()
        tokens, targets = self._local_batch()
        loss_sum = torch.zeros(1, dtype=torch.float64, device=tokens.device)  # NCCL reduces device tensors
        micro = self.config.micro_batches
        if self.pipeline is None:
            for x, y in zip(tokens.chunk(micro), targets.chunk(micro)):
                loss = cross_entropy_loss(self.stage(x), y)
                (loss / micro).backward()
                loss_sum += loss.detach().double()
        else:
            losses: list[Tensor] = []
            if self.pp_rank == 0:
                self.pipeline.step(tokens)
            elif self.pp_rank == self.ml.pp - 1:
                self.pipeline.step(target=targets, losses=losses)
            else:
                self.pipeline.step()
            loss_sum += sum(float(v.detach()) for v in losses) * micro
        self.optimizer.step(self.config.lr_at(self.scalars.step))
        # The scalars move with the state, before the loss all-reduce: a rank whose peer is
        # lost there keeps a consistent state after the step (agents/runtime/orphan.py).
        self.scalars.step += 1
        self.scalars.data = self.scalars.data.advance(self.config.global_batch)
        tokens = self.config.global_batch * self.config.seq_len
        self.trained = StepResult(self.scalars.step, None, time.perf_counter() - started, tokens, **self.read)
        if self.on_update is not None:
            self.on_update(self.scalars.step)
        # Global mean loss: the last stage's TP rank 0 of every data index contributes (the
        # cp chunks of a sequence are equally long, so the mean of their means is the mean).
        if not (self.pp_rank == self.ml.pp - 1 and self.tp_rank == 0):
            loss_sum.zero_()
        dist.all_reduce(loss_sum, group=self.meshes.everyone)
        return StepResult(self.scalars.step, float(loss_sum.item()) / (micro * self.ml.dp * self.ml.cp),
                          time.perf_counter() - started, tokens, **self.read)


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
