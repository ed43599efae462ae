"""Triton kernels for y = dropout(gelu(x + bias)) (imported on the first Triton launch).

Roundings follow the eager chain: z = x + bias rounded to the output dtype promote(x, bias);
gelu(z) in fp32 (erf or tanh form), rounded once (and once more after dropout's scaling when
dropout is on, as `F.dropout` rounds its own output). Dropout keeps an element when
`tl.rand(seed, row * N + col) >= p` (Philox, counter = the element's index): the backward
regenerates the mask from the same (seed, index) instead of saving it, so the forward saves only
x (and the one-element seed). The bias gradient is reduced in the backward kernel itself: each
program sums its rows of one column block in fp32, and the [programs, N] partials are summed
afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common


@triton.jit
def _gelu_and_grad(z, TANH: tl.constexpr):
    """(gelu(z), d gelu / dz) in fp32."""
    if TANH:
        inner = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0  # tanh(inner)
        y = 0.5 * z * (1.0 + t)
        dy = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (
            1.0 + 3.0 * 0.044715 * z * z)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
        y = z * cdf
        dy = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
    return y, dy


@triton.jit
def _load_z(X, B, row, cols, mask, stride_x, OUT_TY: tl.constexpr, HAS_BIAS: tl.constexpr):
    z = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
        z = (z + b).to(OUT_TY).to(tl.float32)
    return z


@triton.jit
def _fwd_kernel(X, B, Y, SEED, stride_x, stride_y, M, N, rows_per_prog, p, scale,
                BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                DROPOUT: tl.constexpr):
    row_start = tl.program_id(0) * rows_per_prog
    n_rows = tl.minimum(row_start + rows_per_prog, M) - row_start
    row_start = row_start.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    for i in range(0, n_rows):
        row = row_start + i
        z = _load_z(X, B, row, cols, mask, stride_x, Y.dtype.element_ty, HAS_BIAS)
        y, _ = _gelu_and_grad(z, TANH)
        if DROPOUT:
            keep = tl.rand(tl.load(SEED), (row * N + cols).to(tl.int32)) >= p
            y = tl.where(keep, y.to(Y.dtype.element_ty).to(tl.float32) * scale, 0.0)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, X, B, DX, DBP, SEED, stride_dy, stride_x, stride_dx, M, N, rows_per_prog,
                p, scale, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, TANH: tl.constexpr,
                DROPOUT: tl.constexpr, OUT_TY: tl.constexpr):
    pid = tl.program_id(0)
    row_start = pid * rows_per_prog
    n_rows = tl.minimum(row_start + rows_per_prog, M) - row_start
    row_start = row_start.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    db = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(0, n_rows):
        row = row_start + i
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            keep = tl.rand(tl.load(SEED), (row * N + cols).to(tl.int32)) >= p
            dy = tl.where(keep, dy * scale, 0.0).to(OUT_TY).to(tl.float32)
        z = _load_z(X, B, row, cols, mask, stride_x, OUT_TY, HAS_BIAS)
        _, dgelu = _gelu_and_grad(z, TANH)
        dz = (dy * dgelu).to(OUT_TY).to(tl.float32)
        tl.store(DX + row * stride_dx + cols, dz.to(DX.dtype.element_ty), mask=mask)
        db += dz
    if HAS_BIAS:
        tl.store(DBP + pid.to(tl.int64) * N + cols, db, mask=mask)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _launch_shape(m: int, n: int, device: torch.device) -> tuple[tuple[int, int], int, int]:
    block = min(_common.ELEMENTWISE_BLOCK, _common.next_power_of_2(n))
    rows = triton.cdiv(m, _common.reduction_programs(m, device))
    return (triton.cdiv(m, rows), triton.cdiv(n, block)), block, rows


def forward(x: torch.Tensor, bias: torch.Tensor | None, seed: torch.Tensor, p: float,
            tanh: bool) -> torch.Tensor:
    """x: [M, N] with unit column stride; y in promote(x, bias)."""
    m, n = x.shape
    out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    grid, block, rows = _launch_shape(m, n, x.device)
    _fwd_kernel[grid](x, x if bias is None else bias, y, seed, x.stride(0), y.stride(0), m, n,
                      rows, p, 1.0 / (1.0 - p), BLOCK=block, HAS_BIAS=bias is not None,
                      TANH=tanh, DROPOUT=p > 0.0)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, seed: torch.Tensor,
             p: float, tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx in x's dtype, dbias in fp32; shape [0] without a bias)."""
    m, n = x.shape
    out_dtype = x.dtype if bias is None else torch.promote_types(x.dtype, bias.dtype)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid, block, rows = _launch_shape(m, n, x.device)
    dbp = torch.empty((grid[0], n if bias is not None else 0), dtype=torch.float32,
                      device=x.device)
    _bwd_kernel[grid](dy, x, x if bias is None else bias, dx, dbp, seed, dy.stride(0),
                      x.stride(0), dx.stride(0), m, n, rows, p, 1.0 / (1.0 - p), BLOCK=block,
                      HAS_BIAS=bias is not None, TANH=tanh, DROPOUT=p > 0.0,
                      OUT_TY=_TL_DTYPES[out_dtype])
    return dx, dbp.sum(0)
