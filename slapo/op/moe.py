"""Expert parallelism: an HF experts module whose experts are spread over the ranks of an
expert-parallel (ep) group, tokens reaching them by all-to-all. Exact and dropless.

`ExpertParallelExperts` replaces the `experts` child of an HF sparse-MoE block (Mixtral's
`MixtralExperts`, Qwen3-MoE's `Qwen3MoeExperts`: `gate_up_proj` [E, 2I, H], `down_proj`
[E, H, I], `act_fn`) and keeps its call, `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`. The router stays HF's module, so routing (softmax top-k,
`norm_topk_prob`) and the router logits HF's auxiliary loss reads are HF's own.

This rank keeps experts `[r * E/ep, (r+1) * E/ep)` as HF stores them (same parameter names,
the rows of this rank), marked with an `ExpertShard` (`expert_shard(p)`). A forward:

1. sorts this rank's `T * k` (token, expert) assignments by expert (then as HF's loop takes
   them); since ranks hold contiguous expert ranges, that also sorts them by destination rank
   (`send_splits`: rows per rank);
2. dispatches the token rows, with each row's expert index local to its destination, by
   `all_to_all` (uneven splits; counts exchanged first);
3. runs each local expert on the rows each source rank sent, the same operations as HF's loop
   (`linear(gate_up)`, `act(gate) * up`, `linear(down)`) on the same rows in the same order;
   an expert with no row runs on an empty tensor, so every local parameter still gets a
   (zero) gradient, as in one process;
4. combines: the results travel back by the reverse all-to-all and are added into the output,
   times their routing weights, in ascending expert order (HF's order of summation).

Step 3 follows the experts implementation the HF module was built with
(`config._experts_implementation`): "eager" (HF's loop) runs the per-(source, expert) matmuls
above; any other (HF's default "grouped_mm", "batched_mm") runs each projection as one grouped
GEMM over all local experts' rows (`torch.nn.functional.grouped_mm` through HF's dispatcher,
which falls back where the kernel does not apply), rows sorted by local expert: one kernel
launch per projection instead of one per (source, expert), each row's result the same, the
weight gradients summed in another order. Dtypes the grouped kernel does not take (float64)
run the loop.

No capacity limit: every token reaches each of its top-k experts. Gradients: the reverse
all-to-all sends each row's gradient home, so an expert's gradient here sums the losses of
every rank of the ep group. Making that the data-parallel mean is the runtime's job
(`runtime.data_parallel`: expert parameters are not DDP's, they are all-reduced over the ranks
holding the same experts and divided by dp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.all_to_all import all_to_all, exchange_counts
from ..sharding import EXPERT_SHARD_ATTR as _SHARD_ATTR
from ..sharding import ShardSpec


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a parameter holds: rows `[first, first + count)` of `num_experts`, one of
    `ep` ranks' shares (`group`: the ep group holding the other shares)."""

    num_experts: int
    ep: int
    rank: int
    group: object = field(default=None, compare=False, repr=False)

    @property
    def count(self) -> int:
        return self.num_experts // self.ep

    @property
    def first(self) -> int:
        return self.rank * self.count


def expert_shard(p: torch.Tensor) -> ExpertShard | None:
    """The `ExpertShard` of an expert-parallel parameter, else None."""
    return getattr(p, _SHARD_ATTR, None)


def expert_shard_spec(p: torch.Tensor) -> ShardSpec | None:
    """An expert-parallel parameter (ep > 1) as the `sharding.ShardSpec` of its rows of the
    whole `[E, ...]` tensor over the ep group (dim 0, one block), else None: what the run
    checkpoint (`train.shard_layout`) and the pretrained loader read a shard's place from. Not
    stored on the tensor: a TP spec there means "reduce over the tp group" to the gradient
    norm and consolidation, which the experts are not."""
    s = expert_shard(p)
    if s is None or s.ep == 1:
        return None
    return ShardSpec((s.num_experts, *p.shape[1:]), 0, s.ep, s.rank, 1, s.group)


def send_splits(tokens_per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """Rows this rank sends to each ep rank: the assignments to that rank's contiguous range of
    experts (`tokens_per_expert`: this rank's count per global expert)."""
    return tokens_per_expert.view(ep, -1).sum(dim=1)


class ExpertParallelExperts(nn.Module):
    """This rank's `E / ep` experts of an HF experts module, tokens dispatched and combined by
    all-to-all over `group` (module docstring)."""

    def __init__(self, experts: nn.Module, group, ep: int, rank: int):
        super().__init__()
        num = experts.gate_up_proj.shape[0]
        self.shard = ExpertShard(num, ep, rank, group)
        self.num_experts, self.group, self.ep = num, group, ep
        rows = slice(self.shard.first, self.shard.first + self.shard.count)
        for name in ("gate_up_proj", "down_proj"):
            old = getattr(experts, name)
            new = nn.Parameter(old.detach()[rows].clone(), requires_grad=old.requires_grad)
            setattr(new, _SHARD_ATTR, self.shard)
            self.register_parameter(name, new)
        self.act_fn = experts.act_fn
        impl = getattr(getattr(experts, "config", None), "_experts_implementation", None)
        self.grouped = impl != "eager"  # HF's default (None) is grouped_mm too

    def extra_repr(self) -> str:
        s = self.shard
        how = "grouped GEMM" if self.grouped else "loop"
        return (f"experts {s.first}..{s.first + s.count - 1} of {s.num_experts}, ep={s.ep}, "
                f"{how}")

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        order = _by_expert(top_k_index)  # so by destination rank too
        token = order // top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        send = send_splits(torch.bincount(flat, minlength=self.num_experts), self.ep)
        recv = exchange_counts(send, self.group)
        send_l, recv_l = send.tolist(), recv.tolist()
        local_expert = flat[order] % self.shard.count  # its index on the rank that runs it
        rows = all_to_all(hidden_states[token], send_l, recv_l, self.group)
        experts = all_to_all(local_expert, send_l, recv_l, self.group)
        out_rows = all_to_all(self._run_experts(rows, experts, recv_l), recv_l, send_l,
                              self.group)
        weighted = out_rows * top_k_weights.reshape(-1)[order, None]
        out = torch.zeros_like(hidden_states)
        return out.index_add(0, token, weighted.to(out.dtype))

    def _run_experts(self, rows: torch.Tensor, experts: torch.Tensor,
                     recv: list[int]) -> torch.Tensor:
        """Each local expert on its rows from each source rank, one matmul per (source,
        expert): the rows of one source are one process's micro-batch, so the weight gradient
        sums the sources' gradients as gradient accumulation over them does. Results come
        back in `rows`' order."""
        count = self.shard.count
        if self.grouped and rows.dtype in GROUPED_DTYPES and _grouped_linear() is not None:
            return self._run_grouped(rows, experts)
        source = torch.repeat_interleave(torch.arange(len(recv), device=rows.device),
                                         torch.tensor(recv, device=rows.device))
        key = source * count + experts
        order = torch.argsort(key, stable=True)  # the identity unless a sender misrouted
        chunks = torch.bincount(key, minlength=len(recv) * count).tolist()
        outs = []
        for c, chunk in enumerate(rows[order].split(chunks)):
            gate, up = F.linear(chunk, self.gate_up_proj[c % count]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[c % count]))
        return torch.cat(outs)[torch.argsort(order)]

    def _run_grouped(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each projection as one grouped GEMM over the local experts, rows sorted by expert
        (stable, so each expert's rows keep their sources' order); results in `rows`' order."""
        linear = _grouped_linear()
        order = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=self.shard.count)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        x = rows[order].contiguous()
        gate, up = linear(x, self.gate_up_proj, offs).chunk(2, dim=-1)
        out = linear((self.act_fn(gate) * up).contiguous(), self.down_proj, offs)
        return out[torch.argsort(order)]


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def _grouped_linear():
    """`linear(x [N, in], weight [E, out, in], offs) -> [N, out]` by grouped GEMM: HF's
    dispatcher (it checks the kernel applies: alignment on CPU, torch.compile's dtypes, and
    falls back to its own op otherwise), else None (the loop runs). Looked up once."""
    try:
        from transformers.integrations.moe import _grouped_linear as hf_grouped
    except ImportError:
        return None
    return hf_grouped


def _by_expert(top_k_index: torch.Tensor) -> torch.Tensor:
    """The (token, slot) assignments (flattened `[T, k]`) sorted by expert, and within an
    expert by slot then token: the order HF's expert loop takes its rows in (`torch.where`
    over the expert's [k, T] mask), so each expert multiplies the same rows in the same order
    as HF does."""
    t, k = top_k_index.shape
    i = torch.arange(t * k, device=top_k_index.device)
    key = top_k_index.reshape(-1) * (t * k) + (i % k) * t + i // k
    return torch.argsort(key)
