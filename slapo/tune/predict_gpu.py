"""`predict(config)` for the GPU space: peak memory and step time of a scheduled HF model,
from one fake training step (`GPUCostModel`, `simulate_step`; the CPU space's predictor is
`predict_cpu.GPT2CostModel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .capture import _MM_FLOPS, _CostCounter
from .model_spaces import schedule_knobs
from .space import Config
from .timing import DeviceConstants, roofline_time

_ADAMW_STATE = 8  # bytes per parameter: fp32 exp_avg + exp_avg_sq (fp32 weights and grads: 8 more)
_FUSED_ADAMW_TRAFFIC = 28  # read p, g, m, v and write p, m, v (fp32), one fused kernel


@dataclass
class StepCost:
    """What one fake training step of a config costs (before any device constant)."""

    peak_bytes: float  # forward + backward peak, incl. weights and grads, excl. AdamW state
    params: int
    mm_flops: float  # matmul and attention FLOPs: forward, recomputation, backward
    mem_bytes: float  # bytes moved by every other op, fused regions counted as one kernel
    eager_bytes: float  # the same bytes if nothing were fused

    def memory(self) -> float:
        """Peak allocated bytes of a steady step: AdamW's fp32 moments exist from step 2 on; the
        optimizer step itself holds weights + grads + moments (16 B/param)."""
        return max(self.peak_bytes + _ADAMW_STATE * self.params, 16.0 * self.params)


class GPUCostModel:
    """`predict(config)` for the GPU space: peak memory and step time of a training step.

    **Memory** is simulated, not estimated: the real model (built under `FakeTensorMode`: no
    weights are allocated, a 1.1B model costs nothing) gets the config's schedule
    (`model_schedule.apply`) and runs one forward under the config's autocast and one backward,
    while torch's `MemTracker` follows every tensor's lifetime. Eager, SAC, full checkpointing,
    fused loss, kernels and autocast's cached bf16 weights are therefore what the product runs.
    A compiled layer (`compile_blocks`) cannot run under fake tensors, so it is emulated: its
    forward graph is recorded once, the tensors inductor's partitioner would keep are found by
    the same min cut it solves (`saved_ops`), and every layer then
    runs as a selective checkpoint that keeps exactly those (so it also recomputes the rest in
    backward, as the compiled backward does). AdamW's state is added analytically
    (`StepCost.memory`).

    **Time** is a roofline per op class over the same step: matmul/attention FLOPs (forward,
    recomputation, backward) at `device.peak_flops`, the bytes every other op moves at
    `device.mem_bandwidth` (inside a compiled layer or a fused kernel an elementwise chain
    reads its inputs and writes its outputs once), and the fused AdamW step; times
    `1 / efficiency`. `efficiency` is the one constant fitted to a measurement
    (`calibrate`, on one configuration per model family).
    """

    def __init__(self, spec: Any, device: DeviceConstants | None = None,
                 efficiency: float = 1.0):
        self.spec = spec
        self.device = device or H100
        self.efficiency = efficiency
        self._cache: dict[str, StepCost] = {}

    def step_cost(self, config: Config, schedule: bool = True) -> StepCost:
        from .space import config_key

        key = config_key({**config, "__schedule": schedule})
        if key not in self._cache:
            self._cache[key] = simulate_step(self.spec, config, schedule=schedule)
        return self._cache[key]

    def roofline_s(self, cost: StepCost) -> float:
        opt = _FUSED_ADAMW_TRAFFIC * cost.params / self.device.mem_bandwidth
        return float(roofline_time(cost.mm_flops, cost.mem_bytes, self.device)) + opt

    def calibrate(self, config: Config, step_time_s: float, schedule: bool = True) -> float:
        """Set `efficiency` so that `config` is predicted at the measured step time."""
        self.efficiency = self.roofline_s(self.step_cost(config, schedule)) / step_time_s
        return self.efficiency

    def predict(self, config: Config, schedule: bool = True) -> dict[str, float]:
        cost = self.step_cost(config, schedule)
        step = self.roofline_s(cost) / self.efficiency
        tokens = int(config["batch_size"]) * self.spec.seq
        return {"throughput": tokens / step, "step_time_s": step, "memory": cost.memory(),
                "mm_flops": cost.mm_flops, "mem_bytes": cost.mem_bytes}

    __call__ = predict


# An H100 SXM as the benchmark measured it: an 8192^3 bf16 matmul at ~780 TFLOP/s
# (benchmarks/results/gpu_train_h100.jsonl, `matmul_tflops`), HBM3 at ~3 TB/s of 3.35 peak.
H100 = DeviceConstants("H100-SXM-80GB (measured matmul)", peak_flops=780e12,
                       mem_bandwidth=3.0e12, memory_bytes=80 * 2**30)


_ATTN_DROPOUT = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def _fake_model(spec: Any) -> Any:
    import torch
    import transformers

    cfg = getattr(transformers, spec.config_class)(**spec.kwargs)
    cfg.use_cache = False
    for key in _ATTN_DROPOUT:  # CUDA's flash/efficient SDPA keep no dropout mask, but on CPU
        if getattr(cfg, key, 0):  # dropout sends SDPA to its math path (s^2 saved tensors)
            setattr(cfg, key, 0.0)
    with torch.device("cpu"):
        model = getattr(transformers, spec.model_class)(cfg)
    return model.train()


def _fake_batch(model: Any, batch: int, seq: int) -> dict:
    """Random ids; a masked LM labels 15% of positions (as benchmarks/gpu_train.py), written
    without boolean indexing so that fake tensors need no data."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    labels = ids
    if model.config.model_type in ("bert", "roberta"):
        labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def _autocast(config: Config, cache: bool) -> Any:
    import contextlib

    import torch

    prec = config.get("mixed_precision") or "fp32"
    if prec == "fp32":
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[prec]
    return torch.autocast("cpu", dtype=dtype, cache_enabled=cache)


def simulate_step(spec: Any, config: Config, schedule: bool = True) -> StepCost:
    """One fake forward + backward of `spec` under `config` (see `GPUCostModel`).

    `schedule=False` runs the HF model as loaded (the benchmark's HF baselines).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import set_checkpoint_early_stop

    knobs = schedule_knobs(config)
    compiled = bool(knobs.pop("compile_blocks", False)) and schedule
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _fake_model(spec)
        data = _fake_batch(model, int(config["batch_size"]), spec.seq)
        regions, ratio, keep, flops = _schedule(model, knobs, compiled, config, data) \
            if schedule else ([], 1.0, 0.0, 0.0)
        counter = _RegionCounter(regions, ratio)
        tracker = MemTracker()
        tracker.track_external(model)
        with tracker, counter, set_checkpoint_early_stop(False):
            with _autocast(config, cache=not compiled):
                loss = model(**data).loss
            loss.float().backward()
        peak = tracker.get_tracker_snapshot("peak")
        total = sum(v.get("Total", 0) for v in peak.values())
        params = sum(p.numel() for p in model.parameters())
    return StepCost(float(total) + keep, params, float(counter.flops) + flops,
                    counter.fused_bytes(), float(counter.bytes))


def _schedule(model: Any, knobs: dict, compiled: bool, config: Config,
              data: dict) -> tuple[list, float, float, float]:
    """Apply the config's schedule. Returns the compiled layers, their fused/eager bytes ratio,
    and what the emulation of compiled layers must add: saved bytes and (negative) FLOPs."""
    from .. import model_schedule
    from ..model_schedule._registry import detect, layers_of

    ratio, policy = float(knobs.get("ckpt_ratio", 0.0)), knobs.get("ckpt_policy", "full")
    if compiled:
        knobs = {**knobs, "ckpt_ratio": 0.0}
    sch = model_schedule.apply(model, **knobs)
    layers = layers_of(sch, detect(model))
    if not compiled:
        return [], 1.0, 0.0, 0.0
    plan = _compiled_plan(model, layers[0].mod, config, data)
    n = int(ratio * len(layers) + 0.5)  # as model_schedule.apply rounds
    keep = 0.0
    for i, node in enumerate(layers):
        node.checkpoint()  # emulation: recompute in backward, then add back what is kept
        if not (i < n and policy == "full"):
            keep += plan["selective" if i < n else "inductor"]
    kept_layers = len(layers) - (n if policy == "full" else 0)
    return [node.mod for node in layers], plan["ratio"], keep, -kept_layers * plan["flops"]


def _compiled_plan(model: Any, layer: Any, config: Config, data: dict) -> dict[str, float]:
    """What a compiled layer keeps (inductor's min cut; under SAC, the matmul outputs its
    backward needs), its forward's matmul FLOPs and fused/eager bytes, from one recorded
    forward of `layer` (the first; every layer runs the same graph)."""
    import torch
    from torch.utils.flop_counter import flop_registry

    from .capture import OpGraphRecorder, saved_ops

    rec = OpGraphRecorder()
    state = {"on": False, "flops": 0}
    h1 = layer.register_forward_pre_hook(lambda *a: state.update(on=True))
    h2 = layer.register_forward_hook(lambda *a: state.update(on=False))

    class _Gate(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not state["on"]:
                return func(*args, **(kwargs or {}))
            out = rec.__torch_dispatch__(func, types, args, kwargs)
            if func.overloadpacket in flop_registry:
                state["flops"] += flop_registry[func.overloadpacket](*args, **(kwargs or {}),
                                                                      out_val=out)
            elif str(func) in _MM_FLOPS:
                state["flops"] += _MM_FLOPS[str(func)](args, out)
            return out

    pack = lambda t: rec.pack(t) if state["on"] else t  # noqa: E731
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, rec.unpack), _Gate():
            with _autocast(config, cache=False):
                model(**data)
    finally:
        h1.remove()
        h2.remove()
    produced = {s for op in rec.ops for s in op.outputs}
    free = {p.untyped_storage()._cdata for p in layer.parameters()}
    free |= {s for op in rec.ops for s in op.inputs if s not in produced}
    out = {"flops": float(state["flops"]),
           "ratio": rec.fused_bytes() / max(rec.eager_bytes(), 1)}
    for mode in ("inductor", "selective"):
        keep = saved_ops(rec.ops, rec.saved, free, mode)
        out[mode] = float(sum(rec.ops[i].out_bytes for i in keep))
    return out


class _RegionCounter(_CostCounter):
    """FLOPs and bytes of a step. Bytes moved inside a compiled layer (its forward, and in
    backward every autograd node its forward created, recomputation included) are counted
    apart: `fused_bytes` scales them by the fused/eager ratio of the layer's forward."""

    def __init__(self, regions: list, ratio: float = 1.0) -> None:
        super().__init__()
        self.ratio = ratio
        self.region_bytes = 0
        self._depth = 0
        self._nodes: set = set()
        self._inputs: list = []
        for m in regions:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._exit)

    def _enter(self, module: Any, args: tuple) -> None:
        self._depth += 1
        self._inputs = [a.grad_fn for a in args if getattr(a, "grad_fn", None) is not None]

    def _exit(self, module: Any, args: tuple, out: Any) -> None:
        from torch.utils._pytree import tree_flatten

        self._depth -= 1
        stop = set(self._inputs) | self._nodes
        todo = [t.grad_fn for t in tree_flatten(out)[0] if getattr(t, "grad_fn", None)]
        while todo:  # the layer's autograd nodes: its backward runs (and recomputes) in them
            node = todo.pop()
            if node is None or node in stop or type(node).__name__ == "AccumulateGrad":
                continue
            stop.add(node)
            self._nodes.add(node)
            todo += [n for n, _ in node.next_functions]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        inside = self._depth > 0 or torch._C._current_autograd_node() in self._nodes
        before = self.bytes
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if inside:
            self.region_bytes += self.bytes - before
        return out

    def fused_bytes(self) -> float:
        return float(self.bytes - self.region_bytes * (1.0 - self.ratio))
