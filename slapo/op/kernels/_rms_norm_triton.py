"""Triton kernels for RMSNorm (imported only on the first Triton launch; see `_common`).

Math, per row x of length N (HF `LlamaRMSNorm`): in fp32, r = rsqrt(mean(x^2) + eps),
h = x * r; hc = h rounded to the round dtype R; y = w * hc rounded to promote(R, w). Backward,
with g = dy * w rounded to R (the gradient HF's autograd hands to hc):
dx = r * (g - h * mean(g * h)), dw = sum over rows of dy * hc.
R is x's dtype in the LLaMA style, and in the T5 style the weight's dtype when it is half
precision, else fp32 (`rms_norm.round_dtype`); the kernels take it as ROUND: 1 = x's element
type, 2 = w's, 0 = no rounding (fp32).
The forward saves only r (one fp32 per row); h is recomputed from x in the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common


@triton.jit
def _round(v, X, W, ROUND: tl.constexpr):
    """v (fp32) rounded to the round dtype and back to fp32 (see the module docstring)."""
    if ROUND == 1:
        v = v.to(X.dtype.element_ty).to(tl.float32)
    elif ROUND == 2:
        v = v.to(W.dtype.element_ty).to(tl.float32)
    return v


@triton.jit
def _fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, N, eps,
                BLOCK: tl.constexpr, SINGLE: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Y += row * stride_y
    if SINGLE:  # the whole row in registers: one read of x
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
        hc = _round(x * rstd, X, W, ROUND)
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, (w * hc).to(Y.dtype.element_ty), mask=mask)
    else:  # long rows: one pass for the statistic, one to normalise
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            hc = _round(x * rstd, X, W, ROUND)
            w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + cols, (w * hc).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@triton.jit
def _bwd_kernel(DY, X, W, RSTD, DX, DWP, stride_dy, stride_x, stride_dx, M, N, rows_per_prog,
                BLOCK: tl.constexpr, SINGLE: tl.constexpr, ROUND: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    n_rows = tl.minimum(row_start + rows_per_prog, M) - row_start
    row_start = row_start.to(tl.int64)
    DWP += pid.to(tl.int64) * N
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, n_rows):
            r64 = row_start + i
            x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + r64)
            h = x * rstd
            dw += dy * _round(h, X, W, ROUND)
            g = _round(dy * w, X, W, ROUND)
            c = tl.sum(g * h, axis=0) / N
            dx = rstd * (g - h * c)
            tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
        tl.store(DWP + cols, dw, mask=mask)
    else:  # per row: one pass for mean(g*h), one for dx and the dw partial (kept in DWP)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(DWP + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=cols < N)
        for i in range(0, n_rows):
            r64 = row_start + i
            rstd = tl.load(RSTD + r64)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                g = _round(dy * w, X, W, ROUND)
                acc += g * x * rstd
            c = tl.sum(acc, axis=0) / N
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
                w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                h = x * rstd
                g = _round(dy * w, X, W, ROUND)
                dx = rstd * (g - h * c)
                tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                dwp = tl.load(DWP + cols, mask=mask, other=0.0)
                dwp += dy * _round(h, X, W, ROUND)
                tl.store(DWP + cols, dwp, mask=mask)


def _round_code(x: torch.Tensor, w: torch.Tensor, r: torch.dtype) -> int:
    return 1 if r == x.dtype else 2 if r == w.dtype else 0


def forward(x: torch.Tensor, w: torch.Tensor, eps: float,
            r: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, N] with unit column stride; r: the round dtype. Returns (y [M, N] in
    promote(r, w), rstd [M] fp32)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=torch.promote_types(r, w.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block = _common.row_block(n)
    _fwd_kernel[(m,)](x, w, y, rstd, x.stride(0), y.stride(0), n, eps,
                      BLOCK=block, SINGLE=block >= n, ROUND=_round_code(x, w, r),
                      num_warps=_common.num_warps(block))
    return y, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
             r: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in x's dtype, dw in w's dtype)."""
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    progs = _common.reduction_programs(m, x.device)
    partial = torch.empty((progs, n), dtype=torch.float32, device=x.device)
    block = _common.row_block(n)
    _bwd_kernel[(progs,)](dy, x, w, rstd, dx, partial, dy.stride(0), x.stride(0), dx.stride(0),
                          m, n, triton.cdiv(m, progs), BLOCK=block, SINGLE=block >= n,
                          ROUND=_round_code(x, w, r), num_warps=_common.num_warps(block))
    return dx, partial.sum(0).to(w.dtype)
