"""Fused rotary position embedding for q and k (HF LLaMA layout and `rotate_half` convention).

`apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` has HF's (transformers 5.x) signature
and semantics: q [B, Hq, S, D], k [B, Hk, S, D] (or [B, S, H, D] with unsqueeze_dim=2), cos/sin
[B, S, D] as `LlamaRotaryEmbedding` returns them. One kernel rotates q and k (reading cos/sin
once per position), reading HF's transposed projection views in place; the output dtype is
HF's promote(q, cos) (fp32 under autocast, where cos/sin are fp32 and q is bf16).

Exactness: the reference path is HF's formula verbatim; the Triton forward rounds each product
and the sum as HF does. cos and sin are constants (HF computes them under no_grad): if either
requires grad, the reference path runs so their gradients stay correct.

Why it is not swapped in by `apply_kernels`: HF applies RoPE with a module-level function inside
the attention forward, not a module, so a schedule cannot `.replace()` it; patching the function
changes every model in the process. See docs/kernels.md.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _common


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """HF LLaMA's `apply_rotary_pos_emb`, verbatim."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _impl(q, k, cos, sin, q_out_dtype, k_out_dtype, backward):
    from . import _rope_triton

    return _rope_triton.rope(q, k, cos, sin, q_out_dtype, k_out_dtype, backward)


def _fake(q, k, cos, sin, q_out_dtype, k_out_dtype, backward):
    return torch.empty_like(q, dtype=q_out_dtype), torch.empty_like(k, dtype=k_out_dtype)


_op = _common.define_op(
    "rope", "(Tensor q, Tensor k, Tensor cos, Tensor sin, ScalarType q_out_dtype, "
    "ScalarType k_out_dtype, bool backward) -> (Tensor, Tensor)", _impl, _fake)


def _to_bshd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    x = x.transpose(1, 2) if unsqueeze_dim == 1 else x
    return x if x.stride(-1) == 1 else x.contiguous()


def _from_bshd(x: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    return x.transpose(1, 2) if unsqueeze_dim == 1 else x


def _bsd(t: torch.Tensor, bsz: int, seq: int) -> torch.Tensor:
    t = t if t.dim() == 3 else t.reshape(1, *t.shape[-2:])
    t = t.expand(bsz, seq, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


class RoPEFunction(torch.autograd.Function):
    """Rotate q and k with one Triton kernel each way; saves only cos and sin."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        qv, kv = _to_bshd(q, unsqueeze_dim), _to_bshd(k, unsqueeze_dim)
        c, s = _bsd(cos, qv.shape[0], qv.shape[1]), _bsd(sin, qv.shape[0], qv.shape[1])
        qo, ko = _op(qv, kv, c, s, torch.promote_types(q.dtype, cos.dtype),
                     torch.promote_types(k.dtype, cos.dtype), False)
        ctx.save_for_backward(c, s)
        ctx.dim, ctx.q_dtype, ctx.k_dtype = unsqueeze_dim, q.dtype, k.dtype
        return _from_bshd(qo, unsqueeze_dim), _from_bshd(ko, unsqueeze_dim)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor):
        c, s = ctx.saved_tensors
        dqv, dkv = _to_bshd(dq, ctx.dim), _to_bshd(dk, ctx.dim)
        gq, gk = _op(dqv, dkv, c, s, ctx.q_dtype, ctx.k_dtype, True)
        return _from_bshd(gq, ctx.dim), _from_bshd(gk, ctx.dim), None, None, None


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, unsqueeze_dim: int = 1,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """HF LLaMA's `apply_rotary_pos_emb` (q, k, cos, sin, unsqueeze_dim); Triton on CUDA."""
    if (not _common.use_triton(_common.check_backend(backend), q, k, cos, sin)
            or cos.requires_grad or sin.requires_grad):
        return rope_reference(q, k, cos, sin, unsqueeze_dim)
    if q.dim() != 4 or k.dim() != 4 or unsqueeze_dim not in (1, 2) or q.shape[-1] % 2:
        raise ValueError("apply_rotary_pos_emb: expects 4-D q and k with an even head dim and "
                         f"unsqueeze_dim 1 or 2; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"unsqueeze_dim={unsqueeze_dim}")
    return RoPEFunction.apply(q, k, cos, sin, unsqueeze_dim)


class FusedRoPE(nn.Module):
    """Module form: `forward(q, k, cos, sin, unsqueeze_dim=1)` -> (q_embed, k_embed)."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = _common.check_backend(backend)
        _common.triton_available()

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"
