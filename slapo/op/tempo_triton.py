"""Tempo's Triton kernels: output-saving GELU and LayerNorm, forward and backward, one pass each.

Imported only by `slapo.op.tempo_kernels` (on first launch), never by `import slapo`: it needs
`triton`. The math is documented (and mirrored by PyTorch references) in `tempo_gelu` and
`tempo_layernorm`; all arithmetic is fp32 whatever the storage dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_TANH_K = tl.constexpr(0.044715)


@triton.jit
def _gelu_and_grad(x, TANH: tl.constexpr):
    """(GELU(x), GELU'(x)) in fp32; the tanh form via sigmoid(2z) = (1 + tanh z) / 2."""
    if TANH:
        z = _SQRT_2_OVER_PI * (x + _TANH_K * x * x * x)
        s = 1.0 / (1.0 + tl.exp(-2.0 * z))
        y = x * s
        d = s + 2.0 * _SQRT_2_OVER_PI * x * s * (1.0 - s) * (1.0 + 3.0 * _TANH_K * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.erf(x * _INV_SQRT2))
        y = x * cdf
        d = cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return y, d


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _row_sum(v):
    """tl.sum without `tl.sum`: triton's standard-library helpers are decorated when triton is
    first imported, so they stay compiled-only if that happened before TRITON_INTERPRET=1 was set
    (e.g. by another test module); our own helpers follow the setting at our import."""
    return tl.reduce(v, 0, _add)


@triton.jit
def _round_bf16(v):
    """fp32 -> nearest bf16 value (ties to even), still as fp32. Explicit because Triton's CPU
    interpreter truncates on `.to(tl.bfloat16)`; on GPU it equals the hardware conversion."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _estimate(y, right, tab_ptr, ym, inv_hl, inv_hr, TAB_N: tl.constexpr):
    """GELU' from y and the branch: linear interpolation in the table (see tempo_gelu)."""
    w_right = tl.sqrt(tl.maximum(y - ym, 0.0))
    t = tl.minimum(tl.maximum((y - ym) / -ym, 0.0), 1.0)
    series = t * (1.0 + t * (0.5 + t * (1.0 / 3.0 + t * 0.25)))
    w_left = tl.sqrt(tl.where(t < 1e-2, series, -tl.log(1.0 - t)))
    pos = tl.where(right, w_right * inv_hr, w_left * inv_hl)
    pos = tl.where(pos == pos, pos, 0.0)  # NaN -> 0 (keeps the gather in bounds)
    pos = tl.minimum(tl.maximum(pos, 0.0), TAB_N - 1.0)
    idx = tl.minimum(pos.to(tl.int32), TAB_N - 2)
    frac = pos - idx.to(tl.float32)
    idx = idx + tl.where(right, TAB_N, 0)
    d0 = tl.load(tab_ptr + idx)
    d1 = tl.load(tab_ptr + idx + 1)
    return d0 + frac * (d1 - d0)


@triton.jit
def gelu_fwd_kernel(x_ptr, y_ptr, code_ptr, tab_ptr, n, xm, ym, inv_hl, inv_hr, inv_scale,
                    TANH: tl.constexpr, BF16: tl.constexpr, TAB_N: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y, d = _gelu_and_grad(x, TANH)
    if BF16:
        y = _round_bf16(y)
    ys = y.to(y_ptr.dtype.element_ty)
    right = x >= xm
    est = _estimate(ys.to(tl.float32), right, tab_ptr, ym, inv_hl, inv_hr, TAB_N)
    q = tl.floor(tl.minimum(tl.maximum((d - est) * inv_scale, -63.0), 63.0) + 0.5)
    code = (q + 64.0).to(tl.int32) + tl.where(right, 128, 0)
    tl.store(y_ptr + offs, ys, mask=mask)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def gelu_code_kernel(x_ptr, y_ptr, code_ptr, tab_ptr, n, xm, ym, inv_hl, inv_hr, inv_scale,
                     TANH: tl.constexpr, TAB_N: tl.constexpr, BLOCK: tl.constexpr):
    """The code byte alone, from x and a y computed elsewhere (inside a compiled layer inductor
    computes y fused with its neighbours; the estimate must use that stored y)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _y, d = _gelu_and_grad(x, TANH)
    right = x >= xm
    est = _estimate(y, right, tab_ptr, ym, inv_hl, inv_hr, TAB_N)
    q = tl.floor(tl.minimum(tl.maximum((d - est) * inv_scale, -63.0), 63.0) + 0.5)
    code = (q + 64.0).to(tl.int32) + tl.where(right, 128, 0)
    tl.store(code_ptr + offs, code.to(tl.uint8), mask=mask)


@triton.jit
def gelu_bwd_kernel(dy_ptr, y_ptr, code_ptr, dx_ptr, tab_ptr, n, ym, inv_hl, inv_hr, scale,
                    TAB_N: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    code = tl.load(code_ptr + offs, mask=mask, other=64).to(tl.int32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    right = code >= 128
    q = ((code & 127) - 64).to(tl.float32)
    d = _estimate(y, right, tab_ptr, ym, inv_hl, inv_hr, TAB_N) + q * scale
    tl.store(dx_ptr + offs, (dy * d).to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, ys_ptr, rstd_ptr, n, eps, HAS_W: tl.constexpr,
                  HAS_B: tl.constexpr, SEPARATE: tl.constexpr, BF16_SAVE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    mean = _row_sum(x) / n
    xc = tl.where(mask, x - mean, 0.0)
    var = _row_sum(xc * xc) / n
    rstd = 1.0 / tl.sqrt(var + eps)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=1.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    if SEPARATE:
        if BF16_SAVE:
            y = _round_bf16(y)
        tl.store(ys_ptr + row * n + cols, y.to(ys_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def ln_bwd_kernel(dy_ptr, ys_ptr, w_ptr, b_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, m, n,
                  rows_per_prog, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=1.0).to(tl.float32)
    else:
        w = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        b = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)
    dw_acc = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)
    db_acc = tl.full((BLOCK_N,), 0.0, dtype=tl.float32)
    first = pid * rows_per_prog
    for i in range(0, tl.minimum(rows_per_prog, m - first)):
        row = (first + i).to(tl.int64)
        dy = tl.load(dy_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(ys_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, (y - b) / w, 0.0)
        g = dy * w
        c1 = _row_sum(g) / n
        c2 = _row_sum(g * xhat) / n
        dx = (g - c1 - xhat * c2) * rstd
        tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    if HAS_W:
        tl.store(dw_ptr + pid * n + cols, dw_acc, mask=mask)
    if HAS_B:
        tl.store(db_ptr + pid * n + cols, db_acc, mask=mask)
