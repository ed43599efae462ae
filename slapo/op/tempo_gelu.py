"""Tempo's output-saving GELU (Andoorveedu et al., NeurIPS 2022): keep y, drop x.

Why: in a transformer MLP, FC1 -> GELU -> FC2, plain autograd keeps both the GELU input x (for
GELU's backward) and its output y (FC2 saves it as its input). Both are b*s*4h. GELU is monotone on
each side of its minimiser x_min ~ -0.7518, so y plus one branch flag determines x. Saving y (shared
with FC2, so free) and a 1-byte code instead of x cuts 4 -> ~1.1 bytes per element in fp32.

Backward recovers GELU'(x) from y: a table lookup on the flagged branch gives a first guess for x,
then three Newton steps on GELU(x) = y refine it to working precision. Two regions are flagged
"exact" and their inputs are saved instead (a compact 1-D copy, ~4% of the elements for
unit-normal inputs), so their derivative is exact:
* |x - x_min| < `band` (0.05): the inverse is ill-conditioned there (GELU' = 0 at x_min, the error
  grows like eps/|x - x_min|);
* x < `tail` (-2): fp32 `F.gelu` itself is off by up to ~1e-6 absolute there (1 + erf cancels),
  which the inverse would amplify by 1/|GELU'|.

Error bound of the derivative (measured over a dense grid, tests/test_tempo_ops.py): <= 1e-6
absolute for fp32 storage, <= 1e-13 for fp64. For bf16/fp16 storage the bound is set by the
rounding of y (~1e-2 for bf16, ~1e-3 for fp16); widen `band` there. With band=0 and tail=-inf no
input is saved and the error near x_min reaches ~2e-4 (fp32).
Forward output is bit-identical to `F.gelu`. Devices: any (pure torch ops); on GPU the backward
is several elementwise kernels, not fused.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_TANH_K = 0.044715

# Codes stored per element (uint8).
LEFT, RIGHT, EXACT = 0, 1, 2


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_K * x**3)))
    return x * torch.special.ndtr(x)  # ndtr is accurate in the left tail, unlike 1 + erf


def gelu_derivative(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d GELU / dx at x (exact erf form or the tanh approximation)."""
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_K * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _TANH_K * x * x
        )
    return torch.special.ndtr(x) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _find_xmin(approximate: str) -> float:
    """Root of GELU' (GELU's minimiser), by Newton on GELU' with a numerical second derivative."""
    x = torch.tensor(-0.75, dtype=torch.float64)
    h = 1e-5
    for _ in range(50):
        d2 = (gelu_derivative(x + h, approximate) - gelu_derivative(x - h, approximate)) / (2 * h)
        x = x - gelu_derivative(x, approximate) / d2
    return float(x)


X_MIN = {a: _find_xmin(a) for a in ("none", "tanh")}
_TABLE_N = 4096
_LEFT_END = -10.0  # GELU'(-10) ~ 1e-21: below this the derivative is zero at any precision
_RIGHT_END = 10.0  # GELU(x) == x to fp64 precision beyond this
_tables: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _table(approximate: str, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    key = (approximate, str(device), dtype)
    if key not in _tables:
        xm = X_MIN[approximate]
        xr = torch.linspace(xm, _RIGHT_END, _TABLE_N, dtype=torch.float64)
        xl = torch.linspace(xm, _LEFT_END, _TABLE_N, dtype=torch.float64)  # y ascending
        tabs = (xr, _gelu(xr, approximate), xl, _gelu(xl, approximate))
        _tables[key] = tuple(t.to(device=device, dtype=dtype) for t in tabs)
    return _tables[key]


def _interp(y: torch.Tensor, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
    i = torch.searchsorted(ys, y.contiguous()).clamp(1, ys.numel() - 1)
    y0, y1, x0, x1 = ys[i - 1], ys[i], xs[i - 1], xs[i]
    w = ((y - y0) / (y1 - y0)).clamp(0.0, 1.0)
    return x0 + w * (x1 - x0)


BACKWARD_CHUNK = 1 << 18  # elements per Newton chunk: bounds the backward's temporaries


def _derivative_chunk(y: torch.Tensor, code: torch.Tensor, approximate: str, steps: int):
    xr, yr, xl, yl = _table(approximate, y.device, y.dtype)
    xm = X_MIN[approximate]
    right = code == RIGHT
    x = torch.where(right, _interp(y, xr, yr), _interp(y, xl, yl))
    x = torch.where(right & (y > yr[-1]), y, x)  # far right: GELU(x) == x
    lo = torch.where(right, xm, _LEFT_END)
    hi = torch.where(right, math.inf, xm)
    for _ in range(steps):
        d = gelu_derivative(x, approximate)
        d = torch.where(d == 0, 1.0, d)
        x = torch.minimum(torch.maximum(x - (_gelu(x, approximate) - y) / d, lo), hi)
    return gelu_derivative(x, approximate)


def gelu_derivative_from_output(
    y: torch.Tensor,
    code: torch.Tensor,
    x_exact: torch.Tensor,
    approximate: str = "none",
    newton_steps: int = 3,
) -> torch.Tensor:
    """GELU'(x) recovered from y = GELU(x), the branch `code` and the saved exact-band inputs.

    Works through y in chunks of `BACKWARD_CHUNK` elements so that the Newton temporaries stay
    small: the extra memory is one output-sized tensor plus a few chunk-sized ones.
    """
    ct = torch.float64 if y.dtype == torch.float64 else torch.float32
    deriv = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    flat_y, flat_c, flat_d = y.reshape(-1), code.reshape(-1), deriv.view(-1)
    for i in range(0, flat_y.numel(), BACKWARD_CHUNK):
        part = slice(i, i + BACKWARD_CHUNK)
        d = _derivative_chunk(flat_y[part].to(ct), flat_c[part], approximate, newton_steps)
        flat_d[part] = d
    if x_exact.numel():
        exact = gelu_derivative(x_exact.to(ct), approximate).to(y.dtype)
        deriv.masked_scatter_(code == EXACT, exact)
    return deriv


class TempoGELUFunction(torch.autograd.Function):
    """y = GELU(x) saving (y, 1-byte branch code, inputs within `band` of x_min)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, approximate: str = "none", band: float = 0.05, tail: float = -2.0
    ):
        y = F.gelu(x, approximate=approximate)
        ctx.approximate = approximate
        if ctx.needs_input_grad[0]:
            xm = X_MIN[approximate]
            code = (x >= xm).to(torch.uint8)
            near = ((x > xm - band) & (x < xm + band)) | (x < tail)
            code = code.masked_fill_(near, EXACT)
            ctx.save_for_backward(y, code, x.masked_select(near))
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        y, code, x_exact = ctx.saved_tensors
        d = gelu_derivative_from_output(y, code, x_exact, ctx.approximate)
        return d.mul_(grad), None, None, None


def _check(approximate: str, band: float) -> None:
    if approximate not in X_MIN:
        raise ValueError(f"Tempo GELU: approximate must be 'none' or 'tanh', got {approximate!r}")
    if band < 0:
        raise ValueError(f"Tempo GELU: band must be >= 0, got {band}")


def tempo_gelu(
    x: torch.Tensor, approximate: str = "none", band: float = 0.05, tail: float = -2.0
) -> torch.Tensor:
    """Functional output-saving GELU; `approximate` is "none" (erf) or "tanh" like `F.gelu`.

    Inputs with |x - x_min| < band or x < tail are saved exactly (see the module docstring).
    """
    _check(approximate, band)
    return TempoGELUFunction.apply(x, approximate, band, tail)


class TempoGELU(nn.Module):
    """Drop-in for `nn.GELU` / HF `GELUActivation` / `NewGELUActivation` that saves its output.

    Use when the GELU is followed by a layer that saves its input anyway (a Linear): the input of
    the GELU is then never stored. Approximate within the bound in the module docstring; any
    device. `approximate="tanh"` matches HF "gelu_new" / "gelu_pytorch_tanh".
    """

    def __init__(self, approximate: str = "none", band: float = 0.05, tail: float = -2.0):
        super().__init__()
        _check(approximate, band)
        self.approximate = approximate
        self.band = band
        self.tail = tail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return TempoGELUFunction.apply(x, self.approximate, self.band, self.tail)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, band={self.band}, tail={self.tail}"
