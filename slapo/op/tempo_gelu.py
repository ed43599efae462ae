"""Tempo's output-saving GELU (Andoorveedu et al., NeurIPS 2022): keep y, drop x.

Why: in a transformer MLP, FC1 -> GELU -> FC2, plain autograd keeps both the GELU input x (for
GELU's backward) and its output y (FC2 saves it as its input). Both are b*s*4h. GELU is monotone on
each side of its minimiser x_min ~ -0.7518, so y plus a branch bit determines x. Tempo saves y
(shared with FC2, so free) and one byte per element instead of x: 4 -> 1 byte (fp32), 2 -> 1
(bf16/fp16).

The byte ("code"): bit 7 = right branch (x >= x_min); bits 0-6 = q + 64, a 7-bit correction.
Backward estimates d_est = GELU'(x) from y alone with one table lookup (uniform table of GELU' in a
smoothing coordinate w: sqrt(y - y_min) on the right branch, sqrt(-log(y / y_min)) on the left; no
search, no Newton, fully elementwise), then adds q * S. The forward knows x, runs the same estimate
on the *stored* (rounded) y and picks q = round((GELU'(x) - d_est) / S), clamped to [-63, 63]. So
the byte repairs exactly what y's rounding lost -- worst next to x_min, where GELU' = 0 makes the
inverse ill-conditioned -- without the data-dependent "exact band" copy of an earlier design
(which needed `masked_select`, a host sync, and broke `torch.compile`). S per storage dtype is set
from the measured worst |GELU'(x) - d_est| (`CORRECTION_SCALE`), so the final error is <= S / 2
wherever the estimate's error is <= 63 S (everywhere measured; tests/test_tempo_kernels.py).

Derivative error (dense grid over [-12, 12] and x_min +- 0.1, tests): fp32 storage <= 1.2e-6
absolute (autograd's own fp32 tanh-GELU backward: 1.0e-6); bf16 <= 2.5e-4; fp16 <= 4e-5; fp64
(reference only: the estimate is refined by two safeguarded Newton steps) <= 1e-12. Forward output:
bit-identical to `F.gelu` in the PyTorch reference; the Triton kernel computes the same formula in
fp32 (equal up to the last bit of the storage dtype).

Execution: one fused kernel each way. CUDA tensors with `triton` installed run Triton kernels
(`slapo.op.tempo_kernels`); everything else runs the PyTorch reference below, which computes the
same math (chunked, so its temporaries stay small). In eager mode a plain `autograd.Function`
calls the kernels. Under `torch.compile` (`CompiledGELUFunction`) inductor computes y itself, fused
with FC1's bias add and casts, and only the code byte (`slapo_tempo::gelu_code`, from x and that
stored y) and the backward (`slapo_tempo::gelu_bwd`) are custom ops: traced, the code was
recomputed by AOTAutograd's partitioner, which then saved x and y (docs/tempo.md). The whole-op
`slapo_tempo::gelu_fwd` stays for `SLAPO_TEMPO_COMPILED=opaque`, to measure against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from . import tempo_kernels
from .kernels._common import use_triton

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_TANH_K = 0.044715

RIGHT_BIT = 128  # code bit 7: x >= x_min
Q_MAX = 63  # correction range: q in [-Q_MAX, Q_MAX], stored as q + 64 in bits 0-6
TABLE_N = 4096  # table entries per branch
# Correction step S per storage dtype: 63 * S covers the measured worst estimate error (x 1.25).
CORRECTION_SCALE = {
    torch.float64: 1e-10,
    torch.float32: 5.2e-6,
    torch.bfloat16: 3.1e-4,
    torch.float16: 1.4e-4,
}


def _cdf(x: torch.Tensor) -> torch.Tensor:
    """Normal CDF via erfc: accurate in the left tail (1 + erf is not); table building only."""
    return 0.5 * torch.special.erfc(x * -_INV_SQRT_2)


def _tanh_half(x: torch.Tensor) -> torch.Tensor:
    """0.5 * (1 + tanh(z)) = sigmoid(2z): no cancellation in the left tail (1 + tanh has it)."""
    return torch.sigmoid(2.0 * _SQRT_2_OVER_PI * (x + _TANH_K * x**3))


def _gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    if approximate == "tanh":
        return x * _tanh_half(x)
    return x * _cdf(x)


def gelu_derivative(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """d GELU / dx at x (exact erf form or the tanh approximation)."""
    if approximate == "tanh":
        s = _tanh_half(x)
        return s + 2.0 * _SQRT_2_OVER_PI * x * s * (1.0 - s) * (1.0 + 3.0 * _TANH_K * x * x)
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
# Left end of the tables: |GELU'(-10)| < 1e-20 for both forms (computed without cancellation).
_LEFT_END = {"none": -10.0, "tanh": -10.0}
_RIGHT_END = 10.0  # GELU(x) == x and GELU'(x) == 1 to fp32 precision beyond this
_tables: dict[tuple, torch.Tensor] = {}


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


def table_steps(approximate: str) -> tuple[float, float]:
    """Table step in w on the (left, right) branch."""
    ym = Y_MIN[approximate]
    y_left = float(_gelu(torch.tensor(_LEFT_END[approximate], dtype=torch.float64), approximate))
    wl_end = math.sqrt(-math.log(y_left / ym))
    wr_end = math.sqrt(_RIGHT_END - ym)
    return wl_end / (TABLE_N - 1), wr_end / (TABLE_N - 1)


def _x_table(approximate: str) -> torch.Tensor:
    """fp64 x at uniform steps of w: left branch in [0, N), right branch in [N, 2N)."""
    key = ("x", approximate)
    if key not in _tables:
        xm, ym = X_MIN[approximate], Y_MIN[approximate]
        hl, hr = table_steps(approximate)
        w = torch.arange(TABLE_N, dtype=torch.float64)
        xl = _bisect(ym * torch.exp(-((w * hl) ** 2)), _LEFT_END[approximate] - 1, xm,
                     approximate, increasing=False)
        xr = _bisect(ym + (w * hr) ** 2, xm, _RIGHT_END + 1, approximate, increasing=True)
        _tables[key] = torch.cat([xl, xr])
    return _tables[key]


def derivative_table(approximate: str, device: torch.device | str, dtype=torch.float32):
    """GELU' at the table's nodes (same layout as the x table), cached per device and dtype."""
    key = ("d", approximate, str(device), dtype)
    if key not in _tables:
        d = gelu_derivative(_x_table(approximate), approximate)
        _tables[key] = d.to(device=device, dtype=dtype)
    return _tables[key]


def _coordinate(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """Table position (float, in cells) of y on its branch; same formula as the Triton kernel.

    Right: w = sqrt(y - y_min). Left: w = sqrt(-log(y / y_min)) = sqrt(-log1p(-t)) with
    t = (y - y_min) / -y_min in [0, 1], summed as a series for small t (no cancellation).
    Both remove the square-root singularity of the inverse at x_min.
    """
    ym = Y_MIN[approximate]
    hl, hr = table_steps(approximate)
    w_right = (y - ym).clamp_min(0.0).sqrt()
    t = ((y - ym) / -ym).clamp(0.0, 1.0)
    series = t * (1.0 + t * (0.5 + t * (1.0 / 3.0 + t * 0.25)))
    w_left = torch.where(t < 1e-2, series, -torch.log(1.0 - t)).sqrt()
    pos = torch.where(right, w_right * (1.0 / hr), w_left * (1.0 / hl))
    pos = torch.nan_to_num(pos, nan=0.0)
    return pos.clamp(0.0, TABLE_N - 1.0)


def _lookup(table: torch.Tensor, pos: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    idx = pos.to(torch.int32).clamp_max(TABLE_N - 2)
    frac = pos - idx.to(pos.dtype)
    idx = idx.long() + right.long() * TABLE_N
    t0, t1 = table.take(idx).to(pos.dtype), table.take(idx + 1).to(pos.dtype)
    return t0 + frac * (t1 - t0)


def _newton(y, pos, right, approximate: str, steps: int):
    """fp64 only: x from the x table, refined by safeguarded Newton steps on GELU(x) = y."""
    xs = _x_table(approximate).to(y.device)
    xm = X_MIN[approximate]
    idx = pos.to(torch.int32).clamp_max(TABLE_N - 2).long() + right.long() * TABLE_N
    x0, x1 = xs.take(idx), xs.take(idx + 1)
    x = _lookup(xs, pos, right)
    # The root lies in the cell [x0, x1] (plus one cell of slack for rounding in w) and never
    # crosses x_min, where GELU' = 0 would fling Newton away.
    slack = (x1 - x0).abs()
    lo, hi = torch.minimum(x0, x1) - slack, torch.maximum(x0, x1) + slack
    lo = torch.where(right, lo.clamp_min(xm), lo)
    hi = torch.where(right, hi, hi.clamp_max(xm))
    far = right & (y > _RIGHT_END)
    x, lo, hi = torch.where(far, y, x), torch.where(far, y, lo), torch.where(far, y, hi)
    for _ in range(steps):
        g, d = _gelu(x, approximate), gelu_derivative(x, approximate)
        x = torch.minimum(torch.maximum(x - (g - y) / torch.where(d == 0, 1.0, d), lo), hi)
    return gelu_derivative(x, approximate)


def estimate_derivative(y: torch.Tensor, right: torch.Tensor, approximate: str) -> torch.Tensor:
    """d_est: GELU'(x) from y = GELU(x) and the branch alone (compute dtype = y's dtype)."""
    pos = _coordinate(y, right, approximate)
    if y.dtype == torch.float64:
        return _newton(y, pos, right, approximate, steps=2)
    return _lookup(derivative_table(approximate, y.device), pos, right)


def correction_scale(dtype: torch.dtype) -> float:
    """The step S of the 7-bit derivative correction for y stored in `dtype`."""
    if dtype not in CORRECTION_SCALE:
        raise ValueError(f"Tempo GELU: unsupported dtype {dtype}; use a floating-point tensor")
    return CORRECTION_SCALE[dtype]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


CHUNK = 1 << 18  # elements per reference chunk: bounds the reference's temporaries


def _forward_chunk(x, y, approximate: str, scale: float) -> torch.Tensor:
    ct = _compute_dtype(x.dtype)
    xc = x.to(ct)
    right = xc >= X_MIN[approximate]
    d_true = gelu_derivative(xc, approximate)
    d_est = estimate_derivative(y.to(ct), right, approximate)
    q = torch.floor(((d_true - d_est) / scale).clamp(-Q_MAX, Q_MAX) + 0.5)
    return (q + 64).to(torch.uint8) | (right.to(torch.uint8) * RIGHT_BIT)


def gelu_code_reference(x: torch.Tensor, y: torch.Tensor, approximate: str = "none"):
    """The 1-byte code of x given the stored y = GELU(x) (any rounding of it); PyTorch, chunked."""
    code = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    scale = correction_scale(y.dtype)
    fx, fy, fc = x.reshape(-1), y.reshape(-1), code.view(-1)
    for i in range(0, fx.numel(), CHUNK):
        part = slice(i, i + CHUNK)
        fc[part] = _forward_chunk(fx[part], fy[part], approximate, scale)
    return code


def gelu_forward_reference(x: torch.Tensor, approximate: str = "none"):
    """(y, code): y = F.gelu(x) (bit-identical) and the 1-byte code; PyTorch, any device."""
    y = F.gelu(x, approximate=approximate)
    return y, gelu_code_reference(x, y, approximate)


def gelu_derivative_from_output(
    y: torch.Tensor, code: torch.Tensor, approximate: str = "none"
) -> torch.Tensor:
    """GELU'(x) (in y's dtype) recovered from y = GELU(x) and the 1-byte code; PyTorch, chunked."""
    ct = _compute_dtype(y.dtype)
    scale = correction_scale(y.dtype)
    deriv = torch.empty(y.shape, dtype=ct, device=y.device)
    fy, fc, fd = y.reshape(-1), code.reshape(-1), deriv.view(-1)
    for i in range(0, fy.numel(), CHUNK):
        part = slice(i, i + CHUNK)
        c = fc[part]
        right = c >= RIGHT_BIT
        q = (c & 127).to(ct) - 64.0
        fd[part] = estimate_derivative(fy[part].to(ct), right, approximate) + q * scale
    return deriv


def gelu_backward_reference(dy, y, code, approximate: str = "none") -> torch.Tensor:
    """dx = dy * GELU'(x), computed in fp32 (fp64 for fp64) and returned in dy's dtype."""
    d = gelu_derivative_from_output(y, code, approximate)
    return (dy.to(d.dtype) * d).to(dy.dtype)


def gelu_forward(x: torch.Tensor, approximate: str = "none"):
    """(y, code) by the fastest available kernel (Triton on CUDA, else the reference)."""
    if use_triton("auto", x):
        return tempo_kernels.gelu_fwd(x, approximate)
    return gelu_forward_reference(x, approximate)


def gelu_code(x: torch.Tensor, y: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """The code byte for a y computed elsewhere, by the fastest available kernel."""
    if use_triton("auto", x, y):
        return tempo_kernels.gelu_code(x, y, approximate)
    return gelu_code_reference(x.contiguous(), y.contiguous(), approximate)


def gelu_backward(dy, y, code, approximate: str = "none") -> torch.Tensor:
    """dx from (dy, y, code) by the fastest available kernel."""
    if use_triton("auto", y):
        return tempo_kernels.gelu_bwd(dy, y, code, approximate)
    return gelu_backward_reference(dy, y, code, approximate)


class TempoGELUFunction(torch.autograd.Function):
    """y = GELU(x) saving (y, 1-byte code); the eager-mode path (see module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none"):
        y, code = gelu_forward(x.contiguous(), approximate)
        ctx.approximate = approximate
        ctx.save_for_backward(y, code)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        y, code = ctx.saved_tensors
        return gelu_backward(grad.contiguous(), y, code, ctx.approximate), None


@torch.library.custom_op("slapo_tempo::gelu_fwd", mutates_args=())
def _gelu_fwd_op(x: torch.Tensor, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    return gelu_forward(x.contiguous(), approximate)


def _dense(like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous tensor shaped like `like`: the real kernels return contiguous outputs, so the
    fake ones must too (`empty_like` would copy a transposed input's strides, and inductor would
    then read the real output with the wrong strides)."""
    return torch.empty(like.shape, dtype=dtype or like.dtype, device=like.device)


@_gelu_fwd_op.register_fake
def _(x, approximate):
    return _dense(x), _dense(x, torch.uint8)


@torch.library.custom_op("slapo_tempo::gelu_bwd", mutates_args=())
def _gelu_bwd_op(
    dy: torch.Tensor, y: torch.Tensor, code: torch.Tensor, approximate: str
) -> torch.Tensor:
    return gelu_backward(dy.contiguous(), y.contiguous(), code.contiguous(), approximate)


@_gelu_bwd_op.register_fake
def _(dy, y, code, approximate):
    return _dense(dy)


def _gelu_setup(ctx, inputs, output):
    ctx.approximate = inputs[1]
    ctx.save_for_backward(*output)


def _gelu_grad(ctx, dy, _dcode):
    y, code = ctx.saved_tensors
    return _gelu_bwd_op(dy, y, code, ctx.approximate), None


_gelu_fwd_op.register_autograd(_gelu_grad, setup_context=_gelu_setup)


@torch.library.custom_op("slapo_tempo::gelu_code", mutates_args=())
def _gelu_code_op(x: torch.Tensor, y: torch.Tensor, approximate: str) -> torch.Tensor:
    return gelu_code(x, y, approximate)


@_gelu_code_op.register_fake
def _(x, y, approximate):
    return _dense(x, torch.uint8)


class CompiledGELUFunction(torch.autograd.Function):
    """The GELU inside `torch.compile` ("fused" path): y by inductor, code and backward opaque.

    Why this split (measured, docs/tempo.md): with y = F.gelu(x) traced, inductor fuses it with
    FC1's bias add and the autocast cast as in a plain compiled layer. The code byte is a custom
    op on purpose: when the code was traced too, AOTAutograd's min-cut partitioner re-decided what
    to save and kept x *and* y (recomputing the code in backward), dropping Tempo's saving. An
    opaque op's output cannot be recomputed, so the partitioner saves (y, code) -- or (x, code)
    and recomputes y, the same bytes -- never x and y. The backward is the fused custom kernel
    (`slapo_tempo::gelu_bwd`), which also keeps the derivative table out of the traced graph.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, approximate: str = "none"):
        y = F.gelu(x, approximate=approximate)
        code = _gelu_code_op(x, y, approximate)
        ctx.approximate = approximate
        ctx.save_for_backward(y, code)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        y, code = ctx.saved_tensors
        return _gelu_bwd_op(dy, y, code, ctx.approximate), None


def _check(approximate: str) -> None:
    if approximate not in X_MIN:
        raise ValueError(f"Tempo GELU: approximate must be 'none' or 'tanh', got {approximate!r}")


def tempo_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Functional output-saving GELU; `approximate` is "none" (erf) or "tanh" like `F.gelu`.

    Without autograd (no grad needed) it is plain `F.gelu`: the code byte is only for backward.
    """
    _check(approximate)
    if not (torch.is_grad_enabled() and x.requires_grad):
        return F.gelu(x, approximate=approximate)
    if torch.compiler.is_compiling():
        if tempo_kernels.compiled_path() == "opaque":
            return _gelu_fwd_op(x, approximate)[0]
        return CompiledGELUFunction.apply(x, approximate)
    return TempoGELUFunction.apply(x, approximate)


class TempoGELU(nn.Module):
    """Drop-in for `nn.GELU` / HF `GELUActivation` / `NewGELUActivation` that saves its output.

    Use when the GELU is followed by a layer that saves its input anyway (a Linear): the input of
    the GELU is then never stored. Approximate within the bound in the module docstring; any
    device. `approximate="tanh"` matches HF "gelu_new" / "gelu_pytorch_tanh".
    """

    def __init__(self, approximate: str = "none"):
        super().__init__()
        _check(approximate)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tempo_gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
