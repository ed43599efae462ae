"""Ring attention: exact attention of this rank's queries against every cp rank's keys, with
the K/V blocks passed rank to rank and the partial results merged by their log-sum-exp.

Why a ring: all-gathering K/V (`op/context_parallel.py`'s other choice) holds the whole
sequence's K/V on every rank at once; the ring holds two blocks (the one in use, the one
arriving), so K/V memory per rank stays 1/cp of the sequence. Each step attends the local
queries to one block; the block's softmax is normalised within the block and remembered with
its log-sum-exp `lse_b`, and `merge_partials` combines blocks exactly:
`out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)`, `lse = logaddexp(lse_a, lse_b)`
(the flash-attention / Ring Attention recurrence). The mask (causal or bidirectional, a
sliding window) comes from the *global* positions of queries and keys, so any layout of chunks
(Slapo's zig-zag) is masked right; a query that sees no key at all (a padding query under left padding) gets
zeros, as SDPA defines a fully masked row.

The backward is written out (a custom autograd Function), as in flash attention: with the
final output O and log-sum-exp L saved, each block's probabilities are recomputed,
`P = exp(S - L)`, `dV_b = P^T dO`, `dS = P * (dO V_b^T - rowsum(dO * O))`,
`dQ += dS K_b * scale`, `dK_b = dS^T Q * scale`. The K/V blocks travel the ring again, each
with its dK/dV accumulator; after `cp` passes every accumulator is back with the rank that owns
the block. GQA: blocks keep their KV heads on the wire; the gradient of a repeated head is
folded back onto its KV head.

Communication is point-to-point (`isend` to the next cp rank, `irecv` from the previous one),
and overlapped: each step posts the next block's transfer before computing on the current one
and waits for it after (the backward sends K/V ahead the same way, and the gradient
accumulators as soon as the step has added to them). Measured on CPU/gloo only (exactness);
how much it hides on a GPU is not measured yet.
`ring_steps` and `merge_partials` are module attributes so tests can break them (a skipped
step, a merge without the log-sum-exp correction) and see the equality fail.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .attention_core import repeat_kv


def ring_steps(cp: int) -> range:
    """The ring's steps: at step `s` this rank attends to the block of cp rank `rank - s`."""
    return range(cp)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, k_valid: torch.Tensor | None,
            causal: bool = True, window: int | None = None, q_doc: torch.Tensor | None = None,
            k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """Bool (b, 1, s_q, s_k), True = attend, by global positions: keys at or before the query
    (`causal`), within the last `window` positions (HF's sliding window: `q - k < window`,
    `masking_utils.sliding_window_overlay`), real (`k_valid`), and of the query's own document
    when a packed row gives them (`q_doc`, `k_doc`: HF's block-diagonal packed mask)."""
    q, k = q_pos[:, None, :, None], k_pos[:, None, None, :]
    mask = torch.ones(q.shape[0], 1, q.shape[2], k.shape[3], dtype=torch.bool, device=q.device)
    if causal:
        mask = mask & (k <= q)
    if window is not None:
        mask = mask & (q - k < window)
    if q_doc is not None:
        mask = mask & (q_doc[:, None, :, None] == k_doc[:, None, None, :])
    return mask if k_valid is None else mask & k_valid[:, None, None, :]


def _owner_mask(q_pos, k_pos, k_valid, k_doc, rank: int, owner: int, rule) -> torch.Tensor:
    """`visible` for the block `owner` holds (its positions, flags and documents)."""
    docs = {} if k_doc is None else {"q_doc": k_doc[rank], "k_doc": k_doc[owner]}
    return visible(q_pos, k_pos[owner], None if k_valid is None else k_valid[owner], *rule,
                   **docs)


def _scores(q, k, mask, scale):
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _finite(lse: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(torch.isinf(lse), torch.full_like(lse, fill), lse)


def block_attention(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` against one block, normalised within the block, and its log-sum-exp
    (b, h, s_q); a row that sees no key of the block: zeros and -inf."""
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse, 0.0)[..., None])
    return torch.matmul(p, v), lse


def merge_partials(out, lse, out_b, lse_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged exactly by their
    log-sum-exp (rows that saw no key in either stay zeros, -inf)."""
    if out is None:
        return out_b, lse_b
    new = torch.logaddexp(lse, lse_b)
    ref = _finite(new, 0.0)[..., None]
    return out * torch.exp(lse[..., None] - ref) + out_b * torch.exp(lse_b[..., None] - ref), new


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of `repeat_kv`'s output folded back onto the KV heads."""
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


Pending = tuple[list[torch.Tensor], list]  # (receive buffers, requests) of a step in flight


def start_pass(tensors: list[torch.Tensor], group, tag: int = 0) -> Pending:
    """Post the ring's step: send `tensors` to the next cp rank, receive the previous rank's
    into new buffers; `finish` waits. Computing between the two is the overlap (NCCL runs the
    transfer on its own stream; gloo in its own threads). `tag` keeps two steps in flight
    apart (the backward's K/V and its gradient accumulators)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    to = dist.get_global_rank(group, (rank + 1) % size)
    frm = dist.get_global_rank(group, (rank - 1) % size)
    tensors = [t.contiguous() for t in tensors]  # BERT's K/V are transposed views
    got = [torch.empty_like(t) for t in tensors]
    reqs = []
    for t, g in zip(tensors, got):
        reqs.append(dist.isend(t, to, group=group, tag=tag))
        reqs.append(dist.irecv(g, frm, group=group, tag=tag))
    return got, reqs


def finish(pending: Pending) -> list[torch.Tensor]:
    """The received tensors of a step `start_pass` posted, once it has completed."""
    got, reqs = pending
    for r in reqs:
        r.wait()
    return got


class RingAttention(torch.autograd.Function):
    """Ring attention forward and backward (module docstring). `q_pos` (b, s_q): the local
    queries' global positions; `k_pos` (cp, b, s_k), `k_valid` (cp, b, s_k) or None: every cp
    rank's key positions and real-key flags (gathered once, small), indexed by owner; `k_doc`
    (cp, b, s_k) or None: every rank's tokens' documents (a packed batch);
    `rule` = (causal, window): `visible`'s mask rule. Each step's transfer of the next block
    is posted before the step's compute and waited for after it (the overlap)."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, k_valid, k_doc, scale, group, rule):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        rep = q.shape[1] // k.shape[1]
        out = lse = pending = None
        steps = list(ring_steps(cp))
        blk = [k, v]
        for i, step in enumerate(steps):
            if pending is not None:
                blk = finish(pending)
            pending = start_pass(blk, group) if i + 1 < len(steps) else None
            owner = (rank - step) % cp
            mask = _owner_mask(q_pos, k_pos, k_valid, k_doc, rank, owner, rule)
            o_b, l_b = block_attention(q, repeat_kv(blk[0], rep), repeat_kv(blk[1], rep),
                                       mask, scale)
            out, lse = merge_partials(out, lse, o_b, l_b)
        ctx.save_for_backward(q, k, v, q_pos, k_pos, k_valid, k_doc, out, lse)
        ctx.scale, ctx.group, ctx.rule = scale, group, rule
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, q_pos, k_pos, k_valid, k_doc, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        kv_heads, rep = k.shape[1], q.shape[1] // k.shape[1]
        lse = _finite(lse, float("inf"))[..., None]  # a row that saw no key: P = 0
        delta = (d_out * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        steps = list(ring_steps(cp))
        # K/V travel ahead (posted before the step's compute); their gradient accumulators
        # follow once the step has added to them, the last pass bringing them home
        kv, acc, kv_next, acc_next = [k, v], [torch.zeros_like(k), torch.zeros_like(v)], None, None
        for i, step in enumerate(steps):
            if i:
                kv, acc = finish(kv_next), finish(acc_next)
            kv_next = start_pass(kv, group, tag=0) if i + 1 < len(steps) else None
            owner = (rank - step) % cp
            mask = _owner_mask(q_pos, k_pos, k_valid, k_doc, rank, owner, ctx.rule)
            k_r, v_r = repeat_kv(kv[0], rep), repeat_kv(kv[1], rep)
            p = torch.exp(_scores(q, k_r, mask, scale) - lse)
            ds = p * (torch.matmul(d_out, v_r.transpose(-1, -2)) - delta)
            dq = dq + torch.matmul(ds, k_r) * scale
            acc = [acc[0] + _fold(torch.matmul(ds.transpose(-1, -2), q) * scale, kv_heads),
                   acc[1] + _fold(torch.matmul(p.transpose(-1, -2), d_out), kv_heads)]
            acc_next = start_pass(acc, group, tag=1)
        dk, dv = finish(acc_next)  # the last pass brings each block's gradient home
        return dq, dk, dv, None, None, None, None, None, None, None


def ring_attention(q, k, v, q_pos, k_pos, k_valid, scale: float, group, causal: bool = True,
                   window: int | None = None, k_doc: torch.Tensor | None = None) -> torch.Tensor:
    """(b, h, s_q, d) attention of the local queries against every cp rank's K/V (exact),
    masked by `visible(..., causal, window)` (and by document: `k_doc`)."""
    return RingAttention.apply(q, k, v, q_pos, k_pos, k_valid, k_doc, scale, group,
                               (causal, window))
