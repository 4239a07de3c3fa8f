"""HeteroTrainer: one rank of a multimodal model (ViT encoder + projector, LLM) trained with
a layout per module (docs/contracts.md section 1: `encoder:...;llm:...`, `ranks=` when not
colocated; a plain layout gives both modules the same one).

Each module has its own (pp, dp, tp) mesh in the contract's rank order, its own
data-parallel optimizer (zero.ShardedAdamW; for zero=3 FSDP2's fsdp.FullyShardedState,
whose shards are the planner's boxes) and its own share of the global batch. A tied LLM
embedding is also its head; with llm pp > 1 its copies on the two end stages sum their
gradients (parallelism/training/ties.py, over HeteroMeshes.embedding). The
encoder's image tokens reach the LLM's first stage through the boundary communicator
(parallelism/training/boundary.py), whose plan is the box intersection of the two layouts
(parallelism/planner/activations.py); gradients return through it.

Schedule of one step (both placements run the same program; a rank does the parts of the
modules it belongs to):
1. encoder forward of the rank's encoder-dp share of the whole batch;
2. boundary forward: every LLM first-stage rank gets its dp share of image tokens;
3. the LLM's micro-batches (1F1B / GPipe for pp > 1), image tokens as a detached leaf;
4. boundary backward with that leaf's gradient, then encoder backward;
5. both optimizers step.
Colocated, one rank runs 1-5 in turn; non-colocated, the encoder ranks run 1, 2, 4, 5
while the LLM ranks run 2-5, so the encoder's work is off the LLM's ranks entirely.

Sequence parallelism (TrainConfig.sequence_parallel, llm tp > 1) is the LLM's only: its
combined sequence (image tokens + text) is split over its tp between layers and stages
(image_text_stage.py), so P + T must be a multiple of tp. The encoder runs without it
(its tokens reach the boundary replicated over the encoder's tp, as before).

Interleaved pipelines (llm vpp > 1) run the decoder's schedule (parallel.pipeline_schedule)
over ImageTextStage chunks; chunk 0, on pipeline rank 0, takes the image tokens. Context
parallelism (llm cp > 1): every cp rank receives its dp share of the image tokens whole
(image_boundary), keeps its chunk of image + text (image_text_stage.py) and returns its part
of their gradient, summed over cp (_image_grad); the encoder runs without cp.

Gradient scale: the loss is the mean over LLM dp replicas of their local means, so the
image-token gradient an LLM rank returns is dp_llm times the global loss's; the encoder's
optimizer averages over dp_enc ranks (uneven shares included, a rank without samples adds
zero), so encoder gradients are scaled by dp_enc / dp_llm to be the global loss's.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from parallelism.engine.shards import Key, LocalShard, rank_boxes, trainer_states
from parallelism.planner.activations import ActivationShape, BoundaryPlan, plan_boundary
from parallelism.layout.placement import Placement, hetero_refusal, place
from parallelism.layout.shards import chunk
from parallelism.layout.spec import ModuleLayout
from parallelism.layout.tensors import STATES
from parallelism.training.boundary import Boundary
from parallelism.training.context_parallel import ContextShard, context_group, parallelize_context
from parallelism.training.data import SyntheticImages, SyntheticTokens
from parallelism.training.image_text_stage import (ImageTextStage, context_text_loss, image_text_tp_plan, text_loss,
                                                   text_span)
from parallelism.training.kv_heads import head_groups, is_replicated, replicated_units
from parallelism.training.model import build_training_model
from parallelism.training.fsdp import FullyShardedState
from parallelism.training.parallel import (TIED_WEIGHT, StepResult, TrainConfig, TrainingError, TrainScalars,
                                           check_interleaved, device_type, pipeline_schedule)
from parallelism.training.zero import ParamSlot, ShardedAdamW, chunk_rows


def check_hetero_trainable(config: TrainConfig, placement: Placement) -> None:
    """Raise TrainingError naming the first setting this trainer cannot train."""
    mc = config.model_config
    if mc.encoder is None:
        raise TrainingError(f"{config.model} has no encoder: train it with the decoder trainer")
    if config.dataset is not None:
        raise TrainingError(f"{config.model} is multimodal: it trains on synthetic image-text pairs; a token "
                            "dataset holds no images (datasets feed decoder-only models)")
    refused = hetero_refusal(placement)
    if refused:
        raise TrainingError(refused)
    llm = placement.modules["llm"]
    check_interleaved(config, llm, "llm")
    image = mc.encoder.positions
    if (image + config.seq_len) % llm.cp:
        raise TrainingError(f"context parallelism splits the LLM's sequence (image tokens + text) over llm "
                            f"cp={llm.cp}: {image} + seq {config.seq_len} = {image + config.seq_len} is not a "
                            f"multiple of {llm.cp}")
    if config.sequence_parallel and llm.tp > 1:
        if (image + config.seq_len) % (llm.tp * llm.cp):
            chunks = f"each of the cp={llm.cp} chunks of " if llm.cp > 1 else ""
            raise TrainingError(f"sequence parallelism splits {chunks}the LLM's sequence (image tokens + text) over "
                                f"llm tp={llm.tp}: {image} + seq {config.seq_len} = {image + config.seq_len} is not a "
                                f"multiple of {llm.cp * llm.tp}")
    if config.global_batch % (llm.dp * config.micro_batches):
        raise TrainingError(f"global batch {config.global_batch} must divide into llm dp={llm.dp} x "
                            f"{config.micro_batches} micro-batches")


def _encoder_tp_plan(layers: int) -> dict:
    """The ViT tower and projector as Megatron splits them (docs/contracts.md section 2: q, k, v, fc1
    by rows, o and fc2 by columns; norms, embeddings and the row-parallel biases replicated).
    The output, like the input, is replicated over tp."""
    plan: dict = {"encoder.projector.fc1": ColwiseParallel(), "encoder.projector.fc2": RowwiseParallel()}
    for i in range(layers):
        p = f"encoder.layers.{i}"
        plan.update({f"{p}.attn.q": ColwiseParallel(), f"{p}.attn.k": ColwiseParallel(),
                     f"{p}.attn.v": ColwiseParallel(), f"{p}.attn.o": RowwiseParallel(),
                     f"{p}.mlp.fc1": ColwiseParallel(), f"{p}.mlp.fc2": RowwiseParallel()})
    return plan


def _ranks(ml: ModuleLayout) -> Tensor:
    """The module's ranks [pp, dp*cp, tp]: "dp" is the data index cp_rank + cp*dp_rank (parallel.py)."""
    return torch.arange(ml.offset, ml.offset + ml.world).view(ml.pp, ml.dp * ml.cp, ml.tp)


def _mesh(ml: ModuleLayout) -> DeviceMesh:
    """(pp, dp, tp) over the module's ranks; collective: every rank builds every module's."""
    return DeviceMesh(device_type(), _ranks(ml), mesh_dim_names=("pp", "dp", "tp"))


def image_boundary(placement: Placement, shape: ActivationShape) -> BoundaryPlan:
    """The image tokens' boundary: every LLM first-stage rank receives its dp share of them
    whole, replicated over tp and cp (each cp rank builds the whole image + text sequence and
    keeps its chunk of it), so the receiving layout is the LLM's with cp folded into tp
    (the contract's rank order tp_rank + tp*cp_rank)."""
    llm = placement.modules["llm"]
    receiver = dataclasses.replace(llm, tp=llm.tp * llm.cp, cp=1)
    return plan_boundary(placement.modules["encoder"], receiver, shape)


@dataclass(frozen=True)
class HeteroMeshes:
    """Each module's (pp, dp, tp) mesh and a group over all the layout's ranks: what a
    rebuilt trainer reuses (after a checkpoint's hand-over) without a collective over the
    default group, whose departed ranks (after a shrinking switch) would never answer."""

    encoder: DeviceMesh
    llm: DeviceMesh
    everyone: object  # ProcessGroup over ranks 0..world-1
    # The LLM's kv heads fewer than its tp: the TP ranks sharing this rank's head
    # (parallelism/training/kv_heads.py), None elsewhere.
    kv_heads: object | None = None
    # The LLM's cp > 1: the cp ranks splitting this rank's sequences (context_parallel.py).
    cp: object | None = None
    # A tied embedding and head with llm pp > 1: this rank and its peer on the LLM's other end
    # stage (same data index and tp coordinates), which sum their gradients of it
    # (parallel.LayoutMeshes'). None elsewhere.
    embedding: object | None = None

    @classmethod
    def build(cls, placement: Placement) -> HeteroMeshes:
        """Collective over the default group: every process builds it, member of the layout or not."""
        llm, units = placement.modules["llm"], replicated_units(placement)
        ranks = _ranks(llm)  # [pp, dp*cp, tp]
        encoder, llm_mesh = _mesh(placement.modules["encoder"]), _mesh(llm)
        everyone = dist.new_group(ranks=list(range(placement.world)))
        kv_heads = head_groups(ranks, units) if units is not None else None
        cp = context_group(ranks, llm.cp) if llm.cp > 1 else None
        embedding = None
        if llm.pp > 1 and any(t.split.place == "first+last" for t in placement.model.tensors):
            # torch makes every pair (collective), returns ours; with vpp the end virtual
            # stages are still on pipeline ranks 0 and pp-1
            pairs = [[int(ranks[0, d, t]), int(ranks[-1, d, t])] for d in range(llm.dp * llm.cp)
                     for t in range(llm.tp)]
            embedding, _ = dist.new_subgroups_by_enumeration(pairs)
        return cls(encoder, llm_mesh, everyone, kv_heads, cp, embedding)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def adopt(module: nn.Module, state: dict[str, tuple[Tensor, ...]], *, zero: int, dp: int, dp_rank: int, group,
          config: TrainConfig, step: int, grad_scale: float = 1.0, ties: dict[str, object] | None = None) -> ShardedAdamW:
    """Install the rank's bf16 boxes as `module`'s parameters and their fp32 chunks as the
    optimizer's (no copies); gradients go to the optimizer, times `grad_scale`. `ties`:
    ShardedAdamW's (replicated kv heads sum their gradients over the ranks sharing them)."""
    D = dp if zero >= 1 else 1
    slots, moments = [], {}
    for name, p in list(module.named_parameters()):
        data, master, exp_avg, exp_avg_sq = state[name]
        local_shape = tuple(_local(p).shape)
        if tuple(data.shape) != local_shape:
            raise TrainingError(f"{name}: param box {tuple(data.shape)} does not match the local shape {local_shape}")
        new = (DTensor.from_local(data, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                  stride=p.stride()) if isinstance(p, DTensor) else data)
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner).register_parameter(attr, nn.Parameter(new))
        slots.append(ParamSlot(name, data, chunk_rows(local_shape[0], D, dp_rank if D > 1 else 0), master))
        moments[name] = (exp_avg, exp_avg_sq)
    optimizer = ShardedAdamW(slots, group if dp > 1 else None, dp, lr=config.lr, weight_decay=config.weight_decay,
                             moments=moments, step=step, ties=ties)
    by_name = {s.name: s for s in slots}

    def hook_for(slot: ParamSlot):
        def hook(p: Tensor) -> None:
            grad = p.grad
            if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
                grad = grad.redistribute(p.device_mesh, p.placements)
            local = _local(grad)
            optimizer.accumulate(slot, local * grad_scale if grad_scale != 1.0 else local)
            p.grad = None
        return hook

    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(hook_for(by_name[name]))
    return optimizer


class _Encoder(nn.Module):
    """Holds the encoder under its catalog prefix, so parameter names are `encoder.*`; called
    as the module itself (under zero=3 it is the FSDP root, whose hooks gather the weights)."""

    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, images: Tensor) -> Tensor:
        return self.encoder(images)


class HeteroTrainer:
    """One rank's training program for a per-module layout of a multimodal model."""

    def __init__(self, config: TrainConfig, layout: str, rank: int, shards: dict[Key, LocalShard],
                 scalars: TrainScalars | None = None, *, meshes: HeteroMeshes | None = None,
                 check_plan: bool = True) -> None:
        """`meshes`, built by the caller, and `check_plan=False` (no plan fingerprint
        exchange) let the emulator's tracer build one rank of a target world on fake tensors
        and torch's fake process group (parallelism/emulator/trace_modules.py); the job runner's
        checkpoints rebuild a trainer on the meshes of the one they replace."""
        self.config, self.rank = config, rank
        self.spec, self.mc = config.tensors, config.model_config
        self.placement = place(self.spec, layout)
        self._index = {t.name: i for i, t in enumerate(self.spec.tensors)}
        check_hetero_trainable(config, self.placement)
        self.enc_ml, self.llm_ml = self.placement.modules["encoder"], self.placement.modules["llm"]
        self.scalars = scalars or TrainScalars()
        self.meshes = meshes or HeteroMeshes.build(self.placement)  # collective
        enc_mesh, llm_mesh, self.everyone = self.meshes.encoder, self.meshes.llm, self.meshes.everyone
        v = self.mc.encoder
        assert v is not None
        self.image_shape = ActivationShape(config.global_batch, v.positions, self.mc.llm.hidden)
        self.boundary = Boundary(image_boundary(self.placement, self.image_shape), rank)
        if rank < self.placement.world and check_plan:
            self.boundary.agree(self.everyone)
        self.images = SyntheticImages(v.channels, v.image, seed=config.seed)
        self.tokens = SyntheticTokens(self.mc.llm.vocab, config.seq_len, seed=config.seed)
        state = self._states_by_module(shards)
        # zero=3 keeps fp32 parameters (FSDP2's shards are the masters); zero<3 adopts bf16 boxes.
        fsdp = self.enc_ml.zero == 3 or self.llm_ml.zero == 3
        model = build_training_model(self.mc, device="meta", dtype=torch.float32 if fsdp else torch.bfloat16)
        self.encoder = self.llm_stage = self.pipeline = None
        enc_coord, llm_coord = enc_mesh.get_coordinate(), llm_mesh.get_coordinate()
        if enc_coord is not None:
            _, self.enc_dp_rank, _ = enc_coord
            self.encoder = _Encoder(model.encoder)
            if self.enc_ml.tp > 1:
                parallelize_module(self.encoder, enc_mesh["tp"], _encoder_tp_plan(v.layers))
            scale = self.enc_ml.dp / self.llm_ml.dp
            if self.enc_ml.zero == 3:
                self.enc_optimizer = FullyShardedState(
                    self.encoder, enc_mesh["dp"], torch.device(device_type()), state["encoder"], lr=config.lr,
                    weight_decay=config.weight_decay, step=self.scalars.step, rank=rank,
                    blocks=list(self.encoder.encoder.layers), grad_scale=scale)
            else:
                self.enc_optimizer = adopt(self.encoder, state["encoder"], zero=self.enc_ml.zero, dp=self.enc_ml.dp,
                                           dp_rank=self.enc_dp_rank, group=enc_mesh["dp"].get_group(), config=config,
                                           step=self.scalars.step, grad_scale=scale)
        if llm_coord is not None:
            self.pp_rank, data_rank, self.tp_rank = llm_coord
            self.llm_dp_rank, cp_rank = divmod(data_rank, self.llm_ml.cp)
            sequence_parallel = config.sequence_parallel and self.llm_ml.tp > 1
            self.llm_stage = ImageTextStage(model, self.pp_rank, self.llm_ml.pp,
                                            sequence_shards=self.llm_ml.tp if sequence_parallel else 1,
                                            virtual=self.llm_ml.vpp)
            if self.llm_ml.tp > 1:
                parallelize_module(self.llm_stage, llm_mesh["tp"],
                                   image_text_tp_plan(self.llm_stage, kv_units=replicated_units(self.placement)))
            ties = {}
            if self.meshes.kv_heads is not None:
                ties = {name: self.meshes.kv_heads for name, _ in self.llm_stage.named_parameters()
                        if is_replicated(self.spec.tensors[self._index[name]], self.llm_ml.tp)}
            if self.meshes.embedding is not None:  # the tied embedding's two end-stage copies
                ties[TIED_WEIGHT] = self.meshes.embedding
            # Context parallelism: attention over the cp group's gathered K/V (context_parallel.py).
            self.context = ContextShard(self.meshes.cp, self.llm_ml.cp, cp_rank) if self.llm_ml.cp > 1 else None
            if self.context is not None:
                parallelize_context(self.llm_stage, self.context)
            # Interleaved (vpp > 1): the virtual stages pp_rank + k*pp; chunk 0 takes the image tokens.
            self.chunks = ([self.llm_stage.chunk(self.pp_rank + k * self.llm_ml.pp) for k in range(self.llm_ml.vpp)]
                           if self.llm_ml.vpp > 1 else [self.llm_stage])
            # State replicated / ZeRO-chunked / FSDP-sharded over dp x cp: the optimizer's group
            # is the data index's (the mesh's "dp" dimension).
            if self.llm_ml.zero == 3:
                self.llm_optimizer = FullyShardedState(
                    self.llm_stage, llm_mesh["dp"], torch.device(device_type()), state["llm"], lr=config.lr,
                    weight_decay=config.weight_decay, step=self.scalars.step, rank=rank, ties=ties,
                    roots=self.chunks)
            else:
                self.llm_optimizer = adopt(self.llm_stage, state["llm"], zero=self.llm_ml.zero,
                                           dp=self.llm_ml.dp * self.llm_ml.cp, dp_rank=data_rank,
                                           group=llm_mesh["dp"].get_group(), config=config, step=self.scalars.step,
                                           ties=ties)
            if self.llm_ml.pp > 1:
                self.pipeline = self._build_pipeline(llm_mesh["pp"].get_group())
        del model

    @property
    def active(self) -> bool:
        return self.encoder is not None or self.llm_stage is not None

    def _states_by_module(self, shards: dict[Key, LocalShard]) -> dict[str, dict[str, tuple[Tensor, ...]]]:
        try:
            states = trainer_states(self.placement, self.rank, shards)
        except KeyError as exc:
            raise TrainingError(exc.args[0]) from None
        out: dict[str, dict[str, tuple[Tensor, ...]]] = {"encoder": {}, "llm": {}}
        for index, tensors in states.items():
            tensor = self.spec.tensors[index]
            out[tensor.split.module][tensor.name] = tensors
        return out

    def _build_pipeline(self, group):
        micro = self.config.micro_batches
        return pipeline_schedule(self.chunks, self.llm_ml.pp, micro, group,
                                 lambda logits, y: self._loss(logits, y) / micro)

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The micro-batch's mean text loss; under cp this rank's share of it, times cp."""
        if self.context is None:
            return text_loss(logits, targets)
        return context_text_loss(logits, targets, self.config.seq_len, self.llm_ml.cp)

    # --- one step -------------------------------------------------------------------
    def _encode(self) -> Tensor:
        """This rank's image tokens (its encoder-dp share), or the boundary's empty placeholder."""
        if self.encoder is not None:
            lo, hi = (int(v) for v in chunk(self.config.global_batch, self.enc_ml.dp, self.enc_dp_rank))
            if hi > lo:
                images = self.images.batch(self.scalars.data.samples + lo, hi - lo)
                return self.encoder(images)
            if self.enc_ml.zero == 3:
                # FSDP2's all-gathers and reduce-scatters are collective over the encoder's dp
                # ranks: a rank without samples runs them too, on no images (zero gradients).
                v = self.mc.encoder
                return self.encoder(torch.zeros(0, v.channels, v.image, v.image))[:, :0]
        return self.boundary.empty_input(torch.bfloat16)

    def _run_llm(self, image_tokens: Tensor | None) -> Tensor:
        """The LLM's micro-batches; returns this rank's summed micro-batch losses (last stage)."""
        per_dp = self.config.global_batch // self.llm_ml.dp
        tokens, targets = self.tokens.batch(self.scalars.data.samples + self.llm_dp_rank * per_dp, per_dp)
        if self.context is not None:  # the text targets in this rank's chunk of image + text
            lo, hi = text_span(self.mc.encoder.positions, self.config.seq_len, self.context)
            targets = targets[:, lo:hi]
        micro = self.config.micro_batches
        loss_sum = torch.zeros(1, dtype=torch.float64)
        if self.pipeline is None:
            for x, p, y in zip(tokens.chunk(micro), image_tokens.chunk(micro), targets.chunk(micro)):
                loss = self._loss(self.llm_stage(x, p), y)
                (loss / micro).backward()
                loss_sum += loss.detach().double()
        elif self.pp_rank == 0:
            self.pipeline.step(tokens, image_tokens)
        elif self.pp_rank == self.llm_ml.pp - 1:
            losses: list[Tensor] = []
            self.pipeline.step(target=targets, losses=losses)
            loss_sum += sum(float(v.detach()) for v in losses) * micro
        else:
            self.pipeline.step()
        return loss_sum

    def _image_grad(self, grad: Tensor) -> Tensor:
        """The image tokens' gradient to return: under cp each rank holds the part of its
        chunk's positions (and, through the K/V gathers, of the later chunks' attention to
        them); their sum over cp, divided by cp as the cp-scaled losses are, is the dp
        replica's gradient (the encoder's grad_scale then applies as without cp)."""
        if self.context is None:
            return grad
        total = grad.float()
        dist.all_reduce(total, group=self.context.group)
        return (total / self.llm_ml.cp).to(grad.dtype)

    def step(self) -> StepResult | None:
        """One optimizer step of both modules over the global batch; every rank of the layout
        returns the global mean loss, ranks outside it None."""
        if not self.active:
            return None
        started = time.perf_counter()
        received = self.boundary.apply(self._encode())          # steps 1-2
        loss_sum = torch.zeros(1, dtype=torch.float64)
        grad = torch.zeros_like(received)
        if self.llm_stage is not None:
            leaf = received.detach().requires_grad_(True) if self.pp_rank == 0 else None
            loss_sum = self._run_llm(leaf)                        # step 3
            if leaf is not None:
                grad = self._image_grad(leaf.grad)
            if not (self.pp_rank == self.llm_ml.pp - 1 and self.tp_rank == 0):
                loss_sum.zero_()
        # Step 4 before the LLM's optimizer: non-colocated encoder ranks wait for nothing else.
        torch.autograd.backward(received, grad)
        if self.llm_stage is not None:
            self.llm_optimizer.step(self.config.lr_at(self.scalars.step))
        if self.encoder is not None:
            self.enc_optimizer.step(self.config.lr_at(self.scalars.step))
        dist.all_reduce(loss_sum, group=self.everyone)
        self.scalars.step += 1
        self.scalars.data = self.scalars.data.advance(self.config.global_batch)
        micro = self.config.micro_batches
        return StepResult(self.scalars.step, float(loss_sum.item()) / (micro * self.llm_ml.dp * self.llm_ml.cp),
                          time.perf_counter() - started, self.config.global_batch * self.config.seq_len)

    def hand_over(self) -> tuple[dict[Key, LocalShard], TrainScalars]:
        """This rank's state as local shards (the contract's boxes); the trainer is unusable afterwards."""
        index_of = {t.name: i for i, t in enumerate(self.spec.tensors)}
        boxes = rank_boxes(self.placement, self.rank)
        out: dict[Key, LocalShard] = {}
        for optimizer in ([self.enc_optimizer] if self.encoder is not None else []) + (
                [self.llm_optimizer] if self.llm_stage is not None else []):
            for name, tensors in optimizer.hand_over().items():
                index = index_of[name]
                for state, data in zip(STATES, tensors):
                    if (index, state) in boxes:  # an empty chunk is no shard (docs/contracts.md section 3)
                        out[(index, state)] = LocalShard(self.spec.tensors[index], state, boxes[(index, state)],
                                                         data.detach())
        self.encoder = self.llm_stage = self.pipeline = None
        self.chunks = []
        return out, self.scalars
