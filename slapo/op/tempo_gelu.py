"""Tempo's output-saving GELU (Andoorveedu et al., NeurIPS 2022): keep y, drop x.

Why: in a transformer MLP, FC1 -> GELU -> FC2, plain autograd keeps both the GELU input x (for
GELU's backward) and its output y (FC2 saves it as its input). Both are b*s*4h. GELU is monotone on
each side of its minimiser x_min ~ -0.7518, so y plus one branch flag determines x. Saving y (shared
with FC2, so free) and a 1-byte code instead of x cuts 4 -> ~1.1 bytes per element in fp32.

Backward recovers GELU'(x) from y: a uniform table in a smoothing coordinate (sqrt(y - y_min) on
the right branch, sqrt(-log(y / y_min)) on the left; O(1) lookup, no search) gives a first guess
for x, then two safeguarded Newton steps on GELU(x) = y (kept inside the table cell) refine it to
working precision. The work runs in chunks so the temporaries stay small. Two regions are flagged
"exact" and their inputs are saved instead (a compact 1-D copy, ~4% of the elements for
unit-normal inputs), so their derivative is exact:
* |x - x_min| < `band` (0.05): the inverse is ill-conditioned there (GELU' = 0 at x_min, the error
  grows like eps/|x - x_min|);
* x < `tail` (-2): fp32 `F.gelu` itself is off by up to ~1e-6 absolute there (1 + erf cancels),
  which the inverse would amplify by 1/|GELU'|.

Error bound of the derivative (measured over a dense grid, tests/test_tempo_ops.py): <= 1e-6
absolute for fp32 storage (measured max 7.9e-7; autograd's own fp32 GELU backward: 2.7e-7 for the
erf form, 1.0e-6 for tanh), <= 1e-14 for fp64. For bf16/fp16 storage the bound is set by the
rounding of y (measured 1.5e-2 for bf16, 1.2e-3 for fp16); widen `band` there. With band=0 and
tail=-inf no input is saved and the error next to x_min reaches ~7e-4 (fp32).
Forward output is bit-identical to `F.gelu`. Devices: any (pure torch ops). Cost: the backward is
~15 elementwise passes (about +0.25 us/element on one CPU core); on GPU they are separate kernels
(not fused; `torch.compile` of `gelu_derivative_from_output` would fuse them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_TANH_K = 0.044715

# Codes stored per element (uint8).
LEFT, RIGHT, EXACT = 0, 1, 2


def _cdf(x: torch.Tensor) -> torch.Tensor:
    """Normal CDF via erfc: accurate in the left tail (torch.special.ndtr and 1 + erf are not)."""
    return 0.5 * torch.special.erfc(x * -_INV_SQRT_2)


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_K * x**3)))
    return x * _cdf(x)


def gelu_derivative(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d GELU / dx at x (exact erf form or the tanh approximation)."""
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (x + _TANH_K * x**3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_OVER_PI * (
            1.0 + 3.0 * _TANH_K * x * x
        )
    return _cdf(x) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _find_xmin(approximate: str) -> float:
    """Root of GELU' (GELU's minimiser), by Newton on GELU' with a numerical second derivative."""
    x = torch.tensor(-0.75, dtype=torch.float64)
    h = 1e-5
    for _ in range(50):
        d2 = (gelu_derivative(x + h, approximate) - gelu_derivative(x - h, approximate)) / (2 * h)
        x = x - gelu_derivative(x, approximate) / d2
    return float(x)


X_MIN = {a: _find_xmin(a) for a in ("none", "tanh")}
Y_MIN = {a: float(_gelu(torch.tensor(x, dtype=torch.float64), a)) for a, x in X_MIN.items()}
_TABLE_N = 4096
# Left end of the tables: GELU'(-10) ~ 1e-21 for the erf form; the tanh form underflows to exactly 0
# near x = -5.5 in fp64 (1 + tanh), so its table stops at -5 (|GELU'| < 2e-6 beyond).
_LEFT_END = {"none": -10.0, "tanh": -5.0}
_RIGHT_END = 10.0  # GELU(x) == x to fp64 precision beyond this
_tables: dict[tuple, tuple[torch.Tensor, float, float]] = {}


def _coordinate(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """A coordinate w(y) in which x is smooth and nearly linear on each branch.

    Right: w = sqrt(y - y_min). Left: w = sqrt(-log(y / y_min)), which grows like |x|/sqrt(2)
    in the tail. Both remove the square-root singularity of the inverse at x_min, so a uniform
    table in w with linear interpolation is accurate and needs no search.
    """
    ym = Y_MIN[approximate]
    w_right = (y - ym).clamp_min(0.0).sqrt()
    w_left = (-torch.log((y / ym).clamp(0.0, 1.0))).sqrt()  # y / ym in (0, 1] on the left
    return torch.where(right, w_right, w_left)


def _bisect(target: torch.Tensor, lo: float, hi: float, approximate: str, increasing: bool):
    a = torch.full_like(target, lo)
    b = torch.full_like(target, hi)
    for _ in range(100):
        mid = 0.5 * (a + b)
        above = _gelu(mid, approximate) > target
        if not increasing:
            above = ~above
        b = torch.where(above, mid, b)
        a = torch.where(above, a, mid)
    return 0.5 * (a + b)


def _table(approximate: str, device: torch.device, dtype: torch.dtype):
    """x at uniform steps of w: left branch in [0, N), right branch in [N, 2N); and the steps."""
    key = (approximate, str(device), dtype)
    if key not in _tables:
        xm, ym = X_MIN[approximate], Y_MIN[approximate]
        f64 = torch.float64
        left = _LEFT_END[approximate]
        wl_end = math.sqrt(-math.log(float(_gelu(torch.tensor(left, dtype=f64), approximate)) / ym))
        wr_end = math.sqrt(_RIGHT_END - ym)
        wl = torch.linspace(0.0, wl_end, _TABLE_N, dtype=f64)
        wr = torch.linspace(0.0, wr_end, _TABLE_N, dtype=f64)
        xl = _bisect(ym * torch.exp(-(wl**2)), left - 1, xm, approximate, increasing=False)
        xr = _bisect(ym + wr**2, xm, _RIGHT_END + 1, approximate, increasing=True)
        xs = torch.cat([xl, xr]).to(device=device, dtype=dtype)
        _tables[key] = (xs, wl_end / (_TABLE_N - 1), wr_end / (_TABLE_N - 1))
    return _tables[key]


def _gelu_and_derivative(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    if approximate == "tanh":
        return _gelu(x, approximate), gelu_derivative(x, approximate)
    cdf = _cdf(x)
    return x * cdf, cdf + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


BACKWARD_CHUNK = 1 << 16  # elements per Newton chunk: bounds the backward's temporaries


def _derivative_chunk(y: torch.Tensor, code: torch.Tensor, approximate: str, steps: int):
    xs, dwl, dwr = _table(approximate, y.device, y.dtype)
    xm = X_MIN[approximate]
    right = code == RIGHT
    pos = _coordinate(y, right, approximate) / torch.where(right, dwr, dwl)
    idx = pos.floor().clamp_(0, _TABLE_N - 2)
    frac = (pos - idx).clamp_(0.0, 1.0)
    idx = idx.long() + right.long() * _TABLE_N
    x0, x1 = xs.take(idx), xs.take(idx + 1)
    x = torch.lerp(x0, x1, frac)
    # Safeguard: the root lies in the table cell [x0, x1]; Newton may not leave it (plus one
    # cell of slack for rounding in w), nor cross x_min, where GELU' = 0 would fling it away.
    slack = (x1 - x0).abs()
    lo = torch.minimum(x0, x1) - slack
    hi = torch.maximum(x0, x1) + slack
    lo = torch.where(right, lo.clamp_min(xm), lo)
    hi = torch.where(right, hi, hi.clamp_max(xm))
    far = right & (y > _RIGHT_END)  # far right: GELU(x) == x
    x, lo, hi = torch.where(far, y, x), torch.where(far, y, lo), torch.where(far, y, hi)
    for _ in range(steps):
        g, d = _gelu_and_derivative(x, approximate)
        x = torch.minimum(torch.maximum(x - (g - y) / torch.where(d == 0, 1.0, d), lo), hi)
    return gelu_derivative(x, approximate)


def gelu_derivative_from_output(
    y: torch.Tensor,
    code: torch.Tensor,
    x_exact: torch.Tensor,
    approximate: str = "none",
    newton_steps: int = 2,
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
