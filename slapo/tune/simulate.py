"""Simulation mode: plan GPT training on a hypothetical cluster from device constants alone.

For every (tp, pp, cp, dp, micro-batch, ZeRO stage, cp attention) the per-layer costs come from
the traced block model (`slapo.tune.cost.block_cost` on a meta-device `GPT2Block`, bf16, SDPA
without dropout, i.e. flash-style attention), pipeline partition and checkpoint counts come from
the MILP planner, and the step time is::

    (G - 1) * max_i T_i + sum_i T_i + DP gradient sync + optimizer step

with T_i the per-micro-batch time of stage i (roofline compute of its layers, recompute of its
checkpointed layers, TP all-reduces, context-parallel attention traffic, pipeline p2p). Nothing
overlaps (communication is serial with compute), which penalises ZeRO-3, large DP degrees and the
cp ring the most; see docs/tune.md for what else is ignored. Run `python -m slapo.tune.simulate`
to print plans.

Context parallelism (cp) follows Slapo's runtime (`slapo/op/context_parallel.py`): each cp rank
holds 1/cp of every sequence (zig-zag chunks, so causal attention work is balanced), parameters
are replicated over cp (gradients averaged and ZeRO shards over dp x cp), and one of three
exchanges makes attention exact across the cp ranks (`CP_ATTENTION`; `cp_attention_messages`
and `cp_attention_memory` give their bytes).

Mixture-of-experts models (`MoESpec`, `MOE_MODELS`) add expert parallelism (ep), as Slapo's
runtime builds it (`slapo/op/moe.py`, docs/runtime.md "Which ranks ep borrows"): ep borrows
data-parallel ranks (dp = dp_rest x ep), each ep rank holds E/ep experts of every layer, and
tokens travel to and from their top-k experts by all-to-all (`ExpertShard`, `moe_messages`).
The attention share of a layer is the traced block's; the expert FFN is analytic. DeepSeek-V3
(`MLAMoESpec`) has analytic MLA in place of the traced share, a tp-split shared expert and
dense first layers (`simulate_moe.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from .memory import model_state_bytes, pipeline_inflight
from .planner import plan_pipeline
from .simulate_moe import (  # noqa: F401 (re-exported: the tests and callers' names)
    GPT_MODELS,
    MLA,
    MOE_MODELS,
    FFNShard,
    GPTSpec,
    MLALayerModel,
    MLAMoESpec,
    MoESpec,
)
from .simulate_parallel import (  # noqa: F401 (re-exported: the tests and callers' names)
    CP_ATTENTION,
    AttnShard,
    ExpertShard,
    Message,
    attn_shard,
    cp_attention_memory,
    cp_attention_messages,
    expert_shard,
    message_time,
    moe_messages,
    sent_bytes,
)
from .timing import AlphaBeta, DeviceConstants, collective_time, roofline_time

MODELS: dict[str, GPTSpec] = {**GPT_MODELS, **MOE_MODELS}

# Datasheet numbers scaled to what training kernels typically reach (GEMM ~70% of dense peak,
# copies ~80% of HBM bandwidth); links are effective ring bus bandwidths.
DEVICES = {
    "h100": DeviceConstants("H100-SXM-80GB", peak_flops=0.7 * 989e12, mem_bandwidth=0.8 * 3.35e12,
                            memory_bytes=80e9, intra=AlphaBeta(10e-6, 1 / 360e9),
                            inter=AlphaBeta(20e-6, 1 / 40e9), gpus_per_node=8),
    "a100-40gb": DeviceConstants("A100-40GB", peak_flops=0.7 * 312e12, mem_bandwidth=0.8 * 1.555e12,
                                 memory_bytes=40e9, intra=AlphaBeta(10e-6, 1 / 200e9),
                                 inter=AlphaBeta(20e-6, 1 / 20e9), gpus_per_node=8),
    "l4": DeviceConstants("L4-24GB", peak_flops=0.7 * 121e12, mem_bandwidth=0.8 * 300e9,
                          memory_bytes=24e9, intra=AlphaBeta(15e-6, 1 / 12e9),
                          inter=AlphaBeta(30e-6, 1 / 6e9), gpus_per_node=8),
}


@dataclass
class SimPlan:
    model: str
    gpus: int
    dp: int
    tp: int
    pp: int
    micro_batch: int
    num_microbatches: int
    zero: int
    layers: list[int]
    ckpt: list[int]
    step_time: float
    stage_memory: list[float]
    samples_per_s: float
    mfu: float
    breakdown: dict = field(default_factory=dict)
    cp: int = 1
    cp_attention: str | None = None  # one of CP_ATTENTION when cp > 1
    seq: int = 2048
    ep: int = 1  # expert-parallel ranks, borrowed from dp (dp = dp_rest x ep)
    experts: int = 0  # experts per layer; 0: a dense model

    def row(self) -> str:
        mem = max(self.stage_memory) / 1e9
        cp = f"cp{self.cp}" + (f" {self.cp_attention}" if self.cp > 1 else "")
        cp += f" ep{self.ep}" if self.experts else ""
        rate = self.samples_per_s
        rate_s = f"{rate:.1f}" if rate >= 1 else f"{rate:.3f}"  # long contexts: < 1 sample/s
        return (f"{self.model:9s} {self.gpus:3d}  seq{self.seq}  dp{self.dp:<2d} tp{self.tp} "
                f"pp{self.pp} {cp}  mb{self.micro_batch:<2d} G{self.num_microbatches:<3d} "
                f"zero{self.zero}  "
                f"layers={self.layers} ckpt={self.ckpt}  step={self.step_time:.2f}s "
                f"{rate_s} samples/s  MFU~{self.mfu:.0%}  peak {mem:.1f} GB")


_ATTENTION_ONLY_INNER = 8  # the MLP width traced for an MoESpec's attention share (divides tp <= 8)


class LayerModel:
    """Per-layer costs of one GPT block (per tp and cp rank), as numpy functions of (batch, tp,
    seq, cp). The block's shape (hidden, heads) is fixed; seq is a free variable of the fit, so
    one model serves every sequence length.

    For an `MoESpec` (`attention_only`) it is the layer's attention share: the GPT-2 block
    traced with an MLP 8 features wide in place of its 4H one (attention, both norms, both
    residual adds); what the 8-wide MLP costs stays in, < 1% of this share's FLOPs, bytes and
    saved bytes at H = 2048. The experts are `ExpertShard`'s.
    """

    def __init__(self, spec: GPTSpec):
        import sympy
        import torch
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        from .cost import CKPT, SEQ, block_cost

        self.attention_only = isinstance(spec, MoESpec)
        cfg = GPT2Config(n_embd=spec.hidden, n_head=spec.heads, n_layer=1, vocab_size=spec.vocab,
                         n_positions=spec.seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0,
                         n_inner=_ATTENTION_ONLY_INNER if self.attention_only else None)
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            block = GPT2Block(cfg).train()
        base = 256 if spec.seq % 256 == 0 else spec.seq
        ex = (torch.empty(2, base, spec.hidden, dtype=torch.bfloat16, device="meta", requires_grad=True),)
        self.cost = block_cost(block, ex, tp=True, backward=True, dtype=torch.bfloat16)
        self.spec = spec
        c = self.cost
        exprs = dict(c.exprs, saved=c.saved(include_inputs=True).subs(CKPT, 0))
        self.f = {k: c.lambdify(f"{k}_all", e) for k, e in exprs.items()}
        # coefficient of seq**2: the query x key (attention) part of each cost
        self.quad = {k: c.lambdify(f"{k}_seq2", sympy.diff(e, SEQ, 2) / 2) for k, e in exprs.items()}

    def __call__(self, name: str, batch: int, tp: int, seq: int | None = None, cp: int = 1) -> float:
        """Cost `name` of one micro-batch of `batch` sequences of `seq` tokens on one (tp, cp) rank.

        A cp rank holds seq/cp tokens, so per-token terms are evaluated at seq/cp; the terms
        quadratic in seq are queries x keys (attention scores), and a cp rank's seq/cp queries
        meet all seq keys: 1/cp of the whole sequence's, the zig-zag split balancing the causal
        part across ranks. (The trace counts SDPA's full s x s FLOPs, without causal halving.)
        """
        s = self.spec.seq if seq is None else seq
        local = self.f[name](batch, s / cp, tp, 0)
        attention_rest = self.quad[name](batch, s, tp, 0) * s * s * (1 / cp - 1 / cp**2)
        return float(local + attention_rest)

    def rank_params(self, tp: int) -> float:
        """The block's (the attention share's) parameters on a tp rank; norms and row biases
        replicated."""
        h = self.spec.hidden
        return ((4 * h * h + 4 * h) if self.attention_only else (12 * h * h + 13 * h)) / tp + 4 * h

    def all_reduces(self, batch: int, seq: int | None = None, cp: int = 1) -> tuple[list[float], list[float]]:
        """Payload bytes of the tp all-reduces, (forward, backward): Megatron's attention and
        MLP ones (b x s/cp x H x 2 each), the attention's alone in an MoE layer's share."""
        act = batch * (self.spec.seq if seq is None else seq) // cp * self.spec.hidden * 2
        n = 1 if self.attention_only else 2
        return [act] * n, [act] * n


def layer_model_for(spec: GPTSpec) -> LayerModel | MLALayerModel:
    """The per-layer model of `spec`: analytic MLA for an `MLAMoESpec`, else the traced block."""
    return MLALayerModel(spec) if isinstance(spec, MLAMoESpec) else LayerModel(spec)


def _link(group_span: int, dev: DeviceConstants) -> AlphaBeta:
    return dev.intra if group_span <= dev.gpus_per_node else dev.inter


@dataclass
class _Layout:
    """Costs of one (tp, pp, cp, dp, micro-batch, ZeRO, cp attention, ep) layout; `stage_cost`
    feeds the planner.

    Rank layout: tp innermost (within a node), then cp (torchtitan's place for it, next to tp,
    so the per-layer attention exchanges stay on fast links when tp * cp fits a node), then dp,
    then pp. Parameters are replicated over cp: gradients sync, and ZeRO shards, over the
    dp x cp `replicas`. ep borrows dp: an ep group is `ep` consecutive dp ranks of one stage
    (span tp x cp x ep), and the experts (E/ep per rank) are replicated, synced and ZeRO-sharded
    over the dp_rest x cp `expert_replicas` only; the rest of the model over all `replicas`.

    Layers are of two kinds: the spec's own (a GPT block; an MoE layer: attention share, routed
    experts, shared expert), with `t_layer`, `t_recompute`, `saved`, `layer_params` and
    `expert_layer_params`, and an `MoESpec`'s first `dense_layers` (attention share and a dense
    MLP), with the `dense_` ones. Stage 0 holds every dense layer (a stage 0 with fewer layers
    is refused; with pp <= 8 and the planner's layer window it never arises for DeepSeek-V3's
    3 of 61), and a stage checkpoints first the kind that frees more bytes per second of
    recompute.
    """

    spec: GPTSpec
    dev: DeviceConstants
    lm: LayerModel
    tp: int
    pp: int
    dp: int
    b: int
    g: int
    zero: int
    cp: int = 1
    cp_attention: str | None = None
    ep: int = 1

    @property
    def replicas(self) -> int:
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """dp_rest x cp: the ranks holding the same experts."""
        return self.dp // self.ep * self.cp

    def __post_init__(self) -> None:
        spec, dev, lm, tp, cp, b = self.spec, self.dev, self.lm, self.tp, self.cp, self.b
        h, s, v = spec.hidden, spec.seq, spec.vocab
        s_local = s // cp
        self.moe = isinstance(spec, MoESpec)
        self.dense_layers = spec.dense_layers if self.moe else 0
        t_f = float(roofline_time(lm("fwd_flops", b, tp, s, cp), lm("fwd_bytes", b, tp, s, cp), dev))
        t_b = float(roofline_time(lm("bwd_flops", b, tp, s, cp), lm("bwd_bytes", b, tp, s, cp), dev))
        act_bytes = b * s_local * h * 2

        def all_reduces(payloads: list[float]) -> float:
            return sum(float(collective_time("all_reduce", x, tp, _link(tp, dev))) for x in payloads)

        # Megatron: a dense block all-reduces after attention and MLP, forward and backward; an
        # MoE layer's share after attention only (the routed experts run whole on every tp rank)
        ar_f, ar_b = lm.all_reduces(b, s, cp)
        t_cp_f, t_cp_b, cp_saved, cp_transient = self._cp_attention()
        self.t_cp = t_cp_f + t_cp_b
        a_f, a_b = t_f + all_reduces(ar_f) + t_cp_f, t_b + all_reduces(ar_b) + t_cp_b
        a_saved = lm("saved", b, tp, s, cp) + cp_saved
        t_e_f, t_e_b, e_saved, e_transient = self._experts()
        sh_f, sh_b, sh_saved = self._ffn(spec.shared_intermediate if self.moe else 0)
        self.t_layer = a_f + a_b + t_e_f + t_e_b + sh_f + sh_b
        self.t_recompute = a_f + t_e_f + sh_f
        self.saved = a_saved + e_saved + sh_saved
        self.transient = max(cp_transient, e_transient)  # at different times of the layer
        d_f, d_b, d_saved = self._ffn(spec.dense_intermediate if self.dense_layers else 0)
        self.t_dense, self.t_dense_recompute = a_f + a_b + d_f + d_b, a_f + d_f
        self.dense_saved, self.dense_transient = a_saved + d_saved, cp_transient
        self.inp = lm("input_bytes", b, tp, s, cp)
        # Head + loss (analytic): logits GEMM fwd + 2x bwd, fp32 softmax traffic, saved logits.
        tokens = b * s_local
        self.t_head = float(roofline_time(3 * 2 * tokens * h * v / tp, 3 * 4 * tokens * v / tp, dev))
        self.head_saved = 6 * b * s_local * v / tp
        span = tp * self.replicas * 2
        self.p2p = float(collective_time("p2p", act_bytes, 2, _link(span, dev))) if self.pp > 1 else 0.0
        self.layer_params = lm.rank_params(tp)  # a GPT block; the attention share of an MoE layer
        self.dense_layer_params = self.expert_layer_params = 0.0
        if self.moe:  # + router (replicated), shared expert (1/tp); the experts are apart
            self.dense_layer_params = self.layer_params + 3 * h * spec.dense_intermediate / tp
            self.layer_params += h * spec.experts + spec.shared_layer_params / tp
            self.expert_layer_params = float(expert_shard(spec, b, cp, self.ep).local_params)

    def _cp_attention(self) -> tuple[float, float, float, float]:
        """(forward s, backward s, saved bytes, transient bytes) of one layer's cp exchange."""
        if self.cp == 1:
            return 0.0, 0.0, 0.0, 0.0
        a = attn_shard(self.spec, self.b, self.tp, self.cp)
        msgs = cp_attention_messages(self.cp_attention, a)
        link = _link(self.tp * self.cp, self.dev)
        t = {k: sum(message_time(m, self.cp, link) for m in ms) for k, ms in msgs.items()}
        return (t["fwd"], t["bwd"], *cp_attention_memory(self.cp_attention, a))

    def _experts(self) -> tuple[float, float, float, float]:
        """(forward s, backward s, saved bytes, transient bytes) of one layer's experts: their
        roofline compute and their all-to-alls over the ep group (`ExpertShard`)."""
        self.t_ep = 0.0
        if not self.moe:
            return 0.0, 0.0, 0.0, 0.0
        x = expert_shard(self.spec, self.b, self.cp, self.ep)
        link = _link(self.tp * self.cp * self.ep, self.dev)
        t = {k: sum(message_time(m, self.ep, link) for m in ms) for k, ms in moe_messages(x).items()}
        self.t_ep = t["fwd"] + t["bwd"]
        t_f = float(roofline_time(x.fwd_flops, x.fwd_bytes, self.dev)) + t["fwd"]
        t_b = float(roofline_time(x.bwd_flops, x.bwd_bytes, self.dev)) + t["bwd"]
        return t_f, t_b, x.saved, x.transient

    def _ffn(self, width: int) -> tuple[float, float, float]:
        """(forward s, backward s, saved bytes) of a tp-split SwiGLU of `width` (`FFNShard`),
        its output and input-gradient all-reduces included; zeros when width is 0."""
        if not width:
            return 0.0, 0.0, 0.0
        x = FFNShard(self.b * self.spec.seq // self.cp, self.spec.hidden, width, self.tp)
        t_ar = float(collective_time("all_reduce", x.all_reduce_bytes, self.tp, _link(self.tp, self.dev)))
        return (float(roofline_time(x.fwd_flops, x.fwd_bytes, self.dev)) + t_ar,
                float(roofline_time(x.bwd_flops, x.bwd_bytes, self.dev)) + t_ar, x.saved)

    def stage_kinds(self, i: int, j: int) -> tuple[int, int] | None:
        """(dense, other) layers of stage i with j layers; None when stage 0 cannot hold the
        dense layers."""
        d = self.dense_layers if i == 0 else 0
        return None if j < d else (d, j - d)

    def _kinds(self, i: int, j: int) -> tuple[int, int]:
        kinds = self.stage_kinds(i, j)
        if kinds is None:
            raise ValueError(f"stage 0 must hold the {self.dense_layers} dense layers, not {j}.")
        return kinds

    def ckpt_kinds(self, d: int, m: int, c: int) -> tuple[int, int]:
        """(dense, other) of c checkpointed layers among d dense and m other ones: first the
        kind whose checkpointing frees more bytes per second of recompute."""
        dense_first = d and ((self.dense_saved - self.inp) * self.t_recompute
                             > (self.saved - self.inp) * self.t_dense_recompute)
        cd = min(c, d) if dense_first else max(0, c - m)
        return cd, c - cd

    def stage_params(self, i: int, j: int) -> float:
        """Parameters of stage i with j layers on one rank, the experts excepted."""
        h, s, v = self.spec.hidden, self.spec.seq, self.spec.vocab
        d, m = self._kinds(i, j)
        p = m * self.layer_params + d * self.dense_layer_params
        if i == 0:
            p += v * h / self.tp + (0 if self.moe else s * h)  # MoE specs: rotary, no position table
        if i == self.pp - 1:
            p += v * h / self.tp + 2 * h  # Megatron's copy of the tied embedding; an MoE spec's head
        return p

    def stage_expert_params(self, i: int, j: int) -> float:
        """Expert parameters of stage i with j layers on one rank: (its MoE layers) x (E/ep) x 3HI."""
        return self._kinds(i, j)[1] * self.expert_layer_params

    def stage_cost(self, i: int, j: int, c: int) -> tuple[float, float]:
        kinds = self.stage_kinds(i, j)
        if kinds is None:
            return math.inf, math.inf
        (d, m), (cd, cm) = kinds, self.ckpt_kinds(*kinds, c)
        t = m * self.t_layer + d * self.t_dense + cm * self.t_recompute + cd * self.t_dense_recompute
        t += 2 * self.p2p + (self.t_head if i == self.pp - 1 else 0.0)
        replica_link = _link(self.tp * self.replicas, self.dev)
        if self.zero == 3:  # gather the stage's weights for forward and backward of every micro-batch
            t += 2 * float(collective_time("all_gather", self.stage_params(i, j) * 2, self.replicas,
                                           replica_link))
            if self.moe:  # the experts' shards over dp_rest x cp (same span: every ep'th dp rank)
                t += 2 * float(collective_time("all_gather", self.stage_expert_params(i, j) * 2,
                                               self.expert_replicas, replica_link))
        mem = self.stage_states(i, j) + self.stage_activation(i, j, c)
        return t, float(mem)

    def stage_states(self, i: int, j: int) -> float:
        """Weights, gradients and optimizer state of stage i with j layers (ZeRO over dp x cp;
        the experts' over dp_rest x cp)."""
        states = float(model_state_bytes(self.stage_params(i, j), dp=self.replicas, zero=self.zero,
                                         param_bytes=2).total)
        if self.moe:
            states += float(model_state_bytes(self.stage_expert_params(i, j), dp=self.expert_replicas,
                                              zero=self.zero, param_bytes=2).total)
        return states

    def stage_activation(self, i: int, j: int, c: int) -> float:
        """Peak activation bytes of stage i with j layers, c of them checkpointed (1F1B, as
        `stage_peak_bytes`: the micro-batches in flight, one checkpointed layer's saved set
        re-materialised, the largest transient)."""
        d, m = self._kinds(i, j)
        cd, cm = self.ckpt_kinds(d, m, c)
        per_mb = ((m - cm) * self.saved + (d - cd) * self.dense_saved + c * self.inp
                  + (self.head_saved if i == self.pp - 1 else 0.0))
        recompute = max(self.saved if cm else 0.0, self.dense_saved if cd else 0.0)
        transient = max(self.transient, self.dense_transient if d else 0.0) + self.zero3_buffer(i, j)
        return float(pipeline_inflight(i, self.pp, self.g) * per_mb + recompute + transient)

    def zero3_buffer(self, i: int, j: int) -> float:
        """Under ZeRO-3 (FSDP) the unit running holds its whole weights (gathered) and, in
        backward, its whole gradients before their reduce-scatter: 4 B per parameter on this
        rank of the stage's largest unit (a layer with its E/ep experts, the embedding, the
        head); FSDP2's prefetch of the next unit is not counted. 0 without ZeRO-3."""
        if self.zero != 3:
            return 0.0
        d, m = self._kinds(i, j)
        h, v = self.spec.hidden, self.spec.vocab
        units = [self.layer_params + self.expert_layer_params if m else 0.0,
                 self.dense_layer_params if d else 0.0]
        units += [v * h / self.tp + (0 if self.moe else self.spec.seq * h)] if i == 0 else []
        units += [v * h / self.tp] if i == self.pp - 1 else []
        return 4.0 * max(units)

    def states_floor(self) -> float:
        """The stages' model states on average, a floor of the largest stage's peak: their sum
        is the same for every partition (linear in each stage's layers, dense ones in stage 0)."""
        js = [self.spec.layers - self.pp + 1] + [1] * (self.pp - 1)
        return sum(self.stage_states(i, j) for i, j in enumerate(js)) / self.pp

    def lower_bound(self) -> float:
        """Step time if layers split perfectly evenly with no checkpointing and no DP sync."""
        d = self.dense_layers
        work = (self.spec.layers - d) * self.t_layer + d * self.t_dense + self.t_head
        return (self.g - 1) * work / self.pp + work

    def _sync(self, params: float, replicas: int) -> tuple[float, float]:
        """(gradient sync, optimizer step) seconds of `params` replicated over `replicas`."""
        link = _link(self.tp * self.replicas, self.dev)
        op = "all_reduce" if self.zero < 2 else "reduce_scatter"
        t_dp = float(collective_time(op, params * 2, replicas, link))
        if self.zero in (1, 2):  # updated weight shards are all-gathered after the step
            t_dp += float(collective_time("all_gather", params * 2, replicas, link))
        shard = replicas if self.zero >= 1 else 1
        return t_dp, params / shard * 36 / self.dev.mem_bandwidth  # r/w master, m, v, grad, weight

    def after_pipeline(self, layers: list[int]) -> tuple[float, float]:
        """(gradient sync, optimizer step) seconds of the largest stage: over dp x cp, and for
        the experts over dp_rest x cp."""
        per_stage = []
        for i, j in enumerate(layers):
            t_dp, t_opt = self._sync(self.stage_params(i, j), self.replicas)
            if self.moe:
                e_dp, e_opt = self._sync(self.stage_expert_params(i, j), self.expert_replicas)
                t_dp, t_opt = t_dp + e_dp, t_opt + e_opt
            per_stage.append((t_dp, t_opt))
        return max(t for t, _ in per_stage), max(o for _, o in per_stage)


def _layouts(spec: GPTSpec, gpus: int, global_batch: int, device: DeviceConstants, lm: LayerModel,
             grid: dict[str, tuple]) -> list[_Layout]:
    """Every layout of the grid that divides the cluster, the batch, the heads and the sequence;
    for an `MoESpec` with each ep of the grid that divides dp and the experts (with any cp:
    the cp ranks hold the same experts); dense specs keep ep = 1."""
    out = []
    eps = grid["eps"] if isinstance(spec, MoESpec) else (1,)
    axes = (grid[k] for k in ("tps", "pps", "cps", "mbs", "zeros"))
    for tp, pp, cp, b, zero in itertools.product(*axes):
        if gpus % (tp * pp * cp) or tp > device.gpus_per_node or pp > spec.layers or spec.heads % tp:
            continue
        if spec.seq % (2 * cp):  # the zig-zag split needs 2cp equal chunks
            continue
        dp = gpus // (tp * pp * cp)
        if global_batch % (dp * b) or (zero > 0 and dp * cp == 1):  # ZeRO without replicas is ZeRO-0
            continue
        for mode in grid["modes"] if cp > 1 else (None,):
            if mode == "ulysses" and (spec.heads // tp) % cp:
                continue
            g = global_batch // (dp * b)
            for ep in eps:
                if ep == 1 or (dp % ep == 0 and spec.experts % ep == 0):
                    out.append(_Layout(spec, device, lm, tp, pp, dp, b, g, zero, cp, mode, ep))
    return out


def simulate(spec: GPTSpec, gpus: int, global_batch: int, device: DeviceConstants,
             layer_model: LayerModel | MLALayerModel | None = None, tps: tuple[int, ...] = (1, 2, 4, 8),
             pps: tuple[int, ...] = (1, 2, 4, 8), micro_batches: tuple[int, ...] = (1, 2, 4, 8),
             zeros: tuple[int, ...] = (0, 1, 2, 3), mem_fraction: float = 0.9,
             workspace_bytes: float = 2e9, top: int = 5, cps: tuple[int, ...] = (1, 2, 4, 8),
             cp_attentions: tuple[str, ...] = CP_ATTENTION,
             eps: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)) -> list[SimPlan]:
    """Best `top` plans for `spec` (at `spec.seq` tokens per sample) on `gpus` devices, fastest
    first.

    Layout: tp innermost (within a node), then cp, then dp, then pp (`_Layout`); cp x tp x pp
    x dp = gpus, and cp > 1 is tried with each of `cp_attentions`. An `MoESpec` is tried with
    each ep of `eps` dividing dp and its experts (ep borrows dp ranks: dp = dp_rest x ep; with
    any cp); a dense spec with ep = 1 whatever `eps` says. `mem_fraction` of device
    memory minus `workspace_bytes` (allocator, kernels' workspaces, transient peaks) is the cap.
    Layouts are visited in order of a lower bound on their step time and skipped once the bound
    exceeds the `top`-th best plan found, so most MILPs are never built. `layer_model` may come
    from a spec of another seq (the block's costs are functions of seq), not of another shape.
    """
    if gpus < 1 or global_batch < 1:
        raise ValueError(f"need gpus >= 1 and global_batch >= 1, got {gpus}, {global_batch}.")
    bad = [m for m in cp_attentions if m not in CP_ATTENTION]
    if bad:
        raise ValueError(f"cp attention {bad} unknown; use some of {CP_ATTENTION}.")
    if not eps or any(int(e) != e or e < 1 for e in eps):
        raise ValueError(f"ep degrees must be positive integers, got {eps!r}.")
    lm = layer_model or layer_model_for(spec)
    if ((lm.spec.hidden, lm.spec.heads, lm.spec.vocab) != (spec.hidden, spec.heads, spec.vocab)
            or lm.attention_only != isinstance(spec, MoESpec)
            or getattr(lm.spec, "mla", None) != getattr(spec, "mla", None)):
        kind = ("an MLA layer's attention share" if isinstance(lm, MLALayerModel) else
                "an MoE layer's attention share" if lm.attention_only else "a dense block")
        raise ValueError(f"layer_model was built for {lm.spec.name} (hidden {lm.spec.hidden}, "
                         f"heads {lm.spec.heads}, {kind}), not {spec.name}'s shape.")
    cap = device.memory_bytes * mem_fraction - workspace_bytes
    L = spec.layers
    grid = dict(tps=tps, pps=pps, cps=cps, mbs=micro_batches, zeros=zeros, modes=cp_attentions,
                eps=eps)
    layouts = sorted(_layouts(spec, gpus, global_batch, device, lm, grid), key=lambda x: x.lower_bound())
    plans: list[SimPlan] = []
    model_flops = spec.model_flops_per_token * global_batch * spec.seq
    experts = spec.experts if isinstance(spec, MoESpec) else 0
    for lay in layouts:
        if len(plans) >= top and lay.lower_bound() >= plans[top - 1].step_time:
            break
        if lay.states_floor() > cap:  # no partition fits: skip the MILP's options
            continue
        window = (max(1, L // lay.pp - 3), L // lay.pp + 3) if lay.pp > 1 else None
        plan = plan_pipeline(lay.stage_cost, L, lay.pp, lay.g, cap, layer_range=window, max_options=12)
        if plan is None:
            continue
        t_dp, t_opt = lay.after_pipeline(plan.layers)
        step = plan.objective + t_dp + t_opt
        mfu = model_flops / step / (gpus * device.peak_flops / 0.7)
        breakdown = {"pipeline": plan.objective, "dp_sync": t_dp, "optimizer": t_opt,
                     "cp_per_layer": lay.t_cp}  # one layer, one micro-batch, fwd + bwd
        if experts:
            breakdown["ep_per_layer"] = lay.t_ep  # the all-to-alls likewise
        plans.append(SimPlan(spec.name, gpus, lay.dp, lay.tp, lay.pp, lay.b, lay.g, lay.zero,
                             plan.layers, plan.ckpt, step, plan.stage_memory, global_batch / step, mfu,
                             breakdown, lay.cp, lay.cp_attention, spec.seq, lay.ep, experts))
        plans.sort(key=lambda p: p.step_time)
    return plans[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plan GPT training from device constants (no GPU needed).")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES))
    ap.add_argument("--models", default="gpt-1.3b,gpt-2.7b,gpt-7b",
                    help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--gpus", default="8,16,32,64")
    ap.add_argument("--samples-per-gpu", type=int, default=16,
                    help="global batch = this x GPUs (Mist's artifact uses 16 samples per GPU)")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sample (default: the model's, 2048 for GPTs, 4096 for the MoE "
                         "models); long contexts bring in cp")
    ap.add_argument("--cp", default="1,2,4,8", help="context-parallel degrees to try")
    ap.add_argument("--cp-attention", default=",".join(CP_ATTENTION),
                    help=f"cp attention exchanges to try with cp > 1 (of {', '.join(CP_ATTENTION)})")
    ap.add_argument("--ep", default="1,2,4,8,16,32,64",
                    help="expert-parallel degrees to try for MoE models (borrowed from dp; dense "
                         "models keep ep 1)")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args(argv)
    cps = tuple(int(x) for x in args.cp.split(","))
    modes = tuple(args.cp_attention.split(","))
    eps = tuple(int(x) for x in args.ep.split(","))
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {', '.join(unknown)}; use some of {', '.join(MODELS)}")
    dev = DEVICES[args.device]
    print(f"device: {dev.name}  peak {dev.peak_flops / 1e12:.0f} TFLOP/s achievable, "
          f"HBM {dev.mem_bandwidth / 1e12:.2f} TB/s, {dev.memory_bytes / 1e9:.0f} GB")
    for name in args.models.split(","):
        spec = dataclasses.replace(MODELS[name], seq=args.seq or MODELS[name].seq)
        lm = layer_model_for(spec)
        for n in (int(x) for x in args.gpus.split(",")):
            plans = simulate(spec, n, args.samples_per_gpu * n, dev, lm, top=args.top, cps=cps,
                             cp_attentions=modes, eps=eps)
            if not plans:
                print(f"{name:9s} {n:3d}  seq{spec.seq}  no plan fits")
            for p in plans:
                print(p.row())


if __name__ == "__main__":
    main()
