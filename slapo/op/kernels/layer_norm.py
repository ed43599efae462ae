"""Fused LayerNorm (weight + bias) over the last dimension: one kernel forward, one backward.

Exactness: the reference path is `F.layer_norm` itself, so on CPU a replaced model computes
bit-for-bit what `nn.LayerNorm` computes. The Triton path computes in fp32 and rounds once, like
PyTorch's CUDA kernel; it differs only by fp32 summation order (PyTorch uses Welford, we use a
two-pass mean/variance). Under CUDA autocast it returns fp32, as autocast does for `layer_norm`
(an fp32-listed op on CUDA): the kernel reads the bf16/fp16 input directly instead of
materialising an fp32 copy. Saves mean and rstd (fp32, one per row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _common


def _fwd_impl(x, w, b, eps, out_fp32):
    from . import _layer_norm_triton

    return _layer_norm_triton.forward(x, w, b, eps, torch.float32 if out_fp32 else x.dtype)


def _fwd_fake(x, w, b, eps, out_fp32):
    m, n = x.shape
    stat = x.new_empty((m,), dtype=torch.float32)
    return x.new_empty((m, n), dtype=torch.float32 if out_fp32 else x.dtype), stat, stat.clone()


def _bwd_impl(dy, x, w, has_bias, mean, rstd):
    from . import _layer_norm_triton

    return _layer_norm_triton.backward(dy, x, w, has_bias, mean, rstd)


def _bwd_fake(dy, x, w, has_bias, mean, rstd):
    n = x.shape[1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((n if w is not None else 0,), dtype=torch.float32),
            x.new_empty((n if has_bias else 0,), dtype=torch.float32))


_fwd_op = _common.define_op(
    "layer_norm_fwd",
    "(Tensor x, Tensor? w, Tensor? b, float eps, bool out_fp32) -> (Tensor, Tensor, Tensor)",
    _fwd_impl, _fwd_fake)
_bwd_op = _common.define_op(
    "layer_norm_bwd",
    "(Tensor dy, Tensor x, Tensor? w, bool has_bias, Tensor mean, Tensor rstd) "
    "-> (Tensor, Tensor, Tensor)",
    _bwd_impl, _bwd_fake)


class LayerNormFunction(torch.autograd.Function):
    """LayerNorm with Triton forward and backward kernels; saves x, mean and rstd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, out_fp32: bool) -> torch.Tensor:
        x2 = _common.as_rows(x)
        y, mean, rstd = _fwd_op(x2, weight, bias, eps, out_fp32)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.x_shape = x.shape
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, mean, rstd = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        dx, dw, db = _bwd_op(_common.as_rows(dy), x2, weight, has_bias, mean, rstd)
        dw = dw.to(weight.dtype) if weight is not None else None
        db = db.to(ctx.bias_dtype) if has_bias else None
        return dx.view(ctx.x_shape), dw, db, None, None


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
               eps: float = 1e-5, backend: str = "auto") -> torch.Tensor:
    """`F.layer_norm(x, (x.shape[-1],), weight, bias, eps)`; Triton on CUDA, reference elsewhere."""
    n = x.shape[-1]
    if not _common.use_triton(_common.check_backend(backend), x, weight, bias):
        return F.layer_norm(x, (n,), weight, bias, eps)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"layer_norm: {name} shape {tuple(t.shape)} does not match the last "
                             f"dimension of x {tuple(x.shape)}")
    out_fp32 = x.is_cuda and torch.is_autocast_enabled("cuda")  # CUDA autocast: fp32 out
    return LayerNormFunction.apply(x, weight, bias, eps, out_fp32)


class FusedLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` (a subclass: `isinstance` checks and HF weight init still apply) whose
    forward runs the fused kernel for a normalised shape of one dimension.

    `from_module(ln)` shares `ln`'s weight and bias objects (state-dict keys unchanged).
    """

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = _common.check_backend(backend)
        _common.triton_available()  # resolved eagerly, so a compiled trace sees a constant

    @classmethod
    def from_module(cls, ln: nn.LayerNorm, backend: str = "auto") -> FusedLayerNorm:
        new = cls(ln.normalized_shape, ln.eps, elementwise_affine=ln.elementwise_affine,
                  bias=ln.bias is not None, device="meta", backend=backend)
        new.weight, new.bias = ln.weight, ln.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(input)
        return layer_norm(input, self.weight, self.bias, self.eps, self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend}"
