"""Chunked linear + cross-entropy: the LM-head loss without materialising the (N, V) logits.

Why: for a language model the logits are the largest activation of the step (N tokens x V vocab,
kept in fp32 for the softmax; fp64 inputs stay fp64): 8k tokens x 128k vocab is 4 GiB, plus the same again for their
gradient. This Function walks over `chunk_size` rows at a time, keeps only the per-row
log-sum-exp, and recomputes each chunk's logits in backward to form the gradient on the fly.
Saved for backward: the hidden states (usually saved by the LM head anyway), one fp32 log-sum-exp
and the label per row; nothing proportional to V. Transient memory: one chunk of logits
(chunk_size x V) and its softmax.

Exact: the same math as `F.cross_entropy(hidden @ weight.T + bias, labels)` with fp32 logits;
results match to rounding (summation order). Costs one extra logits GEMM in backward (recompute).
Devices: any. Label smoothing and z-loss are not implemented.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = F.linear(h, weight, bias)
    return logits.to(_compute_dtype(logits.dtype))


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """Per-row loss lse(h W^T + b) - (h W^T + b)[label]; 0 for ignored rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size):
        n = hidden.shape[0]
        ct = _compute_dtype(hidden.dtype)
        lse = torch.empty(n, dtype=ct, device=hidden.device)
        target = torch.empty(n, dtype=ct, device=hidden.device)
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        for i in range(0, n, chunk_size):
            logits = _chunk_logits(hidden[i : i + chunk_size], weight, bias)
            lse[i : i + chunk_size] = torch.logsumexp(logits, dim=-1)
            target[i : i + chunk_size] = logits.gather(1, safe[i : i + chunk_size, None])[:, 0]
            del logits
        loss = (lse - target).masked_fill_(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        ct = lse.dtype
        scale = grad_loss.to(ct).masked_fill(~valid, 0.0)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=ct, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=ct, device=weight.device) if need_b else None
        for i in range(0, hidden.shape[0], ctx.chunk_size):
            part = slice(i, i + ctx.chunk_size)
            h = hidden[part]
            # d loss / d logits = softmax - onehot(label), times the incoming per-row gradient.
            g = _chunk_logits(h, weight, bias).sub_(lse[part, None]).exp_()
            g.scatter_add_(1, safe[part, None], -torch.ones_like(lse[part, None]))
            g.mul_(scale[part, None])
            if need_h:
                dh[part] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                dw.addmm_(g.t(), h.to(ct))
            if need_b:
                db.add_(g.sum(0))
            del g
        dw = dw.to(weight.dtype) if need_w else None
        db = db.to(bias.dtype) if need_b else None
        return dh, dw, db, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 1024,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, labels) in row chunks (see module docstring).

    hidden: (..., h), labels: (...), weight: (V, h). `reduction`: "mean" (over non-ignored
    rows, like `F.cross_entropy`), "sum" or "none" (per-row losses, 0 where ignored).
    """
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} "
            "must agree on all but the last dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: weight must be (V, {hidden.shape[-1]}), got {tuple(weight.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: unknown reduction {reduction!r}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = labels.reshape(-1)
    loss = ChunkedLinearCrossEntropyFunction.apply(
        flat_h, weight, bias, flat_l, ignore_index, chunk_size
    )
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_l != ignore_index).sum().clamp_min(1)


class ChunkedLinearCrossEntropy(nn.Module):
    """Module form: `forward(hidden, labels)` with the LM head's weight (and bias) shared.

    Use `ChunkedLinearCrossEntropy(lm_head)` to compute the loss of `lm_head(hidden)` without the
    logits, e.g. in a causal-LM training loop (shift labels yourself).
    """

    def __init__(self, head: nn.Linear, ignore_index: int = -100, chunk_size: int = 1024):
        super().__init__()
        self.head = head
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
        return linear_cross_entropy(
            hidden,
            self.head.weight,
            labels,
            self.head.bias,
            self.ignore_index,
            reduction,
            self.chunk_size,
        )
