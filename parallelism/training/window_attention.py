"""Causal attention with a sliding window and per-head attention sinks, as one op.

Sliding window (Mistral, Qwen2's optional window, GPT-OSS's alternate layers): query i
attends to keys max(0, i - window + 1)..i. Sinks (GPT-OSS): a learned logit per head that
joins every query's softmax denominator and attends to nothing, so a head can put weight
nowhere: out = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)).

torch's scaled_dot_product_attention has neither (a boolean mask would do the window on
the math kernel, at s x s memory, and nothing does the sink), so this is a custom op
(torch.library): on the CPU it computes the scores in float32 (the toy models train here);
on fake tensors it is one attention kernel whose FLOPs the emulator's recorder scales by
the share of the score matrix the window keeps, as FlashAttention's windowed kernels skip
the blocks outside it (recorder.window_fraction). Its backward is one op too, from the
scores recomputed with the saved log-sum-exp, as a flash backward does.
"""
from __future__ import annotations

import torch
from torch import Tensor


def _expanded(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v in float32, k and v repeated over the query heads that share them (GQA)."""
    groups = q.shape[1] // k.shape[1]
    kf, vf = k.float(), v.float()
    if groups > 1:
        kf, vf = kf.repeat_interleave(groups, dim=1), vf.repeat_interleave(groups, dim=1)
    return q.float(), kf, vf


def _scores(qf: Tensor, kf: Tensor, window: int) -> Tensor:
    """Scaled scores with -inf outside the causal window."""
    scores = qf @ kf.transpose(-1, -2) * qf.shape[-1] ** -0.5
    i = torch.arange(qf.shape[2], device=qf.device)[:, None]
    j = torch.arange(kf.shape[2], device=qf.device)[None, :]
    visible = j <= i
    if window:
        visible &= (i - j) < window
    return scores.masked_fill(~visible, float("-inf"))


def _scores_softmax(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) in float32: q [B, H, S, D], k/v [B, Hkv, S, D] (Hkv divides H), sinks [H] or empty;
    lse is the log of each query's softmax denominator, the sink's term included."""
    qf, kf, vf = _expanded(q, k, v)
    scores = _scores(qf, kf, window)
    lse = torch.logsumexp(scores, dim=-1)
    if sinks.numel():
        lse = torch.logaddexp(lse, sinks.float()[None, :, None].expand_as(lse))
    return torch.exp(scores - lse[..., None]) @ vf, lse


@torch.library.custom_op("dynaplane::window_attention", mutates_args=())
def window_attention_op(q: Tensor, k: Tensor, v: Tensor, window: int, sinks: Tensor) -> tuple[Tensor, Tensor]:
    out, lse = _scores_softmax(q, k, v, window, sinks)
    return out.to(q.dtype), lse


@window_attention_op.register_fake
def _(q, k, v, window, sinks):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("dynaplane::window_attention_backward", mutates_args=())
def window_attention_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 window: int, sinks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (q, k, v, sinks) from the scores recomputed with the saved lse, as a flash
    backward does (autograd is not available inside an op): with p the probabilities and
    D = rowsum(grad_out * out), dS = p (grad_out v^T - D); a sink s_h takes -sum p_sink D."""
    qf, kf, vf = _expanded(q, k, v)
    dout = grad_out.float()
    p = torch.exp(_scores(qf, kf, window) - lse[..., None])
    delta = (dout * (p @ vf)).sum(-1, keepdim=True)
    ds = p * (dout @ vf.transpose(-1, -2) - delta) * qf.shape[-1] ** -0.5
    dq = ds @ kf
    dk, dv = ds.transpose(-1, -2) @ qf, p.transpose(-1, -2) @ dout
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # the query heads sharing a kv head add their gradients
        dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
        dv = dv.unflatten(1, (k.shape[1], groups)).sum(2)
    if sinks.numel():
        p_sink = torch.exp(sinks.float()[None, :, None] - lse)
        dsinks = -(p_sink * delta.squeeze(-1)).sum((0, 2)).to(sinks.dtype)
    else:
        dsinks = sinks.new_empty(sinks.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


@window_attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, window, sinks):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), sinks.new_empty(sinks.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, window, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse)  # what a flash kernel keeps: inputs, output, lse
    ctx.window = window


def _backward(ctx, grad_out, grad_lse):
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = window_attention_backward_op(grad_out, q, k, v, out, lse, ctx.window, sinks)
    return dq, dk, dv, None, dsinks if sinks.numel() else None


window_attention_op.register_autograd(_backward, setup_context=_setup_context)


def window_attention(q: Tensor, k: Tensor, v: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Causal attention of q [B, H, S, D] over k, v [B, Hkv, S, D], within `window` keys (0: all
    earlier keys), with a sink logit per head (`sinks` [H]; None: none)."""
    if window < 0:
        raise ValueError(f"window={window} must be >= 0 (0: no window)")
    empty = q.new_empty((0,), dtype=torch.float32)
    out, _ = window_attention_op(q, k, v, int(window), empty if sinks is None else sinks)
    return out
