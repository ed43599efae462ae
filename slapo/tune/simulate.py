"""Simulation mode: plan GPT training on a hypothetical cluster from device constants alone.

For every (tp, pp, dp, micro-batch, ZeRO stage) the per-layer costs come from the traced block
model (`slapo.tune.cost.block_cost` on a meta-device `GPT2Block`, bf16, SDPA without
dropout, i.e. flash-style attention), pipeline partition and checkpoint counts come from the MILP
planner, and the step time is::

    (G - 1) * max_i T_i + sum_i T_i + DP gradient sync + optimizer step

with T_i the per-micro-batch time of stage i (roofline compute of its layers, recompute of its
checkpointed layers, TP all-reduces, pipeline p2p). Nothing overlaps (communication is serial
with compute), which penalises ZeRO-3 and large DP degrees the most; see docs/tune.md for what
else is ignored. Run `python -m slapo.tune.simulate` to print plans.
"""

from __future__ import annotations

import argparse
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

    def row(self) -> str:
        mem = max(self.stage_memory) / 1e9
        return (f"{self.model:9s} {self.gpus:3d}  dp{self.dp:<2d} tp{self.tp} pp{self.pp} "
                f"mb{self.micro_batch:<2d} G{self.num_microbatches:<3d} zero{self.zero}  "
                f"layers={self.layers} ckpt={self.ckpt}  step={self.step_time:.2f}s "
                f"{self.samples_per_s:.1f} samples/s  MFU~{self.mfu:.0%}  peak {mem:.1f} GB")


class LayerModel:
    """Per-layer costs of one GPT block (per tp rank), as numpy functions of (batch, tp)."""

    def __init__(self, spec: GPTSpec):
        import torch
        from transformers import GPT2Config
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        from .cost import CKPT, block_cost

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
        self.saved = c.lambdify("saved_incl", c.saved(include_inputs=True).subs(CKPT, 0))
        self.f = {k: c.lambdify(k) for k in c.exprs}

    def __call__(self, name: str, batch: int, tp: int) -> float:
        if name == "saved":
            return float(self.saved(batch, self.spec.seq, tp, 0))
        return float(self.f[name](batch, self.spec.seq, tp, 0))


def _link(group_span: int, dev: DeviceConstants) -> AlphaBeta:
    return dev.intra if group_span <= dev.gpus_per_node else dev.inter


@dataclass
class _Layout:
    """Costs of one (tp, pp, dp, micro-batch, ZeRO) layout; `stage_cost` feeds the planner."""

    spec: GPTSpec
    dev: DeviceConstants
    lm: LayerModel
    tp: int
    pp: int
    dp: int
    b: int
    g: int
    zero: int

    def __post_init__(self) -> None:
        spec, dev, lm, tp, b = self.spec, self.dev, self.lm, self.tp, self.b
        h, s, v = spec.hidden, spec.seq, spec.vocab
        t_f = float(roofline_time(lm("fwd_flops", b, tp), lm("fwd_bytes", b, tp), dev))
        t_b = float(roofline_time(lm("bwd_flops", b, tp), lm("bwd_bytes", b, tp), dev))
        act_bytes = b * s * h * 2
        t_ar = float(collective_time("all_reduce", act_bytes, tp, _link(tp, dev)))
        self.t_layer = t_f + t_b + 4 * t_ar  # Megatron: 2 all-reduces forward, 2 backward
        self.t_recompute = t_f + 2 * t_ar
        self.saved, self.inp = lm("saved", b, tp), lm("input_bytes", b, tp)
        # Head + loss (analytic): logits GEMM fwd + 2x bwd, fp32 softmax traffic, saved logits.
        self.t_head = float(roofline_time(3 * 2 * b * s * h * v / tp, 3 * 4 * b * s * v / tp, dev))
        self.head_saved = 6 * b * s * v / tp
        span = tp * self.dp * 2
        self.p2p = float(collective_time("p2p", act_bytes, 2, _link(span, dev))) if self.pp > 1 else 0.0
        self.layer_params = (12 * h * h + 13 * h) / tp + 4 * h  # LN params / row biases replicated

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
        if self.zero == 3:  # gather the stage's weights for forward and backward of every micro-batch
            t += 2 * float(collective_time("all_gather", self.stage_params(i, j) * 2, self.dp,
                                           _link(self.tp * self.dp, self.dev)))
        states = model_state_bytes(self.stage_params(i, j), dp=self.dp, zero=self.zero, param_bytes=2).total
        mem = stage_peak_bytes(states=states, layers=j, ckpt_layers=c, saved_per_layer=self.saved,
                               input_per_layer=self.inp, stage=i, pp=self.pp, num_microbatches=self.g,
                               extra_activation=self.head_saved if i == self.pp - 1 else 0.0)
        return t, float(mem)

    def lower_bound(self) -> float:
        """Step time if layers split perfectly evenly with no checkpointing and no DP sync."""
        work = self.spec.layers * self.t_layer + self.t_head
        return (self.g - 1) * work / self.pp + work

    def after_pipeline(self, layers: list[int]) -> tuple[float, float]:
        """(DP gradient sync, optimizer step) seconds of the largest stage."""
        params = max(self.stage_params(i, j) for i, j in enumerate(layers))
        link = _link(self.tp * self.dp, self.dev)
        op = "all_reduce" if self.zero < 2 else "reduce_scatter"
        t_dp = float(collective_time(op, params * 2, self.dp, link))
        if self.zero in (1, 2):  # updated weight shards are all-gathered after the step
            t_dp += float(collective_time("all_gather", params * 2, self.dp, link))
        shard = self.dp if self.zero >= 1 else 1
        return t_dp, params / shard * 36 / self.dev.mem_bandwidth  # r/w master, m, v, grad, weight


def simulate(spec: GPTSpec, gpus: int, global_batch: int, device: DeviceConstants,
             layer_model: LayerModel | None = None, tps: tuple[int, ...] = (1, 2, 4, 8),
             pps: tuple[int, ...] = (1, 2, 4, 8), micro_batches: tuple[int, ...] = (1, 2, 4, 8),
             zeros: tuple[int, ...] = (0, 1, 2, 3), mem_fraction: float = 0.9,
             workspace_bytes: float = 2e9, top: int = 5) -> list[SimPlan]:
    """Best `top` plans for `spec` on `gpus` devices (fastest first).

    Layout: tp innermost (within a node), then dp, then pp; `mem_fraction` of device memory
    minus `workspace_bytes` (allocator, kernels' workspaces, transient peaks) is the cap.
    Layouts are visited in order of a lower bound on their step time and skipped once the bound
    exceeds the `top`-th best plan found, so most MILPs are never built.
    """
    if gpus < 1 or global_batch < 1:
        raise ValueError(f"need gpus >= 1 and global_batch >= 1, got {gpus}, {global_batch}.")
    lm = layer_model or LayerModel(spec)
    cap = device.memory_bytes * mem_fraction - workspace_bytes
    L = spec.layers
    layouts = []
    for tp, pp, b, zero in itertools.product(tps, pps, micro_batches, zeros):
        if gpus % (tp * pp) or tp > device.gpus_per_node or pp > L or spec.heads % tp:
            continue
        dp = gpus // (tp * pp)
        if global_batch % (dp * b) or (zero > 0 and dp == 1):  # ZeRO without DP is ZeRO-0
            continue
        layouts.append(_Layout(spec, device, lm, tp, pp, dp, b, global_batch // (dp * b), zero))
    layouts.sort(key=lambda x: x.lower_bound())
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
                             {"pipeline": plan.objective, "dp_sync": t_dp, "optimizer": t_opt}))
        plans.sort(key=lambda p: p.step_time)
    return plans[:top]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Plan GPT training from device constants (no GPU needed).")
    ap.add_argument("--device", default="h100", choices=sorted(DEVICES))
    ap.add_argument("--models", default="gpt-1.3b,gpt-2.7b,gpt-7b")
    ap.add_argument("--gpus", default="8,16,32,64")
    ap.add_argument("--samples-per-gpu", type=int, default=16,
                    help="global batch = this x GPUs (Mist's artifact uses 16 samples per GPU)")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args(argv)
    dev = DEVICES[args.device]
    print(f"device: {dev.name}  peak {dev.peak_flops / 1e12:.0f} TFLOP/s achievable, "
          f"HBM {dev.mem_bandwidth / 1e12:.2f} TB/s, {dev.memory_bytes / 1e9:.0f} GB")
    for name in args.models.split(","):
        spec = GPT_MODELS[name]
        lm = LayerModel(spec)
        for n in (int(x) for x in args.gpus.split(",")):
            plans = simulate(spec, n, args.samples_per_gpu * n, dev, lm, top=args.top)
            if not plans:
                print(f"{name:9s} {n:3d}  no plan fits")
            for p in plans:
                print(p.row())


if __name__ == "__main__":
    main()
