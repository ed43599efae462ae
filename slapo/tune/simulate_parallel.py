"""Per-layer exchanges and memory of context and expert parallelism on one rank, for the
cluster simulator (`simulate.py`): what a cp rank's attention sends and holds for each
`cp_attention` choice, and what an ep rank's experts compute, send and hold. Byte counts follow
Slapo's runtime (`slapo/op/context_parallel.py`, `slapo/op/ring_attention.py`,
`slapo/op/moe.py`); the tests check them against hand arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .timing import AlphaBeta, collective_time

if TYPE_CHECKING:
    from .simulate_moe import GPTSpec, MoESpec


# ---- context parallelism: what one layer's attention exchanges and holds on one cp rank ----

CP_ATTENTION = ("allgather", "ring", "ulysses")  # slapo.op.context_parallel.CP_ATTENTION


@dataclass(frozen=True)
class AttnShard:
    """One cp rank's attention tensors for one layer and micro-batch on one tp rank (bf16).

    `heads` and `kv_heads` are this tp rank's; the rank holds `batch * seq / cp` tokens.
    """

    batch: int
    seq: int  # the whole sequence
    cp: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    def _bytes(self, heads: int) -> int:
        return self.batch * self.seq // self.cp * heads * self.head_dim * self.dtype_bytes

    @property
    def q(self) -> int:
        """Local queries (and the attention output: same shape)."""
        return self._bytes(self.heads)

    @property
    def kv(self) -> int:
        """Local keys (values: the same again)."""
        return self._bytes(self.kv_heads)

    @property
    def ulysses_kv(self) -> int:
        """Keys as Ulysses exchanges them: KV heads that do not divide by cp are repeated to the
        query heads first (HF's repeat_kv), so they travel query-sized."""
        return self.kv if self.kv_heads % self.cp == 0 else self.q


def attn_shard(spec: GPTSpec, batch: int, tp: int, cp: int, seq: int | None = None) -> AttnShard:
    """`AttnShard` of a GPT (multi-head: as many KV heads as query heads; an `MoESpec`'s
    `kv_heads` when given, at least one per tp rank) on a (tp, cp) rank, with the spec's
    `cp_head_dim` (H / heads; MLA's mean of its q/k and v head dims)."""
    heads = spec.heads // tp
    kv_heads = getattr(spec, "kv_heads", None)
    kv = heads if kv_heads is None else max(1, kv_heads // tp)
    return AttnShard(batch, seq or spec.seq, cp, heads, kv, spec.cp_head_dim)


Message = tuple[str, float]  # (collective, payload bytes): see cp_attention_messages


def cp_attention_messages(mode: str, a: AttnShard) -> dict[str, list[Message]]:
    """The exchanges of one layer's attention on one cp rank, {"fwd": [...], "bwd": [...]}.

    One entry per call (each pays its latency), as (collective, payload bytes) with payloads in
    `collective_time`'s convention: all-gather / reduce-scatter the whole gathered tensor (a rank
    receives (cp-1)/cp of it), all-to-all the tensor each rank holds (it sends (cp-1)/cp of it),
    p2p what is sent. Facts from slapo/op/context_parallel.py and ring_attention.py:
    allgather gathers K and V (backward: reduce-scatters dK and dV); ring passes the K/V block
    cp-1 times, and in backward K/V with their dK/dV accumulators cp-1 times plus one last pass
    of the accumulators home; ulysses does 4 all-to-alls (q, k, v to heads, output back to
    sequence) and the reverse 4 in backward.
    """
    if mode not in CP_ATTENTION:
        raise ValueError(f"cp attention {mode!r} unknown; use one of {CP_ATTENTION}.")
    cp = a.cp
    if cp == 1:
        return {"fwd": [], "bwd": []}
    if mode == "allgather":
        whole = a.kv * cp
        return {"fwd": [("all_gather", whole)] * 2, "bwd": [("reduce_scatter", whole)] * 2}
    if mode == "ring":
        return {"fwd": [("p2p", 2 * a.kv)] * (cp - 1),
                "bwd": [("p2p", 4 * a.kv)] * (cp - 1) + [("p2p", 2 * a.kv)]}
    if a.heads % cp:
        raise ValueError(f"ulysses splits the {a.heads} (per tp rank) query heads over cp={cp} "
                         "ranks, which does not divide them.")
    fwd = [("all_to_all", a.q), ("all_to_all", a.ulysses_kv), ("all_to_all", a.ulysses_kv),
           ("all_to_all", a.q)]
    return {"fwd": fwd, "bwd": list(fwd)}


def message_time(msg: Message, n: int, link: AlphaBeta) -> float:
    """Alpha-beta seconds of one exchange among `n` ranks. An all-to-all sends (n-1)/n of its
    payload pairwise: one latency plus those bytes (as the ring collectives are charged)."""
    op, nbytes = msg
    if op == "all_to_all":
        op, nbytes = "p2p", nbytes * (n - 1) / n
    return float(collective_time(op, nbytes, n, link))


def sent_bytes(msgs: list[Message], n: int) -> float:
    """Bytes one rank sends (= receives) over `msgs` among `n` ranks."""
    return sum(message_time(m, n, AlphaBeta(0.0, 1.0)) for m in msgs)


def cp_attention_memory(mode: str, a: AttnShard) -> tuple[float, float]:
    """(saved, transient) bytes one layer's cross-rank attention adds on a cp rank, on top of
    the traced block's own saved set evaluated at seq/cp (which already holds the local q, k, v,
    output and log-sum-exp that SDPA saves).

    - allgather: SDPA saves the gathered K and V of the whole sequence for backward (the local
      chunk stays saved too, with the fused qkv projection's output that q views), unless the
      layer is checkpointed; transient: the whole sequence's dK/dV before the reduce-scatter.
    - ring: saves what SDPA saves (local q, k, v, output, log-sum-exp): nothing added;
      transient: two blocks in flight, at most in backward: the dK/dV accumulators plus the
      arriving K, V, dK, dV (3 local K/V pairs).
    - ulysses: SDPA saves the exchanged q, k, v (1/cp of the heads, whole sequence) instead of
      the local ones: the same bytes, plus the growth of K/V repeated to the query heads;
      transient: the receive buffers of the q, k, v exchange.
    A flash-style kernel is assumed (no s x s scores held); the ring's reference implementation
    materialises one block's scores, which is not counted.
    """
    cp_attention_messages(mode, a)  # validates the mode and ulysses' heads
    if a.cp == 1:
        return 0.0, 0.0
    if mode == "allgather":
        whole_kv = 2 * a.kv * a.cp
        return float(whole_kv), float(whole_kv)
    if mode == "ring":
        return 0.0, float(3 * 2 * a.kv)
    return float(2 * (a.ulysses_kv - a.kv)), float(a.q + 2 * a.ulysses_kv)


# ---- expert parallelism: what one MoE layer computes, exchanges and holds on one ep rank ----


@dataclass(frozen=True)
class ExpertShard:
    """One ep rank's mixture-of-experts FFN for one layer and micro-batch (bf16), under
    **balanced routing**: every expert gets tokens x top_k / experts of each rank's rows.

    The rank holds `tokens` (batch x seq / cp; every tp rank of an ep group holds the same
    tokens and runs its experts whole: experts are not split by tp) and `experts / ep` experts.
    Dropless dispatch sends each token's top_k rows to the ranks holding those experts: a rank
    sends tokens x top_k rows and, balanced, receives as many for its own experts, so it
    computes tokens x top_k rows whatever ep is. With T = tokens, k = top_k, H = hidden,
    I = intermediate, E = experts, W = (E/ep) x 3 x H x I the rank's expert weights:

    - forward FLOPs: 2TH x E (router) + T x k x 3 x 2HI (gate, up, down GEMMs of each routed
      row); backward twice that;
    - forward bytes (the roofline's memory-bound part): the local expert weights read once
      (2W: every local expert's GEMMs read its weights, which matters at few rows per expert)
      + `elementwise`; backward: 6W (weights read for the input gradient, the weight gradient
      read and written) + twice `elementwise`;
    - saved for backward: 2 x T x k x (2H + 4I) + 4TE: per routed row the received row (the
      experts' input), gate, up, silu(gate), their product (down's input) and the row that
      comes back (the routing weight's gradient), plus the fp32 router logits;
    - transient: the receive buffers of one exchange, 2 x `routed`.
    """

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    ep: int = 1
    dtype_bytes: int = 2

    @property
    def rows(self) -> int:
        """Routed rows the rank sends, receives and computes: T x k."""
        return self.tokens * self.top_k

    @property
    def routed(self) -> int:
        """Bytes of the rank's routed rows, T x k x H x 2: what dispatch sends out (the
        all-to-all's payload; (ep-1)/ep of it leaves the rank) and combine brings back."""
        return self.rows * self.hidden * self.dtype_bytes

    @property
    def local_params(self) -> int:
        """(E/ep) x 3 x H x I."""
        return self.experts // self.ep * 3 * self.hidden * self.intermediate

    @property
    def fwd_flops(self) -> float:
        h = self.hidden
        return 2.0 * self.tokens * h * self.experts + 6.0 * self.rows * h * self.intermediate

    @property
    def bwd_flops(self) -> float:
        return 2 * self.fwd_flops

    @property
    def elementwise(self) -> float:
        """Forward activation traffic: permute (read, write the rows: 2kH per token), SwiGLU
        (silu reads and writes the gate, the product reads gate and up and writes: 5kI),
        combine (reads k rows, writes one: kH + H), all x 2 bytes; the fp32 router softmax
        (read, write) and top-k (read): 12E per token."""
        h, i, k = self.hidden, self.intermediate, self.top_k
        return float(self.tokens * (self.dtype_bytes * (k * (3 * h + 5 * i) + h) + 12 * self.experts))

    @property
    def fwd_bytes(self) -> float:
        return self.local_params * self.dtype_bytes + self.elementwise

    @property
    def bwd_bytes(self) -> float:
        return 3 * self.local_params * self.dtype_bytes + 2 * self.elementwise

    @property
    def saved(self) -> float:
        h, i = self.hidden, self.intermediate
        return float(self.rows * (2 * h + 4 * i) * self.dtype_bytes + 4 * self.tokens * self.experts)

    @property
    def transient(self) -> float:
        return float(2 * self.routed)


def expert_shard(spec: MoESpec, batch: int, cp: int, ep: int, seq: int | None = None) -> ExpertShard:
    """`ExpertShard` of an MoE GPT's layer on an ep rank holding `batch` sequences' 1/cp."""
    return ExpertShard(batch * (seq or spec.seq) // cp, spec.hidden, spec.moe_intermediate,
                       spec.experts, spec.top_k, ep)


def moe_messages(x: ExpertShard) -> dict[str, list[Message]]:
    """The exchanges of one MoE layer on one ep rank, {"fwd": [...], "bwd": [...]}, as
    `cp_attention_messages` gives them: forward the dispatch and the combine all-to-all of the
    rank's routed rows (`x.routed` each, of which each rank sends (ep-1)/ep on average under
    balanced routing: `message_time` charges one latency plus those bytes), backward the two
    reverse ones (the combine's gradient back to the experts, the experts' input gradient
    home). Uneven splits (`all_to_all_single` with per-rank counts) are charged as even."""
    if x.ep == 1:
        return {"fwd": [], "bwd": []}
    return {"fwd": [("all_to_all", x.routed)] * 2, "bwd": [("all_to_all", x.routed)] * 2}
