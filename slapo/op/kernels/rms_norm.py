"""Fused RMSNorm (LLaMA / Mistral / Qwen, and T5 / mT5): one kernel forward, one backward.

Two styles, because HF's two RMSNorms round at different points (and `style` names which one a
module reproduces):
* "llama" (`LlamaRMSNorm`): normalise in fp32, round to the *input* dtype, multiply by the
  weight in the promoted dtype;
* "t5" (`T5LayerNorm`): normalise in fp32, round to the *weight* dtype only when the weight is
  half precision (else keep fp32), multiply by the weight. Under autocast with fp32 weights a
  bf16 input therefore gives an fp32 output, not the input's dtype.

Exactness: the reference path *is* the HF forward of that style, so on CPU a replaced model
computes bit-for-bit what HF computes. The Triton path does the same roundings in the same
order; only the fp32 sum of squares is summed in a different order (differences of fp32
roundoff before the final rounding). The backward mirrors HF's autograd: the gradient reaching
the normalised value is rounded where the forward rounded it, then dx and dw are computed in
fp32. (One difference remains in the "t5" style with a half-precision *input*: HF's autograd
rounds the input gradient's two terms, through the variance and through the scaling, to that
dtype before adding them; the kernel adds in fp32 and rounds once.)
"""

from __future__ import annotations

import torch
from torch import nn

from . import _common

STYLES = ("llama", "t5")
_HALF = (torch.float16, torch.bfloat16)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's `LlamaRMSNorm.forward`, verbatim (transformers 4.40 - 5.23)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


def t5_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's `T5LayerNorm.forward` (also mT5's), verbatim (transformers 4.40 - 5.23)."""
    variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = x * torch.rsqrt(variance + eps)
    if weight.dtype in _HALF:
        h = h.to(weight.dtype)
    return weight * h


def round_dtype(style: str, x_dtype: torch.dtype, w_dtype: torch.dtype) -> torch.dtype:
    """The dtype the normalised value is rounded to before the weight multiplies it."""
    if style == "llama":
        return x_dtype
    return w_dtype if w_dtype in _HALF else torch.promote_types(x_dtype, torch.float32)


def _fwd_impl(x, w, eps, t5):
    from . import _rms_norm_triton

    return _rms_norm_triton.forward(x, w, eps, _round_of(x, w, t5))


def _round_of(x, w, t5: bool) -> torch.dtype:
    return round_dtype("t5" if t5 else "llama", x.dtype, w.dtype)


def _fwd_fake(x, w, eps, t5):
    m, n = x.shape
    out = torch.promote_types(_round_of(x, w, t5), w.dtype)
    return x.new_empty((m, n), dtype=out), x.new_empty((m,), dtype=torch.float32)


def _bwd_impl(dy, x, w, rstd, t5):
    from . import _rms_norm_triton

    return _rms_norm_triton.backward(dy, x, w, rstd, _round_of(x, w, t5))


def _bwd_fake(dy, x, w, rstd, t5):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(w)


_fwd_op = _common.define_op("rms_norm_fwd",
                            "(Tensor x, Tensor w, float eps, bool t5) -> (Tensor, Tensor)",
                            _fwd_impl, _fwd_fake)
_bwd_op = _common.define_op(
    "rms_norm_bwd", "(Tensor dy, Tensor x, Tensor w, Tensor rstd, bool t5) -> (Tensor, Tensor)",
    _bwd_impl, _bwd_fake)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm with Triton forward and backward kernels; saves x and one fp32 rstd per row."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float,
                t5: bool = False) -> torch.Tensor:
        x2 = _common.as_rows(x)
        y, rstd = _fwd_op(x2, weight, eps, t5)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.x_shape, ctx.t5 = x.shape, t5
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        dx, dw = _bwd_op(_common.as_rows(dy), x2, weight, rstd, ctx.t5)
        return dx.view(ctx.x_shape), dw, None, None


def check_style(style: str) -> str:
    if style not in STYLES:
        raise ValueError(f"unknown RMSNorm style {style!r}: use one of {', '.join(STYLES)}")
    return style


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
             backend: str = "auto", style: str = "llama") -> torch.Tensor:
    """`weight * normalize(x)` as HF computes it (`style`: "llama" or "t5", see the module
    docstring); Triton on CUDA, reference elsewhere."""
    t5 = check_style(style) == "t5"
    if not _common.use_triton(_common.check_backend(backend), x, weight):
        return (t5_rms_norm_reference if t5 else rms_norm_reference)(x, weight, eps)
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} does not match the last "
                         f"dimension of x {tuple(x.shape)}")
    return RMSNormFunction.apply(x, weight, eps, t5)


class FusedRMSNorm(nn.Module):
    """Drop-in for `LlamaRMSNorm` (and its Mistral/Qwen copies), or with `style="t5"` for
    `T5LayerNorm` (and mT5's): same `weight` parameter and `variance_epsilon`, so state-dict
    keys and HF code reading those attributes are unchanged.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, weight: nn.Parameter | None = None,
                 backend: str = "auto", style: str = "llama"):
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.backend = _common.check_backend(backend)
        self.style = check_style(style)
        _common.triton_available()  # resolved eagerly, so a compiled trace sees a constant

    @classmethod
    def from_module(cls, module: nn.Module, backend: str = "auto",
                    style: str = "llama") -> FusedRMSNorm:
        """Share the weight of an HF RMSNorm (`weight` + `variance_epsilon` or `eps`)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        weight = getattr(module, "weight", None)
        if eps is None or not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(f"FusedRMSNorm.from_module: {type(module).__name__} has no 1-D "
                             "weight and variance_epsilon/eps")
        return cls(weight.shape[0], float(eps), weight, backend, style)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.backend,
                        self.style)

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, "
                f"backend={self.backend}, style={self.style}")
