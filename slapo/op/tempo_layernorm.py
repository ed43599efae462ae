"""Tempo's output-saving LayerNorm: keep y and 1/std, drop the input x.

Why: a LayerNorm is almost always followed by a Linear (QKV, FC1) that saves the LayerNorm output y
anyway, while autograd's LayerNorm keeps its input x as well. Since y = gamma * x_hat + beta, the
normalised input is x_hat = (y - beta) / gamma and the backward needs nothing else:

    g = dy * gamma
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))     (means over the normalised dims)
    dgamma = sum_rows(dy * x_hat),  dbeta = sum_rows(dy)

Dividing by gamma is the only risk: y_j carries a rounding error of ~eps * (|gamma_j x_hat| +
|beta_j|), so x_hat_j is off by ~eps * (1 + |beta_j| / |gamma_j|). The forward therefore checks
min_j |gamma_j| / (|gamma_j| + |beta_j|) (one host sync per call) and, below `min_gamma_ratio`,
falls back to saving x like the normal LayerNorm. Defaults: 1e-2 for fp32 (x_hat error <= ~1e-5
relative; measured: with |gamma_j| = 1e-3 and |beta_j| ~ 1 the output-saving path would give a
4e-5 relative error in those dgamma_j, hence the fallback), 0.25 for fp16/bf16, 1e-6 for fp64.

Exact up to floating-point rounding (not bit-identical: x_hat is rebuilt). The forward output is
bit-identical to `F.layer_norm`. Devices: any; half-precision backward math runs in fp32.
"""

from __future__ import annotations

import math

import torch
from torch import nn

_DEFAULT_RATIO = {torch.float64: 1e-6, torch.float32: 1e-2}


def default_min_gamma_ratio(dtype: torch.dtype) -> float:
    """Below this |gamma| / (|gamma| + |beta|) the output-saving path is too inexact for `dtype`."""
    return _DEFAULT_RATIO.get(dtype, 0.25)


def _needs_fallback(weight, bias, threshold: float) -> bool:
    if weight is None:
        return False
    g = weight.detach().abs()
    denom = g + bias.detach().abs() if bias is not None else g
    return bool((g < threshold * denom).any() | (g == 0).any())


class TempoLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the trailing `normalized_shape` dims, saving (y, rstd) instead of x."""

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, min_gamma_ratio):
        y, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ctx.nd = len(normalized_shape)
        ctx.has_w, ctx.has_b = weight is not None, bias is not None
        thr = default_min_gamma_ratio(x.dtype) if min_gamma_ratio is None else min_gamma_ratio
        ctx.fallback = _needs_fallback(weight, bias, thr)
        if ctx.fallback:
            ctx.save_for_backward(x, weight, bias, mean, rstd)
        else:
            ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        ct = torch.float64 if dy.dtype == torch.float64 else torch.float32
        if ctx.fallback:
            x, weight, bias, mean, rstd = ctx.saved_tensors
            xhat = (x.to(ct) - mean.to(ct)) * rstd.to(ct)
        else:
            y, weight, bias, rstd = ctx.saved_tensors
            xhat = y.to(ct)
            if bias is not None:
                xhat = xhat - bias.to(ct)
            if weight is not None:
                xhat = xhat / weight.to(ct)
        dims = tuple(range(-ctx.nd, 0))
        dyc = dy.to(ct)
        g = dyc * weight.to(ct) if weight is not None else dyc
        dx = rstd.to(ct) * (
            g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True)
        )
        rows = tuple(range(dy.dim() - ctx.nd))
        dw = (
            (dyc * xhat).sum(rows).to(weight.dtype)
            if ctx.has_w and ctx.needs_input_grad[1]
            else None
        )
        db = dyc.sum(rows).to(bias.dtype) if ctx.has_b and ctx.needs_input_grad[2] else None
        dx = dx.to(dy.dtype) if ctx.needs_input_grad[0] else None
        return dx, dw, db, None, None, None


class TempoLayerNorm(nn.LayerNorm):
    """Drop-in `nn.LayerNorm` that saves its output and 1/std instead of its input.

    Use when the next layer saves the LayerNorm output anyway (pre-LN blocks: QKV/FC1 projections;
    BERT's post-LN output feeds the next layer's projections). Exact up to rounding; falls back to
    the normal path when some |gamma_j| / (|gamma_j| + |beta_j|) < `min_gamma_ratio`. Any device.
    Parameters are shared, not copied, by `from_layernorm`, so optimizers keep working.
    """

    def __init__(self, *args, min_gamma_ratio: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_gamma_ratio = min_gamma_ratio

    @classmethod
    def from_layernorm(
        cls, ln: nn.LayerNorm, min_gamma_ratio: float | None = None
    ) -> TempoLayerNorm:
        """A TempoLayerNorm using `ln`'s own parameter objects (no copy)."""
        if not isinstance(ln, nn.LayerNorm):
            raise ValueError(f"from_layernorm expects nn.LayerNorm, got {type(ln).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.normalized_shape = tuple(ln.normalized_shape)
        new.eps = ln.eps
        new.elementwise_affine = ln.elementwise_affine
        new.weight = ln.weight
        new.bias = ln.bias
        new.min_gamma_ratio = min_gamma_ratio
        new.train(ln.training)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-len(self.normalized_shape) :] != self.normalized_shape:
            raise ValueError(
                f"TempoLayerNorm: input shape {tuple(x.shape)} does not end with "
                f"normalized_shape {self.normalized_shape}"
            )
        return TempoLayerNormFunction.apply(
            x, self.weight, self.bias, list(self.normalized_shape), self.eps, self.min_gamma_ratio
        )


def tempo_layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...] | list[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    min_gamma_ratio: float | None = None,
) -> torch.Tensor:
    """Functional output-saving LayerNorm (see `TempoLayerNorm`)."""
    if isinstance(normalized_shape, int):
        normalized_shape = [normalized_shape]
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"tempo_layer_norm: eps must be >= 0, got {eps}")
    return TempoLayerNormFunction.apply(
        x, weight, bias, list(normalized_shape), eps, min_gamma_ratio
    )
