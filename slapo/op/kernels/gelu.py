"""Fused bias + GELU (+ dropout): one kernel forward, one backward (which also reduces dbias).

Why: after a bias-free Linear, `gelu(x + b)` then dropout are three memory-bound kernels in
eager PyTorch, saving x + b, gelu's output and a dropout mask. Fused: one read of x, one write,
and only x is saved; the dropout mask is regenerated in the backward from a Philox (seed,
element index) pair, the seed being one int64 drawn from the device's generator per call (so
`torch.manual_seed`, checkpoint recomputation and `fork_rng` streams all apply to it).

Forms: `approximate="none"` is the erf GELU (`nn.GELU()`, HF `GELUActivation`, BERT);
`approximate="tanh"` is the tanh approximation (HF `NewGELUActivation` / `gelu_new`, GPT-2,
GPT-Neo; `GELUTanh`). Exactness: the reference path is `F.gelu(x + b)` then `F.dropout`, i.e.
bit-identical to `nn.GELU`/HF `GELUActivation`; for HF `NewGELUActivation` (which spells the
tanh formula out in ~7 eager ops, each rounding in bf16) it is the same function computed with
one rounding, so it matches to fp32 roundoff in fp32 and is *more* accurate in bf16. The Triton
path evaluates the same formulas in fp32 with the same roundings as the reference; with dropout
on, its mask differs from `F.dropout`'s (a different RNG), so compare the two in eval mode or
with p=0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _common

APPROXIMATIONS = ("none", "tanh")


def bias_gelu_dropout_reference(x: torch.Tensor, bias: torch.Tensor | None = None,
                                approximate: str = "none", p: float = 0.0,
                                training: bool = True) -> torch.Tensor:
    """`dropout(gelu(x + bias))` in eager PyTorch."""
    y = F.gelu(x + bias if bias is not None else x, approximate=approximate)
    return F.dropout(y, p, training) if p > 0.0 and training else y


def _fwd_impl(x, b, seed, p, tanh):
    from . import _gelu_triton

    return _gelu_triton.forward(x, b, seed, p, tanh)


def _out_dtype(x, b):
    return x.dtype if b is None else torch.promote_types(x.dtype, b.dtype)


def _fwd_fake(x, b, seed, p, tanh):
    return x.new_empty(x.shape, dtype=_out_dtype(x, b))


def _bwd_impl(dy, x, b, seed, p, tanh):
    from . import _gelu_triton

    return _gelu_triton.backward(dy, x, b, seed, p, tanh)


def _bwd_fake(dy, x, b, seed, p, tanh):
    n = x.shape[1] if b is not None else 0
    return x.new_empty(x.shape), x.new_empty((n,), dtype=torch.float32)


_fwd_op = _common.define_op(
    "bias_gelu_dropout_fwd", "(Tensor x, Tensor? b, Tensor seed, float p, bool tanh) -> Tensor",
    _fwd_impl, _fwd_fake)
_bwd_op = _common.define_op(
    "bias_gelu_dropout_bwd",
    "(Tensor dy, Tensor x, Tensor? b, Tensor seed, float p, bool tanh) -> (Tensor, Tensor)",
    _bwd_impl, _bwd_fake)


class BiasGELUDropoutFunction(torch.autograd.Function):
    """dropout(gelu(x + bias), p) with Triton kernels; saves x, bias and the one-element seed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, seed: torch.Tensor, p: float,
                tanh: bool) -> torch.Tensor:
        x2 = _common.as_rows(x)
        ctx.save_for_backward(x2, bias, seed)
        ctx.x_shape, ctx.p, ctx.tanh = x.shape, p, tanh
        return _fwd_op(x2, bias, seed, p, tanh).view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, bias, seed = ctx.saved_tensors
        dx, db = _bwd_op(_common.as_rows(dy), x2, bias, seed, ctx.p, ctx.tanh)
        db = db.to(bias.dtype) if bias is not None else None
        return dx.view(ctx.x_shape), db, None, None, None


def bias_gelu_dropout(x: torch.Tensor, bias: torch.Tensor | None = None,
                      approximate: str = "none", p: float = 0.0, training: bool = True,
                      backend: str = "auto") -> torch.Tensor:
    """`dropout(gelu(x + bias), p)` (dropout only when `training`); Triton on CUDA.

    `bias` (shape [x.shape[-1]]) may be None: then this is a plain GELU (with optional dropout).
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    p = p if training else 0.0
    if (p >= 1.0 or (p > 0.0 and x.numel() >= 2**31)
            or not _common.use_triton(_common.check_backend(backend), x, bias)):
        return bias_gelu_dropout_reference(x, bias, approximate, p, training)
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_gelu_dropout: bias shape {tuple(bias.shape)} does not match the "
                         f"last dimension of x {tuple(x.shape)}")
    if p > 0.0:  # one draw from the device generator: manual_seed / checkpoint replay apply
        seed = torch.randint(0, 2**31 - 1, (1,), device=x.device, dtype=torch.int64)
    else:
        seed = torch.zeros(1, device=x.device, dtype=torch.int64)
    return BiasGELUDropoutFunction.apply(x, bias, seed, float(p), approximate == "tanh")


class FusedGELU(nn.Module):
    """GELU with an optional bias and dropout: `dropout(gelu(x + bias), p)`.

    Without bias and with p=0 it is a drop-in for `nn.GELU(approximate)`, HF `GELUActivation`
    (`approximate="none"`) and `NewGELUActivation` / `GELUTanh` (`"tanh"`). `from_linear(lin)`
    takes a Linear's bias (the Linear keeps no bias), so `Linear -> GELU` becomes
    `Linear(bias=None) -> FusedGELU(bias)` with the same parameter objects.
    """

    def __init__(self, approximate: str = "none", p: float = 0.0,
                 bias: nn.Parameter | None = None, backend: str = "auto"):
        super().__init__()
        if approximate not in APPROXIMATIONS:
            raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.approximate, self.p = approximate, float(p)
        self.bias = bias
        self.backend = _common.check_backend(backend)
        _common.triton_available()

    @classmethod
    def from_linear(cls, linear: nn.Linear, approximate: str = "none", p: float = 0.0,
                    backend: str = "auto") -> FusedGELU:
        """Move `linear.bias` into a new FusedGELU (the Linear is left without a bias)."""
        if linear.bias is None:
            raise ValueError("FusedGELU.from_linear: the Linear has no bias")
        bias = linear.bias
        linear.bias = None
        return cls(approximate, p, bias, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu_dropout(x, self.bias, self.approximate, self.p, self.training,
                                 self.backend)

    def extra_repr(self) -> str:
        return (f"approximate={self.approximate!r}, p={self.p}, bias={self.bias is not None}, "
                f"backend={self.backend}")
