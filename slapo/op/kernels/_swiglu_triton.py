"""Triton kernels for the SwiGLU activation y = silu(gate) * up (imported on first launch).

Roundings follow HF's eager chain `act_fn(gate) * up`: a = silu(g) rounded to g's dtype, then
y = a * u rounded to promote(g, u). Backward: da = dy * u rounded to g's dtype, du = dy * a
rounded to u's dtype, dg = da * s * (1 + g * (1 - s)) with s = sigmoid(g), in fp32, rounded
once. Nothing but gate and up is saved; silu is recomputed in the backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common


@triton.jit
def _fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    a = (g * tl.sigmoid(g)).to(G.dtype.element_ty).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, N,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    a = (g * s).to(G.dtype.element_ty).to(tl.float32)
    da = (dy * u).to(G.dtype.element_ty).to(tl.float32)
    dg = da * s * (1.0 + g * (1.0 - s))
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)


def _grid(m: int, n: int) -> tuple[tuple[int, int], int]:
    block = min(_common.ELEMENTWISE_BLOCK, _common.next_power_of_2(n))
    return (m, triton.cdiv(n, block)), block


def forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """g, u: [M, N] with unit column stride. Returns y [M, N] in promote(g, u)."""
    m, n = g.shape
    y = torch.empty((m, n), dtype=torch.promote_types(g.dtype, u.dtype), device=g.device)
    grid, block = _grid(m, n)
    _fwd_kernel[grid](g, u, y, g.stride(0), u.stride(0), y.stride(0), n, BLOCK=block)
    return y


def backward(dy: torch.Tensor, g: torch.Tensor,
             u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dgate in g's dtype, dup in u's dtype)."""
    m, n = g.shape
    dg = torch.empty((m, n), dtype=g.dtype, device=g.device)
    du = torch.empty((m, n), dtype=u.dtype, device=u.device)
    grid, block = _grid(m, n)
    _bwd_kernel[grid](dy, g, u, dg, du, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0),
                      du.stride(0), n, BLOCK=block)
    return dg, du
