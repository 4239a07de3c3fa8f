"""Tiny Hugging Face models built locally with transformers (random weights from a fixed seed,
no downloads), saved with save_pretrained, and their reference logits.

Weights are redrawn at a scale where every tensor matters to the logits: transformers'
N(0, 0.02) init leaves attention nearly uniform and the router nearly indifferent, so a
swapped q/k or a misplaced expert would hardly move the logits; here weights are
N(0, (1.5/sqrt(fan_in))^2), norm weights 1 + N(0, 0.2^2), biases N(0, 0.2^2).
"""
from __future__ import annotations

import math
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

VOCAB = 128
TOKENS_SEED = 7


def hf_config(kind: str, **overrides):
    """A tiny transformers config of `kind` (llama, qwen2, qwen3, qwen3_moe, mixtral, gpt2)."""
    import transformers

    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, rms_norm_eps=1e-6)
    elif kind == "qwen2":  # overrides at construction: its layer_types follow use_sliding_window there
        cfg, overrides = transformers.Qwen2Config(**common, **overrides), {}
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=8, tie_word_embeddings=True)
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    elif kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, head_dim=8, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                          norm_topk_prob=False)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(kind)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


@torch.no_grad()
def build_hf_model(kind: str, seed: int = 0, **overrides):
    """A transformers model of `kind` with weights redrawn from `seed` (see the module's docstring)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(kind, **overrides), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=generator)
        if p.ndim == 1:
            base = 1.0 if name.endswith("weight") else 0.0  # norm weights around 1, biases around 0
            p.copy_(base + 0.2 * noise)
        else:
            fan_in = p.shape[0] if "c_" in name else p.shape[-1]  # GPT-2's Conv1D weights are (in, out)
            p.copy_(noise * 1.5 / math.sqrt(fan_in))
    model.eval()
    return model


def save_hf_model(kind: str, folder: Path, *, dtype: torch.dtype = torch.float32, seed: int = 0,
                  max_shard_size: str | None = None, **overrides) -> str:
    """build_hf_model saved with save_pretrained (safetensors) in `folder`, as `dtype`; returns the path."""
    model = build_hf_model(kind, seed, **overrides).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    return str(folder)


def pack(obj) -> bytes:
    """An object holding tensors as bytes: a rank's result crosses run_ranks' queue as plain data
    (torch's shared-memory tensor passing needs the rank process alive when the parent reads)."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def unpack(data: bytes):
    import io

    return torch.load(io.BytesIO(data), weights_only=False)


def tokens(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(TOKENS_SEED))


@torch.no_grad()
def hf_logits(path: str, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' logits of the model saved at `path`, run in `dtype`, as fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model(x).logits.float()


@torch.no_grad()
def our_logits(config, tensors: dict[str, torch.Tensor], x: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Our TrainingModel of `config` holding `tensors` (cast to `dtype`), its logits as fp32."""
    from parallelism.training.model import build_training_model

    model = build_training_model(config, dtype=dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    return model(x).float()


@torch.no_grad()
def our_routes(config, tensors: dict[str, torch.Tensor], x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T] bool: the positions whose own and every earlier token's experts (all MoE layers)
    are those our model picks in fp32. A token whose near-tied router scores flip under bf16
    rounding, and every later token that attends to it, is False."""
    from parallelism.training.model import build_training_model
    from parallelism.training.moe import MoE

    picks: dict[torch.dtype, list[torch.Tensor]] = {}
    for run in (torch.float32, dtype):
        model = build_training_model(config, dtype=run)
        model.load_state_dict({k: v.to(run) for k, v in tensors.items()}, strict=True)
        found: list[torch.Tensor] = []
        for module in model.modules():
            if isinstance(module, MoE):
                top_k = module.top_k
                module.router.register_forward_hook(
                    lambda _m, _i, out, k=top_k: found.append(out.float().topk(k, -1).indices.sort(-1).values))
        model(x)
        picks[run] = found
    same = torch.ones(x.shape, dtype=torch.bool)
    for a, b in zip(picks[torch.float32], picks[dtype]):
        same &= (a == b).all(-1).view(x.shape)
    return same.cumprod(dim=1).bool()
