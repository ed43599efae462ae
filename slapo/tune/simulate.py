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
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from dataclasses import dataclass, field

from .memory import model_state_bytes, stage_peak_bytes
from .planner import plan_pipeline
from .timing import AlphaBeta, DeviceConstants, collective_time, roofline_time


@dataclass(frozen=True)
class GPTSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 51200  # GPT-2's 50257 padded to a multiple of 1024 (divisible by tp)
    seq: int = 2048

    @property
    def params(self) -> float:
        return self.layers * 12 * self.hidden**2 + (self.vocab + self.seq) * self.hidden


GPT_MODELS = {
    "gpt-1.3b": GPTSpec("gpt-1.3b", 24, 2048, 16),
    "gpt-2.7b": GPTSpec("gpt-2.7b", 32, 2560, 32),
    "gpt-7b": GPTSpec("gpt-7b", 32, 4096, 32),
}

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

    def row(self) -> str:
        mem = max(self.stage_memory) / 1e9
        cp = f"cp{self.cp}" + (f" {self.cp_attention}" if self.cp > 1 else "")
        rate = self.samples_per_s
        rate_s = f"{rate:.1f}" if rate >= 1 else f"{rate:.3f}"  # long contexts: < 1 sample/s
        return (f"{self.model:9s} {self.gpus:3d}  seq{self.seq}  dp{self.dp:<2d} tp{self.tp} "
                f"pp{self.pp} {cp}  mb{self.micro_batch:<2d} G{self.num_microbatches:<3d} "
                f"zero{self.zero}  "
                f"layers={self.layers} ckpt={self.ckpt}  step={self.step_time:.2f}s "
                f"{rate_s} samples/s  MFU~{self.mfu:.0%}  peak {mem:.1f} GB")


class LayerModel:
    """Per-layer costs of one GPT block (per tp and cp rank), as numpy functions of (batch, tp,
    seq, cp). The block's shape (hidden, heads) is fixed; seq is a free variable of the fit, so
    one model serves every sequence length."""

    def __init__(self, spec: GPTSpec):
        import sympy
        import torch
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        from .cost import CKPT, SEQ, block_cost

        cfg = GPT2Config(n_embd=spec.hidden, n_head=spec.heads, n_layer=1, vocab_size=spec.vocab,
                         n_positions=spec.seq, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
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


def _link(group_span: int, dev: DeviceConstants) -> AlphaBeta:
    return dev.intra if group_span <= dev.gpus_per_node else dev.inter


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
    """`AttnShard` of a GPT (multi-head: as many KV heads as query heads) on a (tp, cp) rank."""
    heads = spec.heads // tp
    return AttnShard(batch, seq or spec.seq, cp, heads, heads, spec.hidden // spec.heads)


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


@dataclass
class _Layout:
    """Costs of one (tp, pp, cp, dp, micro-batch, ZeRO, cp attention) layout; `stage_cost`
    feeds the planner.

    Rank layout: tp innermost (within a node), then cp (torchtitan's place for it, next to tp,
    so the per-layer attention exchanges stay on fast links when tp * cp fits a node), then dp,
    then pp. Parameters are replicated over cp: gradients sync, and ZeRO shards, over the
    dp x cp `replicas`.
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

    @property
    def replicas(self) -> int:
        return self.dp * self.cp

    def __post_init__(self) -> None:
        spec, dev, lm, tp, cp, b = self.spec, self.dev, self.lm, self.tp, self.cp, self.b
        h, s, v = spec.hidden, spec.seq, spec.vocab
        s_local = s // cp
        t_f = float(roofline_time(lm("fwd_flops", b, tp, s, cp), lm("fwd_bytes", b, tp, s, cp), dev))
        t_b = float(roofline_time(lm("bwd_flops", b, tp, s, cp), lm("bwd_bytes", b, tp, s, cp), dev))
        act_bytes = b * s_local * h * 2
        t_ar = float(collective_time("all_reduce", act_bytes, tp, _link(tp, dev)))
        t_cp_f, t_cp_b, cp_saved, self.transient = self._cp_attention()
        self.t_cp = t_cp_f + t_cp_b
        self.t_layer = t_f + t_b + 4 * t_ar + t_cp_f + t_cp_b  # Megatron: 2 all-reduces fwd, 2 bwd
        self.t_recompute = t_f + 2 * t_ar + t_cp_f
        self.saved = lm("saved", b, tp, s, cp) + cp_saved
        self.inp = lm("input_bytes", b, tp, s, cp)
        # Head + loss (analytic): logits GEMM fwd + 2x bwd, fp32 softmax traffic, saved logits.
        tokens = b * s_local
        self.t_head = float(roofline_time(3 * 2 * tokens * h * v / tp, 3 * 4 * tokens * v / tp, dev))
        self.head_saved = 6 * b * s_local * v / tp
        span = tp * self.replicas * 2
        self.p2p = float(collective_time("p2p", act_bytes, 2, _link(span, dev))) if self.pp > 1 else 0.0
        self.layer_params = (12 * h * h + 13 * h) / tp + 4 * h  # LN params / row biases replicated

    def _cp_attention(self) -> tuple[float, float, float, float]:
        """(forward s, backward s, saved bytes, transient bytes) of one layer's cp exchange."""
        if self.cp == 1:
            return 0.0, 0.0, 0.0, 0.0
        a = attn_shard(self.spec, self.b, self.tp, self.cp)
        msgs = cp_attention_messages(self.cp_attention, a)
        link = _link(self.tp * self.cp, self.dev)
        t = {k: sum(message_time(m, self.cp, link) for m in ms) for k, ms in msgs.items()}
        return (t["fwd"], t["bwd"], *cp_attention_memory(self.cp_attention, a))

    def stage_params(self, i: int, j: int) -> float:
        h, s, v = self.spec.hidden, self.spec.seq, self.spec.vocab
        p = j * self.layer_params
        if i == 0:
            p += v * h / self.tp + s * h
        if i == self.pp - 1:
            p += v * h / self.tp + 2 * h  # Megatron keeps a copy of the tied embedding here
        return p

    def stage_cost(self, i: int, j: int, c: int) -> tuple[float, float]:
        t = j * self.t_layer + c * self.t_recompute + 2 * self.p2p
        t += self.t_head if i == self.pp - 1 else 0.0
        replica_link = _link(self.tp * self.replicas, self.dev)
        if self.zero == 3:  # gather the stage's weights for forward and backward of every micro-batch
            t += 2 * float(collective_time("all_gather", self.stage_params(i, j) * 2, self.replicas,
                                           replica_link))
        mem = self.stage_states(i, j) + self.stage_activation(i, j, c)
        return t, float(mem)

    def stage_states(self, i: int, j: int) -> float:
        """Weights, gradients and optimizer state of stage i with j layers (ZeRO over dp x cp)."""
        return float(model_state_bytes(self.stage_params(i, j), dp=self.replicas, zero=self.zero,
                                       param_bytes=2).total)

    def stage_activation(self, i: int, j: int, c: int) -> float:
        """Peak activation bytes of stage i with j layers, c of them checkpointed (1F1B)."""
        return float(stage_peak_bytes(states=0.0, layers=j, ckpt_layers=c, saved_per_layer=self.saved,
                                      input_per_layer=self.inp, stage=i, pp=self.pp,
                                      num_microbatches=self.g, transient=self.transient,
                                      extra_activation=self.head_saved if i == self.pp - 1 else 0.0))

    def lower_bound(self) -> float:
        """Step time if layers split perfectly evenly with no checkpointing and no DP sync."""
        work = self.spec.layers * self.t_layer + self.t_head
        return (self.g - 1) * work / self.pp + work

    def after_pipeline(self, layers: list[int]) -> tuple[float, float]:
        """(gradient sync over dp x cp, optimizer step) seconds of the largest stage."""
        params = max(self.stage_params(i, j) for i, j in enumerate(layers))
        link = _link(self.tp * self.replicas, self.dev)
        op = "all_reduce" if self.zero < 2 else "reduce_scatter"
        t_dp = float(collective_time(op, params * 2, self.replicas, link))
        if self.zero in (1, 2):  # updated weight shards are all-gathered after the step
            t_dp += float(collective_time("all_gather", params * 2, self.replicas, link))
        shard = self.replicas if self.zero >= 1 else 1
        return t_dp, params / shard * 36 / self.dev.mem_bandwidth  # r/w master, m, v, grad, weight


def _layouts(spec: GPTSpec, gpus: int, global_batch: int, device: DeviceConstants, lm: LayerModel,
             grid: dict[str, tuple]) -> list[_Layout]:
    """Every layout of the grid that divides the cluster, the batch, the heads and the sequence."""
    out = []
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
            out.append(_Layout(spec, device, lm, tp, pp, dp, b, g, zero, cp, mode))
    return out


def simulate(spec: GPTSpec, gpus: int, global_batch: int, device: DeviceConstants,
             layer_model: LayerModel | None = None, tps: tuple[int, ...] = (1, 2, 4, 8),
             pps: tuple[int, ...] = (1, 2, 4, 8), micro_batches: tuple[int, ...] = (1, 2, 4, 8),
             zeros: tuple[int, ...] = (0, 1, 2, 3), mem_fraction: float = 0.9,
             workspace_bytes: float = 2e9, top: int = 5, cps: tuple[int, ...] = (1, 2, 4, 8),
             cp_attentions: tuple[str, ...] = CP_ATTENTION) -> list[SimPlan]:
    """Best `top` plans for `spec` (at `spec.seq` tokens per sample) on `gpus` devices, fastest
    first.

    Layout: tp innermost (within a node), then cp, then dp, then pp (`_Layout`); cp x tp x pp
    x dp = gpus, and cp > 1 is tried with each of `cp_attentions`. `mem_fraction` of device
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
    lm = layer_model or LayerModel(spec)
    if (lm.spec.hidden, lm.spec.heads, lm.spec.vocab) != (spec.hidden, spec.heads, spec.vocab):
        raise ValueError(f"layer_model was built for {lm.spec.name} (hidden {lm.spec.hidden}, "
                         f"heads {lm.spec.heads}), not {spec.name}'s shape.")
    cap = device.memory_bytes * mem_fraction - workspace_bytes
    L = spec.layers
    grid = dict(tps=tps, pps=pps, cps=cps, mbs=micro_batches, zeros=zeros, modes=cp_attentions)
    layouts = sorted(_layouts(spec, gpus, global_batch, device, lm, grid), key=lambda x: x.lower_bound())
    plans: list[SimPlan] = []
    model_flops = (6 * spec.params + 12 * L * spec.hidden * spec.seq) * global_batch * spec.seq
    for lay in layouts:
        if len(plans) >= top and lay.lower_bound() >= plans[top - 1].step_time:
            break
        window = (max(1, L // lay.pp - 3), L // lay.pp + 3) if lay.pp > 1 else None
        plan = plan_pipeline(lay.stage_cost, L, lay.pp, lay.g, cap, layer_range=window, max_options=12)
        if plan is None:
            continue
        t_dp, t_opt = lay.after_pipeline(plan.layers)
        step = plan.objective + t_dp + t_opt
        mfu = model_flops / step / (gpus * device.peak_flops / 0.7)
        plans.append(SimPlan(spec.name, gpus, lay.dp, lay.tp, lay.pp, lay.b, lay.g, lay.zero,
                             plan.layers, plan.ckpt, step, plan.stage_memory, global_batch / step, mfu,
                             {"pipeline": plan.objective, "dp_sync": t_dp, "optimizer": t_opt,
                              "cp_per_layer": lay.t_cp},  # one layer, one micro-batch, fwd + bwd
                             lay.cp, lay.cp_attention, spec.seq))
        plans.sort(key=lambda p: p.step_time)
    return plans[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plan GPT training from device constants (no GPU needed).")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES))
    ap.add_argument("--models", default="gpt-1.3b,gpt-2.7b,gpt-7b")
    ap.add_argument("--gpus", default="8,16,32,64")
    ap.add_argument("--samples-per-gpu", type=int, default=16,
                    help="global batch = this x GPUs (Mist's artifact uses 16 samples per GPU)")
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sample (default: the model's 2048); long contexts bring in cp")
    ap.add_argument("--cp", default="1,2,4,8", help="context-parallel degrees to try")
    ap.add_argument("--cp-attention", default=",".join(CP_ATTENTION),
                    help=f"cp attention exchanges to try with cp > 1 (of {', '.join(CP_ATTENTION)})")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args(argv)
    cps = tuple(int(x) for x in args.cp.split(","))
    modes = tuple(args.cp_attention.split(","))
    dev = DEVICES[args.device]
    print(f"device: {dev.name}  peak {dev.peak_flops / 1e12:.0f} TFLOP/s achievable, "
          f"HBM {dev.mem_bandwidth / 1e12:.2f} TB/s, {dev.memory_bytes / 1e9:.0f} GB")
    for name in args.models.split(","):
        spec = dataclasses.replace(GPT_MODELS[name], seq=args.seq or GPT_MODELS[name].seq)
        lm = LayerModel(spec)
        for n in (int(x) for x in args.gpus.split(",")):
            plans = simulate(spec, n, args.samples_per_gpu * n, dev, lm, top=args.top, cps=cps,
                             cp_attentions=modes)
            if not plans:
                print(f"{name:9s} {n:3d}  seq{spec.seq}  no plan fits")
            for p in plans:
                print(p.row())


if __name__ == "__main__":
    main()
