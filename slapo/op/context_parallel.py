"""The context-parallel attention core: this rank's queries (its chunks of every sequence)
against the keys of the whole sequence, which the cp ranks hold between them.

Under context parallelism each cp rank holds 1/cp of every sequence from the embedding to the
loss (`runtime/context_parallel.py` splits the batch, zig-zag); everything but attention is
per token, so only the attention core changes. `model_schedule.apply` installs this core in
every attention module (`use_attention_core`) on a mesh with cp > 1, so the model's own
projections, RoPE (applied per chunk from the global `position_ids` the cp batch carries) and
parameters stay as they are. Two exact ways across ranks (the `cp_attention` knob):

- "allgather": K/V all-gathered along the sequence (autograd-aware: the backward
  reduce-scatters dK/dV, each rank keeping its own positions' sum over every rank's queries),
  then SDPA of the local queries against all keys. Llama 3's choice for GQA models: the bytes
  are the KV heads', fewer than the queries'.
- "ring": `op/ring_attention.py` (K/V blocks passed rank to rank, log-sum-exp merge; K/V memory
  stays 1/cp).
- "ulysses": DeepSpeed-Ulysses' all-to-all of sequence <-> heads: each rank sends every other
  rank its chunks of that rank's 1/cp of the heads, attends its heads over the whole sequence
  (one SDPA call, no merge), and the reverse all-to-all brings each rank its tokens' outputs
  of every head: 4 all-to-alls per layer, each rank sending (cp-1)/cp of its q, k, v and
  output (the ring sends its K/V cp-1 times; neither is measured on a GPU yet). The (local)
  query heads must divide by cp, and K/V heads that do not (GQA with few KV heads) are
  repeated to the query heads first.

The mask is built here from the tokens' indices in the whole sequence, never from the mask
HF computed (HF builds it for the local chunk's length): every rank's indices follow from the
split rule (`zigzag_index`), so the core needs no `position_ids` (a model's positions may be
offset, as RoBERTa's are); causal or not as HF's SDPA decides (the call's `is_causal`, else the
module's: BERT's is False); within HF's sliding window when the layer passes one (`q - k <
window`, Mistral, Qwen2/3's sliding layers); and only real keys: the cp batch's key flags of
every rank (`KEY_VALID`: the padding the split adds, and the batch's attention mask). Those
flags come with every cp batch (the step splits the whole batch on every rank), so no layer
communicates for its mask (only K/V cross the ranks), and a call without them (the model run
outside `train_step`, on an unsplit batch) is refused. A query that sees no key gets zeros
(SDPA's definition of a fully masked row). A packed batch (`--sft pack`) also carries every
rank's tokens' documents (`KEY_DOC`): a query sees only its own document's keys. Dropout on attention probabilities, soft-capping
and attention sinks are refused at the first call.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.all_to_all import all_to_all
from ..distributed.collectives import all_gather
from .attention import SDPAttention
from .attention_core import UNCOMPUTED, AttentionCore
from .ring_attention import ring_attention, visible

CP_ATTENTION = ("allgather", "ring", "ulysses")
# the cp batch's real-key flags of every cp rank's chunks, (b, cp, s_local) by rank, when it had
# an attention mask (batch-first, so accumulation slices split it with the rest)
KEY_VALID = "cp_key_valid"
# packed documents: every cp rank's tokens' document ids, (b, cp, s_local) by rank; a query sees
# only keys of its own document (HF's block-diagonal mask of a packed row)
KEY_DOC = "cp_key_doc"


def zigzag_index(seq: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (in a sequence of length `seq`, a multiple of `2 * cp`) that cp rank `rank`
    holds: chunks `rank` and `2cp - 1 - rank` (`runtime/context_parallel.py`)."""
    c = seq // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c),
                      torch.arange(late * c, (late + 1) * c)])


@functools.lru_cache(maxsize=64)
def _rank_positions(s: int, cp: int, device: torch.device) -> torch.Tensor:
    """(cp, s) every cp rank's positions, made once per (length, cp, device): every attention
    layer of every step asks for it, and building it on the host and copying it to the device
    each time put a host-to-device copy per layer in the step."""
    return torch.stack([zigzag_index(s * cp, cp, r) for r in range(cp)]).to(device)


def key_positions(b: int, s: int, group, device: torch.device) -> torch.Tensor:
    """(cp, b, s): every cp rank's token positions, by rank, from the split rule (each rank
    holds `s` tokens of every sequence of length `s * cp`)."""
    cp = dist.get_world_size(group)
    return _rank_positions(s, cp, torch.device(device))[:, None, :].expand(cp, b, s)


class ContextParallelAttention(AttentionCore):
    """HF's attention-interface call on this rank's sequence chunks, exact across the cp
    ranks of `group` by `mode` ("allgather" or "ring"; module docstring)."""

    def __init__(self, group, mode: str = "allgather"):
        super().__init__()
        if mode not in CP_ATTENTION:
            raise ValueError(f"cp attention mode {mode!r}: use one of {CP_ATTENTION}")
        self.group, self.mode = group, mode
        self._sdpa = SDPAttention(use_flash=False)

    def __deepcopy__(self, memo: dict) -> ContextParallelAttention:
        """A copy shares the process group (a group cannot be copied)."""
        twin = ContextParallelAttention(self.group, self.mode)
        twin.train(self.training)
        memo[id(self)] = twin
        return twin

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                scaling: float | None = None, is_causal: bool | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, None]:
        self._refuse(module, dropout, kwargs)
        b, s = query.shape[0], query.shape[2]
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        valid = kwargs.get(KEY_VALID)
        if not isinstance(valid, torch.Tensor) or tuple(valid.shape) != (b, cp, s):
            raise ValueError(f"{type(module).__name__}: context-parallel attention needs the "
                             f"cp batch's key flags `{KEY_VALID}` of shape (batch, cp, local "
                             f"length) = {(b, cp, s)}: train through the built model's "
                             "train_step (it splits the batch over the cp ranks), not "
                             "model(...).")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        k_pos = key_positions(b, s, self.group, query.device)  # (cp, b, s), by owning rank
        q_pos = k_pos[rank]
        k_valid = valid.transpose(0, 1)  # (cp, b, s)
        docs = kwargs.get(KEY_DOC)
        if docs is not None and (not isinstance(docs, torch.Tensor) or
                                 tuple(docs.shape) != (b, cp, s)):
            raise ValueError(f"{type(module).__name__}: the cp batch's documents `{KEY_DOC}` "
                             f"must be (batch, cp, local length) = {(b, cp, s)}.")
        k_doc = None if docs is None else docs.transpose(0, 1)  # (cp, b, s)
        # HF's SDPA rule: the call's `is_causal`, else the module's (BERT's is False)
        rule = (is_causal if is_causal is not None else getattr(module, "is_causal", True),
                kwargs.get("sliding_window"))
        if self.mode == "ring":
            out = ring_attention(query, key, value, q_pos, k_pos, k_valid, scale, self.group,
                                 *rule, k_doc=k_doc)
        elif self.mode == "ulysses":
            out = self._ulysses(module, query, key, value, k_pos, k_valid, scale, rule, k_doc)
        else:
            out = self._allgather(query, key, value, q_pos, k_pos, k_valid, scale, rule, k_doc)
        return out.transpose(1, 2).contiguous(), None

    def _allgather(self, q, k, v, q_pos, k_pos, k_valid, scale, rule, k_doc) -> torch.Tensor:
        keys = all_gather(k, 2, self.group, partial_grad=True)  # backward: reduce-scatter
        values = all_gather(v, 2, self.group, partial_grad=True)
        flat = _rank_major(k_pos)  # as gathered
        docs = {} if k_doc is None else {"q_doc": k_doc[dist.get_rank(self.group)],
                                         "k_doc": _rank_major(k_doc)}
        mask = visible(q_pos, flat, _rank_major(k_valid), *rule, **docs)
        return self._sdpa.attend(q, keys, values, mask, False, 0.0, scale)

    def _ulysses(self, module, q, k, v, k_pos, k_valid, scale, rule, k_doc) -> torch.Tensor:
        cp = dist.get_world_size(self.group)
        heads, kv_heads = q.shape[1], k.shape[1]
        if heads % cp:
            raise ValueError(f"{type(module).__name__}: Ulysses context parallelism splits the "
                             f"{heads} (local) query heads over cp={cp} ranks, which does not "
                             "divide them; use cp_attention='allgather' or 'ring'.")
        if kv_heads % cp:  # HF's repeat_kv: each KV head serves heads // kv_heads query heads
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
        q, k, v = (_seq_to_heads(t, self.group) for t in (q, k, v))
        pos = _rank_major(k_pos)  # as exchanged
        docs = {} if k_doc is None else {"q_doc": _rank_major(k_doc), "k_doc": _rank_major(k_doc)}
        mask = visible(pos, pos, _rank_major(k_valid), *rule, **docs)
        out = self._sdpa.attend(q, k, v, mask, False, 0.0, scale)
        return _heads_to_seq(out, self.group)

    def _refuse(self, module: torch.nn.Module, dropout: float, kwargs: dict) -> None:
        """What this core does not compute, refused instead of computed differently."""
        name = type(module).__name__
        if dropout and self.training:
            raise ValueError(f"{name}: attention dropout {dropout} under context parallelism "
                             "is not supported (set the config's attention_dropout to 0).")
        # what the SDPA cores refuse (soft-caps, sinks, sparse indices) and T5's position bias;
        # not every unknown tensor: HF hands the layers the whole cp batch (`shift_labels`, ...)
        for key in (*UNCOMPUTED, "position_bias"):
            if kwargs.get(key) is not None:
                raise ValueError(f"{name}: HF passed `{key}`, which context-parallel "
                                 "attention does not implement.")


def _rank_major(per_rank: torch.Tensor) -> torch.Tensor:
    """(cp, b, s) by rank -> (b, cp * s), ranks in order (how K/V are gathered)."""
    return per_rank.permute(1, 0, 2).reshape(per_rank.shape[1], -1)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(b, h, s, d) of this rank's tokens -> (b, h / cp, cp * s, d): its 1/cp of the heads
    (rank r: heads r * h / cp ...) for every rank's tokens, rank-major. Differentiable: the
    exchange is `distributed.all_to_all`'s (its backward the reverse exchange)."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, cp, h // cp, s, d).transpose(0, 1)  # [j]: rank j's heads
    recv = all_to_all(send, [1] * cp, [1] * cp, group)  # [j]: rank j's tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """The inverse: (b, h / cp, cp * s, d) -> (b, h, s, d), this rank's tokens, every head."""
    cp = dist.get_world_size(group)
    b, hc, total, d = y.shape
    send = y.reshape(b, hc, cp, total // cp, d).permute(2, 0, 1, 3, 4)  # [j]: rank j's tokens
    recv = all_to_all(send, [1] * cp, [1] * cp, group)  # [j]: this rank's tokens, j's heads
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * hc, total // cp, d)


def install(module: torch.nn.Module, group, mode: str, path: str = "") -> torch.nn.Module:
    """The twin of HF attention `module` that runs `ContextParallelAttention` (see
    `use_attention_core`)."""
    from .hf_attention import use_attention_core

    return use_attention_core(module, ContextParallelAttention(group, mode), path)


__all__ = ["CP_ATTENTION", "KEY_DOC", "KEY_VALID", "ContextParallelAttention", "install",
           "key_positions", "zigzag_index"]
