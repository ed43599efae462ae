"""Tempo's fused softmax -> dropout -> matmul that recomputes the dropout output in backward.

Why: eager attention saves three s*s tensors per head: the softmax output P (softmax backward),
the dropout mask (a float tensor on CPU, bool on CUDA) and the dropout output P' = M * P / (1 - p)
(saved by the following matmul with V). P' is a cheap function of P and M, so this Function saves
only P and a bool mask M and rebuilds P' in backward:

    dV = P'^T dO,   dP' = dO V^T,   dP = M * dP' / (1 - p),   dS = P * (dP - rowsum(dP * P))

Exact: the same mask is reused, nothing is approximated (results match eager attention up to
floating-point summation order). Devices: any. Use it for eager attention that needs the attention
probabilities or a mask SDPA cannot take; when `scaled_dot_product_attention`/flash attention is
usable, prefer `slapo.op.SDPAttention`: it never stores s*s tensors at all.
"""

from __future__ import annotations

import torch

from .attention_core import AttentionCore, prepare_scores, repeat_kv


class SoftmaxDropoutMatmulFunction(torch.autograd.Function):
    """out = dropout(softmax(scores, -1), p) @ v, saving (softmax, bool drop-mask, v).

    Temporaries are kept to one or two s*s tensors at a time (in-place masking, the fused aten
    softmax backward), so the backward's transient peak is not higher than autograd's.
    """

    @staticmethod
    def forward(ctx, scores, v, p, softmax_dtype):
        probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(v.dtype)
        ctx.scale = 1.0 / (1.0 - p) if p > 0 else 1.0
        ctx.scores_dtype = scores.dtype
        if p > 0:
            drop = torch.empty_like(probs, dtype=torch.bool).bernoulli_(p)  # True = dropped
            out = torch.matmul(probs.masked_fill(drop, 0.0).mul_(ctx.scale), v)
        else:
            drop = None
            out = torch.matmul(probs, v)
        ctx.save_for_backward(probs, drop, v)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        probs, drop, v = ctx.saved_tensors
        dv = dscores = None
        if ctx.needs_input_grad[1]:
            dropped = probs if drop is None else probs.masked_fill(drop, 0.0).mul_(ctx.scale)
            dv = torch.matmul(dropped.transpose(-1, -2), dout)
            del dropped
        if ctx.needs_input_grad[0]:
            dp = torch.matmul(dout, v.transpose(-1, -2))
            if drop is not None:
                dp.masked_fill_(drop, 0.0).mul_(ctx.scale)
            dscores = torch.ops.aten._softmax_backward_data(dp, probs, -1, probs.dtype)
            dscores = dscores.to(ctx.scores_dtype)
        return dscores, dv, None, None


def softmax_dropout_matmul(
    scores: torch.Tensor,
    v: torch.Tensor,
    p: float = 0.0,
    softmax_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """dropout(softmax(scores), p) @ v saving only the softmax output and a bool mask.

    `p` is applied as given (pass 0 in eval mode). `softmax_dtype` (e.g. torch.float32) runs the
    softmax in higher precision, as LLaMA does; the probabilities are then cast to v's dtype.
    """
    if not 0.0 <= p < 1.0:
        raise ValueError(f"softmax_dropout_matmul: p must be in [0, 1), got {p}")
    return SoftmaxDropoutMatmulFunction.apply(scores, v, float(p), softmax_dtype)


class TempoAttentionCore(AttentionCore):
    """HF-compatible attention core: scores = q k^T * scale + mask, then the fused Function.

    Plugs into HF BERT/RoBERTa/GPT-2/LLaMA attention modules via `slapo.op.use_attention_core`;
    handles additive float masks, bool masks, causal masking and GQA like HF's eager path.
    Exact. Any device. Memory: s*s*(elem + 1 byte) per head instead of 3 s*s tensors.
    """

    def __init__(self, softmax_dtype: torch.dtype | None = None):
        super().__init__()
        self.softmax_dtype = softmax_dtype

    def attend(self, q, k, v, mask=None, is_causal=False, dropout=0.0, scaling=None):
        scores = prepare_scores(q, k, mask, is_causal, scaling)
        v = repeat_kv(v, q.shape[1] // v.shape[1])
        return softmax_dropout_matmul(
            scores, v, dropout if self.training else 0.0, self.softmax_dtype
        )
