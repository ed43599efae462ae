"""Vocabulary-parallel embedding and cross-entropy for tensor-parallel LM heads (Megatron-style).

Why: the embedding table and the LM head (V x h) are the largest single weights of a language
model, and the (N, V) logits the largest activation. Splitting the vocabulary over the ranks of a
tensor-parallel group divides all three by the group size; the loss is then computed from the
local logit shards with three small all-reduces (max, target logit, sum of exps) of N floats
each, never gathering the full logits.

Rank r owns vocabulary rows [r * V/p, (r + 1) * V/p) (V must divide evenly). Exact (same math as the
unsharded ops, up to summation order). Devices: any backend torch.distributed supports (gloo on
CPU, NCCL on GPU). Without an initialised process group every op runs as a world of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import collectives
from ..sharding import scale_grad_by_id_freq


def _world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if _world(group)[0] > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def vocab_range(vocab: int, group=None) -> tuple[int, int]:
    """[start, end) of the vocabulary rows this rank owns."""
    world, rank = _world(group)
    if vocab % world:
        raise ValueError(f"vocab size {vocab} is not divisible by the group size {world}")
    per = vocab // world
    return rank * per, (rank + 1) * per


def reduce_from_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum partial results over the group; gradient passes through unchanged (Megatron's g)."""
    return collectives.reduce_forward(x, group)


def copy_to_group(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity whose gradient is summed over the group (Megatron's f: input of a
    column-parallel layer)."""
    return collectives.reduce_backward(x, group)


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows are split over `group`; outputs are all-reduced (replicated).

    `weight` may be the full (V, h) table (this rank's rows are copied out) or already the local
    (V/p, h) shard. Ids outside the local range produce zeros locally; the all-reduce fills them in.
    `scale_grad_by_freq` as `nn.Embedding`'s, counted over the global ids (every rank sees the
    same ids; the local indices would count every foreign id towards local row 0).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group=None,
        weight: torch.Tensor | None = None,
        scale_grad_by_freq: bool = False,
    ):
        super().__init__()
        self.group = group
        self.scale_grad_by_freq = scale_grad_by_freq
        self.num_embeddings = num_embeddings
        self.start, self.end = vocab_range(num_embeddings, group)
        rows = self.end - self.start
        if weight is None:
            w = torch.empty(rows, embedding_dim)
            nn.init.normal_(w)
        elif weight.shape == (num_embeddings, embedding_dim):
            w = weight.detach()[self.start : self.end].clone()
        elif weight.shape == (rows, embedding_dim):
            w = weight.detach().clone()
        else:
            raise ValueError(
                f"VocabParallelEmbedding: weight {tuple(weight.shape)} is neither the full "
                f"({num_embeddings}, {embedding_dim}) table nor the local ({rows}, {embedding_dim})"
            )
        self.weight = nn.Parameter(w)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None) -> VocabParallelEmbedding:
        if emb.padding_idx is not None or emb.max_norm is not None:
            raise ValueError("VocabParallelEmbedding: padding_idx/max_norm are not supported")
        return cls(emb.num_embeddings, emb.embedding_dim, group, emb.weight,
                   scale_grad_by_freq=emb.scale_grad_by_freq)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.end)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight)
        if self.scale_grad_by_freq:
            out = scale_grad_by_id_freq(out, ids)
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_from_group(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, start, ignore_index, group):
        x = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
        gmax = x.max(dim=-1).values
        _all_reduce(gmax, dist.ReduceOp.MAX, group)
        x = x - gmax[:, None]
        valid = labels != ignore_index
        local = labels - start
        mine = valid & (local >= 0) & (local < x.shape[-1])
        idx = local.masked_fill(~mine, 0)
        target = x.gather(1, idx[:, None])[:, 0].masked_fill(~mine, 0.0)
        _all_reduce(target, dist.ReduceOp.SUM, group)
        exp = x.exp_()
        sum_exp = exp.sum(-1)
        _all_reduce(sum_exp, dist.ReduceOp.SUM, group)
        # not in place: torch 2.11's dynamo loses the gradient through an autograd.Function
        # that mutates its own output (slapo/op/linear_ce.py)
        loss = (sum_exp.log() - target).masked_fill(~valid, 0.0)
        exp.div_(sum_exp[:, None])  # local slice of the softmax
        ctx.save_for_backward(exp, idx, mine, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        softmax, idx, mine, valid = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(1, idx[:, None], -mine.to(g.dtype)[:, None])
        g.mul_(grad_loss.to(g.dtype).masked_fill(~valid, 0.0)[:, None])
        return g.to(ctx.dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    labels: torch.Tensor,
    group=None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy from this rank's logit columns (..., V/p) and the global labels (...).

    Every rank gets the same loss. The gradient w.r.t. the local logits is the local slice of
    softmax - onehot. `reduction`: "mean" over non-ignored labels, "sum" or "none".
    """
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"vocab_parallel_cross_entropy: logits {tuple(local_logits.shape)} and labels "
            f"{tuple(labels.shape)} must agree on all but the last dim"
        )
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: unknown reduction {reduction!r}")
    world, rank = _world(group)
    start = rank * local_logits.shape[-1]
    flat = local_logits.reshape(-1, local_logits.shape[-1])
    loss = _VocabParallelCrossEntropy.apply(flat, labels.reshape(-1), start, ignore_index, group)
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum().clamp_min(1)


class VocabParallelLMHead(nn.Module):
    """Column-parallel LM head: local logits (..., V/p) = hidden @ W_local^T.

    Feed its output to `vocab_parallel_cross_entropy`. The input gradient is all-reduced over the
    group in backward (every rank's shard contributes), so `hidden` stays replicated.
    """

    def __init__(self, hidden: int, vocab: int, group=None, weight: torch.Tensor | None = None):
        super().__init__()
        self.group = group
        self.start, self.end = vocab_range(vocab, group)
        if weight is None:
            w = torch.empty(self.end - self.start, hidden)
            nn.init.normal_(w, std=hidden**-0.5)
        elif weight.shape == (vocab, hidden):
            w = weight.detach()[self.start : self.end].clone()
        else:
            raise ValueError(f"VocabParallelLMHead: weight must be ({vocab}, {hidden})")
        self.weight = nn.Parameter(w)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_group(hidden, self.group), self.weight)
