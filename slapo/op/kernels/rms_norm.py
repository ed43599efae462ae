"""Fused RMSNorm (LLaMA / Mistral / Qwen): one kernel forward, one backward.

Exactness: the reference path *is* HF `LlamaRMSNorm.forward` (normalise in fp32, round to the
input dtype, multiply by the weight in the promoted dtype), so on CPU a replaced model computes
bit-for-bit what HF computes. The Triton path does the same roundings in the same order; only
the fp32 sum of squares is summed in a different order (differences of fp32 roundoff before the
final rounding). The backward mirrors HF's autograd: the gradient reaching the normalised value
is rounded to the input dtype first, then dx and dw are computed in fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from . import _common


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's `LlamaRMSNorm.forward`, verbatim (transformers 4.40 - 5.23)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def _fwd_impl(x, w, eps):
    from . import _rms_norm_triton

    return _rms_norm_triton.forward(x, w, eps)


def _fwd_fake(x, w, eps):
    m, n = x.shape
    return (x.new_empty((m, n), dtype=torch.promote_types(x.dtype, w.dtype)),
            x.new_empty((m,), dtype=torch.float32))


def _bwd_impl(dy, x, w, rstd):
    from . import _rms_norm_triton

    return _rms_norm_triton.backward(dy, x, w, rstd)


def _bwd_fake(dy, x, w, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


_fwd_op = _common.define_op("rms_norm_fwd", "(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)",
                            _fwd_impl, _fwd_fake)
_bwd_op = _common.define_op(
    "rms_norm_bwd", "(Tensor dy, Tensor x, Tensor w, Tensor rstd) -> (Tensor, Tensor)",
    _bwd_impl, _bwd_fake)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with Triton forward and backward kernels; saves x and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = _common.as_rows(x)
        y, rstd = _fwd_op(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _bwd_op(_common.as_rows(dy), x2, weight, rstd)
        return dx.view(ctx.x_shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: str = "auto") -> torch.Tensor:
    """`weight * normalize(x)` as HF LLaMA computes it; Triton on CUDA, reference elsewhere."""
    if not _common.use_triton(_common.check_backend(backend), x, weight):
        return rms_norm_reference(x, weight, eps)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last "
                         f"dimension of x {tuple(x.shape)}")
    return RMSNormFunction.apply(x, weight, eps)


class FusedRMSNorm(nn.Module):
    """Drop-in for `LlamaRMSNorm` (and its Mistral/Qwen copies): same `weight` parameter and
    `variance_epsilon`, so state-dict keys and HF code reading those attributes are unchanged.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight: nn.Parameter | None = None,
                 backend: str = "auto"):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.backend = _common.check_backend(backend)
        _common.triton_available()  # resolved eagerly, so a compiled trace sees a constant

    @classmethod
    def from_module(cls, module: nn.Module, backend: str = "auto") -> FusedRMSNorm:
        """Share the weight of an HF RMSNorm (`weight` + `variance_epsilon` or `eps`)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if eps is None or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"FusedRMSNorm.from_module: {type(module).__name__} has no 1-D "
                             "weight and variance_epsilon/eps")
        return cls(weight.shape[0], float(eps), weight, backend)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, backend={self.backend}"
