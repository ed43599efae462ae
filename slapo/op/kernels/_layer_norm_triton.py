"""Triton kernels for LayerNorm over the last dimension (imported on the first Triton launch).

Math, per row x of length N, all in fp32 (as PyTorch's CUDA kernel): mean, biased variance
(two-pass: sum((x - mean)^2), not E[x^2] - mean^2), rstd = rsqrt(var + eps),
xhat = (x - mean) * rstd, y = xhat * w + b, rounded once to the output dtype. Backward with
wdy = w * dy: dx = rstd * (wdy - xhat * mean(xhat * wdy) - mean(wdy)), dw = sum dy * xhat,
db = sum dy (over rows; per-program fp32 partials summed afterwards). Saves mean and rstd.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common


@triton.jit
def _fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, N, eps, BLOCK: tl.constexpr,
                SINGLE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    Y += row * stride_y
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) / N + eps)
        y = xc * rstd
        if HAS_W:
            y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:  # long rows: mean, then variance, then the output, one pass each
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            acc += tl.load(X + cols, mask=cols < N, other=0.0).to(tl.float32)
        mean = tl.sum(acc, axis=0) / N
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean, 0.0)
            acc += xc * xc
        rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / N + eps)
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < N
            x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd
            if HAS_W:
                y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + cols, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _row_grads(DY, X, W, r64, mean, rstd, cols, mask, stride_dy, stride_x, HAS_W: tl.constexpr):
    """(dy, xhat, w * dy) for one chunk of one row, in fp32."""
    x = tl.load(X + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    wdy = dy
    if HAS_W:
        wdy = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return dy, xhat, wdy


@triton.jit
def _bwd_kernel(DY, X, W, MEAN, RSTD, DX, DWP, DBP, stride_dy, stride_x, stride_dx, M, N,
                rows_per_prog, BLOCK: tl.constexpr, SINGLE: tl.constexpr, HAS_W: tl.constexpr,
                HAS_B: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    n_rows = tl.minimum(row_start + rows_per_prog, M) - row_start
    row_start = row_start.to(tl.int64)
    DWP += pid.to(tl.int64) * N
    DBP += pid.to(tl.int64) * N
    if SINGLE:
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(0, n_rows):
            r64 = row_start + i
            mean = tl.load(MEAN + r64)
            rstd = tl.load(RSTD + r64)
            dy, xhat, wdy = _row_grads(DY, X, W, r64, mean, rstd, cols, mask, stride_dy,
                                       stride_x, HAS_W)
            c1 = tl.sum(xhat * wdy, axis=0) / N
            c2 = tl.sum(wdy, axis=0) / N
            dx = (wdy - (xhat * c1 + c2)) * rstd
            tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += dy * xhat
            db += dy
        if HAS_W:
            tl.store(DWP + cols, dw, mask=mask)
        if HAS_B:
            tl.store(DBP + cols, db, mask=mask)
    else:
        for start in range(0, N, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            zero = tl.zeros([BLOCK], dtype=tl.float32)
            if HAS_W:
                tl.store(DWP + cols, zero, mask=cols < N)
            if HAS_B:
                tl.store(DBP + cols, zero, mask=cols < N)
        for i in range(0, n_rows):
            r64 = row_start + i
            mean = tl.load(MEAN + r64)
            rstd = tl.load(RSTD + r64)
            acc1 = tl.zeros([BLOCK], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                dy, xhat, wdy = _row_grads(DY, X, W, r64, mean, rstd, cols, cols < N,
                                           stride_dy, stride_x, HAS_W)
                acc1 += xhat * wdy
                acc2 += wdy
            c1 = tl.sum(acc1, axis=0) / N
            c2 = tl.sum(acc2, axis=0) / N
            for start in range(0, N, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < N
                dy, xhat, wdy = _row_grads(DY, X, W, r64, mean, rstd, cols, mask, stride_dy,
                                           stride_x, HAS_W)
                dx = (wdy - (xhat * c1 + c2)) * rstd
                tl.store(DX + r64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
                if HAS_W:
                    tl.store(DWP + cols, tl.load(DWP + cols, mask=mask) + dy * xhat, mask=mask)
                if HAS_B:
                    tl.store(DBP + cols, tl.load(DBP + cols, mask=mask) + dy, mask=mask)


def forward(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float,
            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: [M, N] with unit column stride. Returns (y [M, N], mean [M], rstd [M]) (stats fp32)."""
    m, n = x.shape
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    mean = torch.empty(m, dtype=torch.float32, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    block = _common.row_block(n)
    _fwd_kernel[(m,)](x, x if w is None else w, x if b is None else b, y, mean, rstd,
                      x.stride(0), y.stride(0), n, eps, BLOCK=block, SINGLE=block >= n,
                      HAS_W=w is not None, HAS_B=b is not None,
                      num_warps=_common.num_warps(block))
    return y, mean, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor | None, has_bias: bool,
             mean: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Returns (dx in x's dtype, dw, db); dw and db in fp32, of shape [0] when absent."""
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    progs = _common.reduction_programs(m, x.device)
    dwp = torch.empty((progs, n if w is not None else 0), dtype=torch.float32, device=x.device)
    dbp = torch.empty((progs, n if has_bias else 0), dtype=torch.float32, device=x.device)
    block = _common.row_block(n)
    _bwd_kernel[(progs,)](dy, x, x if w is None else w, mean, rstd, dx, dwp, dbp, dy.stride(0),
                          x.stride(0), dx.stride(0), m, n, triton.cdiv(m, progs), BLOCK=block,
                          SINGLE=block >= n, HAS_W=w is not None, HAS_B=has_bias,
                          num_warps=_common.num_warps(block))
    return dx, dwp.sum(0), dbp.sum(0)
