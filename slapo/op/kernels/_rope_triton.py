"""Triton kernel for rotary position embeddings on q and k (imported on the first launch).

HF LLaMA layout (`rotate_half`): with x = [x1, x2] split at D/2 and cos = [c1, c2],
sin = [s1, s2], y = x * cos + rotate_half(x) * sin is y1 = x1*c1 - x2*s1, y2 = x2*c2 + x1*s2.
The backward is the transposed rotation: dx1 = dy1*c1 + dy2*s2, dx2 = dy2*c2 - dy1*s1.
The forward rounds as HF does (each product to the output dtype, then the sum); the backward
computes in fp32 and rounds once. One program per (batch, position) and block of heads reads
cos/sin once for q and k; q and k may be strided views ([B, S, H, D] here, any strides but a
unit last-dimension stride), so HF's transposed projections are read in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common


@triton.jit
def _rotate(X, Y, x_off, y_off, heads, stride_xh, stride_yh, c1, c2, s1, s2, h, d, HALF,
            BACKWARD: tl.constexpr):
    mask = (h[:, None] < heads) & (d[None, :] < HALF)
    xp = X + x_off + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
    yp = Y + y_off + h[:, None] * stride_yh + d[None, :]
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        ty = Y.dtype.element_ty
        y1 = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        y2 = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
    tl.store(yp, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(yp + HALF, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, S, HQ, HK, HALF,
                 sq_b, sq_s, sq_h, sk_b, sk_s, sk_h, sqo_b, sqo_s, sqo_h, sko_b, sko_s, sko_h,
                 sc_b, sc_s, ss_b, ss_s,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BACKWARD: tl.constexpr):
    pid = tl.program_id(0)
    b = (pid // S).to(tl.int64)
    s = (pid % S).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    cp = COS + b * sc_b + s * sc_s + d
    sp = SIN + b * ss_b + s * ss_s + d
    c1 = tl.load(cp, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cp + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sp, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sp + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    _rotate(Q, QO, b * sq_b + s * sq_s, b * sqo_b + s * sqo_s, HQ, sq_h, sqo_h, c1, c2, s1, s2,
            h, d, HALF, BACKWARD)
    _rotate(K, KO, b * sk_b + s * sk_s, b * sko_b + s * sko_s, HK, sk_h, sko_h, c1, c2, s1, s2,
            h, d, HALF, BACKWARD)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         q_out_dtype: torch.dtype, k_out_dtype: torch.dtype,
         backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, S, Hq, D], k: [B, S, Hk, D], cos/sin: [B, S, D] (any strides, unit last stride).

    Returns the rotated (or, with `backward`, inversely rotated) q and k, laid out like q and k.
    """
    bsz, seq, hq, dim = q.shape
    hk = k.shape[2]
    qo = torch.empty_like(q, dtype=q_out_dtype)
    ko = torch.empty_like(k, dtype=k_out_dtype)
    half = dim // 2
    block_d = _common.next_power_of_2(half)
    block_h = min(_common.next_power_of_2(max(hq, hk)), max(1, 4096 // block_d))
    grid = (bsz * seq, triton.cdiv(max(hq, hk), block_h))
    _rope_kernel[grid](q, k, qo, ko, cos, sin, seq, hq, hk, half,
                       *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3],
                       *cos.stride()[:2], *sin.stride()[:2],
                       BLOCK_H=block_h, BLOCK_D=block_d, BACKWARD=backward)
    return qo, ko
