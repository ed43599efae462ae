"""Tempo's output-saving LayerNorm: keep y and 1/std, drop the input x.

Why: a LayerNorm is almost always followed by a Linear (QKV, FC1) that saves the LayerNorm output y
anyway, while autograd's LayerNorm keeps its input x as well. Since y = gamma * x_hat + beta, the
normalised input is x_hat = (y - beta) / gamma and the backward needs nothing else:

    g = dy * gamma
    dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))     (means over the normalised dims)
    dgamma = sum_rows(dy * x_hat),  dbeta = sum_rows(dy)

Kernels: one fused pass each way -- Triton on CUDA (`slapo.op.tempo_kernels`: per-row forward
writing y and rstd; per-row backward with dgamma/dbeta accumulated per program), the PyTorch
reference below elsewhere (same math). Under `torch.compile` the LayerNorm is a pure-PyTorch
`TracedLayerNormFunction` that dynamo traces, so inductor fuses it with the residual add, dropout
and casts around it (the earlier custom ops `slapo_tempo::ln_fwd` / `ln_bwd` stay for
`SLAPO_TEMPO_COMPILED=opaque`, to measure against; docs/tempo.md).

Mixed precision: under autocast, PyTorch runs LayerNorm in fp32 and the next Linear saves its own
bf16 copy of y, so saving the fp32 y would save nothing. Tempo then returns the same fp32 y (same
forward numerics as autocast) and saves y rounded to the autocast dtype (written by the same pass):
4 bytes (fp32 x) -> 2 bytes per element. Outside autocast y itself is saved (its storage is shared
with the next Linear's saved input: the LayerNorm then costs only rstd).

Dividing by gamma is the only risk: y_j carries a rounding error of ~eps * (|gamma_j x_hat| +
|beta_j|), so x_hat_j is off by ~eps * (1 + |beta_j| / |gamma_j|). Below a ratio
min_j |gamma_j| / (|gamma_j| + |beta_j|) < `min_gamma_ratio` (default 1e-2 for fp32 storage, 0.25
for fp16/bf16, 1e-6 for fp64) the module runs the plain `F.layer_norm` instead (saves x). The
check costs a host sync, so `TempoLayerNorm` repeats it only when gamma or beta changed (their
version counters, i.e. once per optimizer step) and never inside a compiled region (a compiled
block uses the decision of the last eager call / of construction).

Exact up to floating-point rounding (x_hat is rebuilt). The reference's forward output is
bit-identical to `F.layer_norm`; the Triton forward matches it to the last bit of the dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import tempo_kernels
from .kernels._common import use_triton

_DEFAULT_RATIO = {torch.float64: 1e-6, torch.float32: 1e-2}


def default_min_gamma_ratio(dtype: torch.dtype) -> float:
    """Below this |gamma| / (|gamma| + |beta|) the output-saving path is too inexact for `dtype`."""
    return _DEFAULT_RATIO.get(dtype, 0.25)


def needs_fallback(weight, bias, threshold: float) -> bool:
    """True when some |gamma_j| < threshold * (|gamma_j| + |beta_j|) (one host sync)."""
    if weight is None:
        return False
    g = weight.detach().abs()
    denom = g + bias.detach().abs() if bias is not None else g
    return bool((g < threshold * denom).any() | (g == 0).any())


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def layer_norm_forward_reference(x2d, weight, bias, eps: float, save_dtype: torch.dtype):
    """(y, y_saved, rstd (M,) fp32-or-fp64) for rows of x2d; y bit-identical to F.layer_norm."""
    n = x2d.shape[-1]
    y, _mean, rstd = torch.native_layer_norm(x2d, [n], weight, bias, eps)
    ys = y if save_dtype == y.dtype else y.to(save_dtype)
    ct = _compute_dtype(x2d.dtype)
    if rstd.dtype != ct:  # CPU returns half-precision statistics for half inputs
        rstd = torch.rsqrt(x2d.to(ct).var(-1, unbiased=False) + eps)
    return y, ys, rstd.reshape(-1)


def layer_norm_backward_reference(dy2d, ys, weight, bias, rstd, dx_dtype: torch.dtype):
    """(dx, dweight, dbias) from the saved y (see the module docstring); compute in fp32/fp64."""
    ct = _compute_dtype(dx_dtype) if ys.dtype != torch.float64 else torch.float64
    xhat = ys.to(ct)
    if bias is not None:
        xhat = xhat - bias.to(ct)
    if weight is not None:
        xhat = xhat / weight.to(ct)
    dyc = dy2d.to(ct)
    g = dyc * weight.to(ct) if weight is not None else dyc
    dx = rstd.to(ct)[:, None] * (
        g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True)
    )
    dw = (dyc * xhat).sum(0) if weight is not None else None
    db = dyc.sum(0) if bias is not None else None
    return dx.to(dx_dtype), dw, db


def layer_norm_forward(x2d, weight, bias, eps: float, save_dtype: torch.dtype):
    """Fastest available forward: Triton on CUDA, else the reference."""
    if use_triton("auto", x2d):
        return tempo_kernels.layer_norm_fwd(x2d, weight, bias, eps, x2d.dtype, save_dtype)
    return layer_norm_forward_reference(x2d, weight, bias, eps, save_dtype)


def layer_norm_backward(dy2d, ys, weight, bias, rstd, dx_dtype: torch.dtype):
    """Fastest available backward: Triton on CUDA, else the reference."""
    if use_triton("auto", ys, dy2d):
        return tempo_kernels.layer_norm_bwd(dy2d, ys, weight, bias, rstd, dx_dtype)
    return layer_norm_backward_reference(dy2d, ys, weight, bias, rstd, dx_dtype)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1)


def _cast_grad(g: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None or like is None else g.to(like.dtype).view(like.shape)


class TempoLayerNormFunction(torch.autograd.Function):
    """LayerNorm over the trailing `normalized_shape` dims, saving (y or its half copy, rstd).

    The eager-mode path; `_ln_fwd_op` is the same computation as a custom op for torch.compile.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, save_dtype=None):
        n = math.prod(normalized_shape)
        x2d = x.contiguous().view(-1, n)
        save_dtype = save_dtype or x.dtype
        y, ys, rstd = layer_norm_forward(x2d, _flat(weight), _flat(bias), eps, save_dtype)
        ctx.save_for_backward(ys, weight, bias, rstd)
        return y.view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        ys, weight, bias, rstd = ctx.saved_tensors
        dy2d = dy.contiguous().view(ys.shape)
        dx, dw, db = layer_norm_backward(dy2d, ys, _flat(weight), _flat(bias), rstd, dy.dtype)
        dw = _cast_grad(dw, weight) if ctx.needs_input_grad[1] else None
        db = _cast_grad(db, bias) if ctx.needs_input_grad[2] else None
        return dx.view(dy.shape), dw, db, None, None, None


@torch.library.custom_op("slapo_tempo::ln_fwd", mutates_args=())
def _ln_fwd_op(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    normalized_shape: list[int],
    eps: float,
    save_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, y_saved or an empty tensor when y itself is saved, rstd): outputs of a custom
    op may not alias each other."""
    n = math.prod(normalized_shape)
    y, ys, rstd = layer_norm_forward(x.contiguous().view(-1, n), _flat(weight), _flat(bias), eps,
                                     save_dtype)
    extra = ys if ys is not y else y.new_empty(0)
    return y.view(x.shape), extra, rstd


@_ln_fwd_op.register_fake
def _(x, weight, bias, normalized_shape, eps, save_dtype):
    rows = x.numel() // math.prod(normalized_shape)
    extra = x.new_empty((rows, math.prod(normalized_shape)), dtype=save_dtype) \
        if save_dtype != x.dtype else x.new_empty(0)
    # contiguous like the real output (empty_like would copy a transposed input's strides)
    y = x.new_empty(x.shape)
    return y, extra, x.new_empty((rows,), dtype=_compute_dtype(x.dtype))


@torch.library.custom_op("slapo_tempo::ln_bwd", mutates_args=())
def _ln_bwd_op(
    dy: torch.Tensor,
    ys: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight or empty, dbias or empty); dweight/dbias in the parameters' dtypes."""
    ys2d = ys.reshape(rstd.shape[0], -1)
    dx, dw, db = layer_norm_backward(dy.contiguous().view(ys2d.shape), ys2d, _flat(weight),
                                     _flat(bias), rstd, dy.dtype)
    dw = _cast_grad(dw, weight) if weight is not None else dy.new_empty(0)
    db = _cast_grad(db, bias) if bias is not None else dy.new_empty(0)
    return dx.view(dy.shape), dw, db


@_ln_bwd_op.register_fake
def _(dy, ys, weight, bias, rstd):
    dw = torch.empty_like(weight) if weight is not None else dy.new_empty(0)
    db = torch.empty_like(bias) if bias is not None else dy.new_empty(0)
    return dy.new_empty(dy.shape), dw, db


def _ln_setup(ctx, inputs, output):
    _x, weight, bias = inputs[:3]
    y, extra, rstd = output
    ctx.save_for_backward(extra if extra.numel() else y, weight, bias, rstd)


def _ln_grad(ctx, dy, _dextra, _drstd):
    ys, weight, bias, rstd = ctx.saved_tensors
    dx, dw, db = _ln_bwd_op(dy, ys, weight, bias, rstd)
    return (dx, dw if weight is not None else None, db if bias is not None else None,
            None, None, None)


_ln_fwd_op.register_autograd(_ln_grad, setup_context=_ln_setup)


class TracedLayerNormFunction(torch.autograd.Function):
    """The LayerNorm inside `torch.compile` ("fused" path): pure PyTorch, traced by dynamo.

    Why: a custom op is opaque to inductor, which then cannot fuse the residual add, dropout and
    casts around the LayerNorm (measured on an H100: +32% step time and a higher peak). Traced,
    inductor fuses the forward and the backward math with their neighbours. AOTAutograd's
    partitioner still chooses what to save; for this Function it keeps Tempo's choice (y or its
    half copy and rstd, never x: x cannot be rebuilt from them by recomputation), measured by
    the forward graph's saved outputs in tests/test_tempo_compiled.py.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, save_dtype):
        y, _mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        ys = y if save_dtype == y.dtype else y.to(save_dtype)
        ctx.dims = tuple(range(-len(normalized_shape), 0))
        ctx.save_for_backward(ys, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        """`layer_norm_backward_reference` on the rows (the same math as the eager ops; all
        views and elementwise ops, so inductor fuses it)."""
        ys, weight, bias, rstd = ctx.saved_tensors
        n = math.prod(ys.shape[len(ys.shape) - len(ctx.dims):])
        flat = lambda t: None if t is None else t.reshape(n)  # noqa: E731
        dx, dw, db = layer_norm_backward_reference(dy.reshape(-1, n), ys.reshape(-1, n),
                                                   flat(weight), flat(bias), rstd.reshape(-1),
                                                   dy.dtype)
        dw = dw.reshape(weight.shape).to(weight.dtype) \
            if weight is not None and ctx.needs_input_grad[1] else None
        db = db.reshape(bias.shape).to(bias.dtype) \
            if bias is not None and ctx.needs_input_grad[2] else None
        return dx.reshape(dy.shape), dw, db, None, None, None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype when autocast is on for `device_type` (LayerNorm then runs in fp32)."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return None
    return None


def _output_saving(x, weight, bias, normalized_shape: list[int], eps: float) -> torch.Tensor:
    """The output-saving path for any mode (eager Function / compiled custom op, autocast)."""
    half = _autocast_dtype(x.device.type)
    save_dtype = x.dtype
    if half is not None:  # autocast runs LayerNorm in fp32; save y in the autocast dtype
        x, save_dtype = x.float(), half
        weight = weight.float() if weight is not None else None
        bias = bias.float() if bias is not None else None
    if torch.compiler.is_compiling():
        if tempo_kernels.compiled_path() == "opaque":
            return _ln_fwd_op(x, weight, bias, normalized_shape, eps, save_dtype)[0]
        return TracedLayerNormFunction.apply(x, weight, bias, normalized_shape, eps, save_dtype)
    return TempoLayerNormFunction.apply(x, weight, bias, normalized_shape, eps, save_dtype)


def _save_dtype(x: torch.Tensor) -> torch.dtype:
    return _autocast_dtype(x.device.type) or x.dtype


class TempoLayerNorm(nn.LayerNorm):
    """Drop-in `nn.LayerNorm` that saves its output and 1/std instead of its input.

    Use when the next layer saves the LayerNorm output anyway (pre-LN blocks: QKV/FC1 projections;
    BERT's post-LN output feeds the next layer's projections). Exact up to rounding; runs the plain
    LayerNorm when some |gamma_j| / (|gamma_j| + |beta_j|) < `min_gamma_ratio` (see the module
    docstring for when that is checked). Parameters are shared, not copied, by `from_layernorm`,
    so optimizers keep working.
    """

    def __init__(self, *args, min_gamma_ratio: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.min_gamma_ratio = min_gamma_ratio
        self._checked: tuple | None = None
        self._fallback = False

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
        new._checked = None
        new._fallback = False
        new.train(ln.training)
        return new

    def uses_fallback(self, save_dtype: torch.dtype) -> bool:
        """Whether gamma is too small for the output-saving path; re-checked only when the
        parameters (their version counters) or the saved dtype changed, never when compiling."""
        if torch.compiler.is_compiling() or self.weight is None:
            return self._fallback
        key = (self.weight._version, None if self.bias is None else self.bias._version,
               save_dtype, self.min_gamma_ratio)
        if key != self._checked:
            thr = self.min_gamma_ratio
            thr = default_min_gamma_ratio(save_dtype) if thr is None else thr
            self._fallback = needs_fallback(self.weight, self.bias, thr)
            self._checked = key
        return self._fallback

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-len(self.normalized_shape) :] != self.normalized_shape:
            raise ValueError(
                f"TempoLayerNorm: input shape {tuple(x.shape)} does not end with "
                f"normalized_shape {self.normalized_shape}"
            )
        shape = list(self.normalized_shape)
        if not torch.is_grad_enabled() or self.uses_fallback(_save_dtype(x)):
            return F.layer_norm(x, shape, self.weight, self.bias, self.eps)
        return _output_saving(x, self.weight, self.bias, shape, self.eps)


def tempo_layer_norm(
    x: torch.Tensor,
    normalized_shape: tuple[int, ...] | list[int] | int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    min_gamma_ratio: float | None = None,
) -> torch.Tensor:
    """Functional output-saving LayerNorm (see `TempoLayerNorm`; checks gamma on every eager
    call, never when compiling)."""
    if isinstance(normalized_shape, int):
        normalized_shape = [normalized_shape]
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"tempo_layer_norm: eps must be >= 0, got {eps}")
    shape = list(normalized_shape)
    if not torch.compiler.is_compiling():
        thr = default_min_gamma_ratio(_save_dtype(x)) if min_gamma_ratio is None \
            else min_gamma_ratio
        if not torch.is_grad_enabled() or needs_fallback(weight, bias, thr):
            return F.layer_norm(x, shape, weight, bias, eps)
    return _output_saving(x, weight, bias, shape, eps)
