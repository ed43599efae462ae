"""``predict(config)`` for the guided search: step time and peak memory from the cost model.

What each term comes from:

* **Per-layer FLOPs, bytes moved and saved activations**: :func:`slapo.tune.cost.block_cost`
  on one scheduled layer per attention core (FakeTensor capture, sympy in batch and seq).
* **Fuse and Tempo**: neither can be captured under FakeTensorMode (compiled regions, Tempo's
  data-dependent lookups). So each scheduled layer variant (attention x fuse x Tempo) is
  profiled once for real at batch 2 and 4, with the same dispatch-level counter the capture
  uses, plus an op count and the saved bytes. Every count is linear in batch at a fixed seq.
  A variant's bytes moved and saved bytes are the symbolic plain-layer values times the
  variant's measured ratio to the plain layer; its op count is its own (Tempo's chunked
  backward issues ~15x the ops of the plain layer, and more with batch).
* **Time**: :func:`~slapo.tune.timing.roofline_time` with a GEMM peak and a copy bandwidth
  measured by :func:`~slapo.tune.timing.calibrate` at the trials' thread count, plus ops x a
  per-op overhead. The overhead is calibrated here: the plain layer at batch 1, seq 8 (no
  real work) is timed and its roofline time subtracted. On a CPU the overhead is what makes
  a larger batch faster per token. Checkpointed layers run their forward twice. The LM head
  (logits GEMM, fp32 softmax traffic) and AdamW (about 32 bytes of traffic and 12 ops per
  parameter tensor) are added analytically.
* **Memory**: the process's resident set at start + weights + AdamW state (12 B/param) + saved
  activations (a checkpointed layer keeps only its input) + logits and their log-softmax +
  the larger of the gradients and one re-materialised layer.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..profile.meter import rss_bytes
from .capture import _MM_FLOPS, _CostCounter, _SavedRecorder
from .evaluators import TrialSettings, build_scheduled_model
from .model_spaces import schedule_knobs
from .space import Config
from .timing import DeviceConstants, calibrate, roofline_time

_ADAM_TRAFFIC = 32  # bytes per parameter: read p, g, m, v and write p, m, v (fp32), plus temps
_ADAM_OPS = 12  # aten ops per parameter tensor of the single-tensor AdamW step


@dataclass
class LayerCost:
    """Costs of one layer at the tuned seq, as functions of the batch size."""

    fwd_flops: Any
    bwd_flops: Any
    fwd_bytes: Any
    bwd_bytes: Any
    saved: Any
    input_bytes: Any


class GPT2CostModel:
    """Predicts ``throughput`` (tokens/s), ``step_time_s`` and ``memory`` (peak RSS bytes).

    Builds one one-layer model per knob combination that changes the layer's costs (attention,
    fuse, tempo), so its set-up takes a few seconds; every prediction after that is arithmetic.
    """

    def __init__(self, settings: TrialSettings, device: DeviceConstants | None = None,
                 calibration_path: str | Path | None = None, base_rss: int | None = None,
                 op_overhead_s: float | None = None):
        import torch

        self.settings = settings
        self.seq = settings.seq_len
        threads = torch.get_num_threads()
        torch.set_num_threads(settings.threads)
        try:
            self.device = device or calibrate(cache_path=calibration_path)
            self.base_rss = rss_bytes() if base_rss is None else base_rss
            self._layers: dict[str, LayerCost] = {}
            self._profiles: dict[tuple, LayerProfile] = {}
            full = build_scheduled_model(settings, {"batch_size": 1})
            self.num_params = sum(p.numel() for p in full.parameters())
            self.num_tensors = sum(1 for _ in full.parameters())
            self.vocab = full.config.vocab_size
            del full
            self.op_overhead_s = (self._calibrate_overhead() if op_overhead_s is None
                                  else op_overhead_s)
        finally:
            torch.set_num_threads(threads)

    # ------------------------------------------------------------------ per-layer costs
    def _one_layer(self, config: Config, seq: int | None = None) -> Any:
        from dataclasses import replace

        small = replace(self.settings, num_layers=1, seq_len=seq or self.seq)
        model = build_scheduled_model(small, {**config, "ckpt_ratio": 0.0})
        return model.transformer.h[0]

    def layer_cost(self, attention: str) -> LayerCost:
        """Symbolic costs of the plain layer with this attention core (FakeTensor capture)."""
        if attention not in self._layers:
            import torch

            from .cost import BATCH, SEQ, block_cost

            block = self._one_layer({"attention": attention})
            x = torch.randn(2, min(self.seq, 32), self.settings.hidden_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cost = block_cost(block, (x,), backward=True)
            e = {k: v.subs(SEQ, self.seq) for k, v in cost.exprs.items()}
            fn = {k: _batch_fn(v, BATCH) for k, v in e.items()}
            self._layers[attention] = LayerCost(
                fn["fwd_flops"], fn["bwd_flops"], fn["fwd_bytes"], fn["bwd_bytes"],
                _batch_fn(e["saved_bytes"] + e["saved_input_bytes"], BATCH), fn["input_bytes"])
        return self._layers[attention]

    def profile(self, attention: str, fuse: bool, tempo: bool) -> LayerProfile:
        """Measured op counts, bytes and saved bytes of one layer variant (linear in batch).

        A variant that cannot even be built (an unknown fuse compiler, say) is profiled as the
        plain layer with a warning: the trials will report it as failed.
        """
        key = (attention, fuse, tempo)
        if key not in self._profiles:
            try:
                self._profiles[key] = LayerProfile.fit(
                    {b: _profile_layer(self._one_layer(dict(zip(("attention", "fuse", "tempo"),
                                                                key))), b, self.seq,
                                       self.settings.hidden_size) for b in (2, 4)})
            except Exception as e:  # noqa: BLE001
                if not (fuse or tempo):
                    raise
                warnings.warn(f"cost model: could not profile the layer with attention="
                              f"{attention}, fuse={fuse}, tempo={tempo} ({type(e).__name__}: "
                              f"{e}); predicting it like the plain layer.", stacklevel=2)
                self._profiles[key] = self.profile(attention, False, False)
        return self._profiles[key]

    def saved_ratio(self, attention: str, fuse: bool, tempo: bool) -> float:
        """Saved bytes of the fused/Tempo layer over the plain layer (same attention), measured."""
        plain, var = self.profile(attention, False, False), self.profile(attention, fuse, tempo)
        return var.saved(2) / plain.saved(2)

    def _calibrate_overhead(self) -> float:
        """Seconds per dispatched op beyond its roofline time (the eager-mode tax), measured."""
        import torch

        block = self._one_layer({"attention": "eager"}, seq=8)
        x = torch.randn(1, 8, self.settings.hidden_size, requires_grad=True)
        prof = _profile_layer(block, 1, 8, self.settings.hidden_size)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            block(x)[0].sum().backward()
            best = min(best, time.perf_counter() - t0)
        work = float(roofline_time(prof.flops, prof.bytes, self.device))
        return max(best - work, 0.0) / max(prof.ops, 1)

    # ------------------------------------------------------------------ prediction
    def __call__(self, config: Config) -> dict[str, float]:
        knobs = schedule_knobs(config)
        bs, seq, h = int(config["batch_size"]), self.seq, self.settings.hidden_size
        layers = self.settings.num_layers
        n_ckpt = int(knobs["ckpt_ratio"] * layers + 0.5)  # as model_schedule.apply rounds
        att = knobs["attention"]
        lc = self.layer_cost(att)
        plain, var = self.profile(att, False, False), self.profile(att, knobs["fuse"], knobs["tempo"])
        dev, ov = self.device, self.op_overhead_s
        fwd = float(roofline_time(lc.fwd_flops(bs), lc.fwd_bytes(bs) * var.fwd_bytes(bs)
                                  / plain.fwd_bytes(bs), dev)) + ov * var.fwd_ops(bs)
        bwd = float(roofline_time(lc.bwd_flops(bs), lc.bwd_bytes(bs) * var.bwd_bytes(bs)
                                  / plain.bwd_bytes(bs), dev)) + ov * var.bwd_ops(bs)
        saved = float(lc.saved(bs)) * var.saved(bs) / plain.saved(bs)
        tokens = bs * seq
        logits = tokens * self.vocab * 4
        head = float(roofline_time(3 * 2 * tokens * h * self.vocab, 6 * logits, dev)) + ov * 60
        optim = (self.num_params * _ADAM_TRAFFIC / dev.mem_bandwidth
                 + ov * _ADAM_OPS * self.num_tensors)
        step = layers * (fwd + bwd) + n_ckpt * fwd + head + optim
        weights = 4 * self.num_params
        acts = (layers - n_ckpt) * saved + n_ckpt * float(lc.input_bytes(bs)) + 2 * logits
        transient = max(weights, saved if n_ckpt else 0.0)
        memory = self.base_rss + 3 * weights + acts + transient
        return {"throughput": tokens / step, "step_time_s": step, "memory": memory,
                "saved_activation_bytes": acts}


@dataclass
class LayerProfile:
    """Measured costs of one layer variant: each field is ``a + b * batch``."""

    coef: dict[str, tuple[float, float]]

    FIELDS = ("fwd_ops", "bwd_ops", "fwd_bytes", "bwd_bytes", "saved")

    @classmethod
    def fit(cls, at: dict[int, dict[str, float]]) -> LayerProfile:
        (b1, p1), (b2, p2) = sorted(at.items())
        coef = {}
        for f in cls.FIELDS:
            slope = (p2[f] - p1[f]) / (b2 - b1)
            coef[f] = (p1[f] - slope * b1, slope)
        return cls(coef)

    def __getattr__(self, name: str) -> Any:
        if name in LayerProfile.FIELDS:
            a, b = self.coef[name]
            return lambda batch: max(a + b * batch, 1.0)
        raise AttributeError(name)


class _OpCounter(_CostCounter):
    """The capture's FLOP/byte counter, plus the number of aten ops dispatched."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def _profile_layer(block: Any, batch: int, seq: int, hidden: int) -> Any:
    """One real forward + backward of ``block``: ops, bytes moved and saved bytes.

    Returns a dict for :meth:`LayerProfile.fit` with ``ops``/``bytes``/``flops`` totals for the
    overhead calibration. Runs once untimed first so a compiled region is
    compiled before it is counted.
    """
    import torch

    x = torch.randn(batch, seq, hidden, requires_grad=True)
    block(x)[0].sum().backward()
    fwd, bwd, rec = _OpCounter(), _OpCounter(), _SavedRecorder()
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack), fwd:
        out = block(x)[0]
    with bwd:
        out.sum().backward()
    act, saved_in = rec.split(list(block.parameters()) + list(block.buffers()), [x])
    return _ProfileDict(fwd_ops=fwd.ops, bwd_ops=bwd.ops, fwd_bytes=fwd.bytes,
                        bwd_bytes=bwd.bytes, saved=act + saved_in,
                        flops=fwd.flops + bwd.flops)


class _ProfileDict(dict):
    @property
    def ops(self) -> int:
        return self["fwd_ops"] + self["bwd_ops"]

    @property
    def bytes(self) -> float:
        return self["fwd_bytes"] + self["bwd_bytes"]

    @property
    def flops(self) -> float:
        return self["flops"]


def _batch_fn(expr: Any, batch_sym: Any) -> Any:
    import sympy

    return sympy.lambdify(batch_sym, expr, "math")


# ================================================================================================
# GPU: peak memory and step time of a scheduled HF model, from one fake training step
# ================================================================================================

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
    """``predict(config)`` for the GPU space: peak memory and step time of a training step.

    **Memory** is simulated, not estimated: the real model (built under ``FakeTensorMode``: no
    weights are allocated, a 1.1B model costs nothing) gets the config's schedule
    (``model_schedule.apply``) and runs one forward under the config's autocast and one backward,
    while torch's ``MemTracker`` follows every tensor's lifetime. Eager, SAC, full checkpointing,
    fused loss, kernels and autocast's cached bf16 weights are therefore what the product runs.
    A compiled layer (``compile_blocks``) cannot run under fake tensors, so it is emulated: its
    forward graph is recorded once, the tensors inductor's partitioner would keep are found by
    the same min cut it solves (:func:`~slapo.tune.capture.saved_ops`), and every layer then
    runs as a selective checkpoint that keeps exactly those (so it also recomputes the rest in
    backward, as the compiled backward does). AdamW's state is added analytically
    (:meth:`StepCost.memory`).

    **Time** is a roofline per op class over the same step: matmul/attention FLOPs (forward,
    recomputation, backward) at ``device.peak_flops``, the bytes every other op moves at
    ``device.mem_bandwidth`` (inside a compiled layer or a fused kernel an elementwise chain
    reads its inputs and writes its outputs once), and the fused AdamW step; times
    ``1 / efficiency``. ``efficiency`` is the one constant fitted to a measurement
    (:meth:`calibrate`, on one configuration per model family).
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
        """Set ``efficiency`` so that ``config`` is predicted at the measured step time."""
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
    """One fake forward + backward of ``spec`` under ``config`` (see :class:`GPUCostModel`).

    ``schedule=False`` runs the HF model as loaded (the benchmark's HF baselines).
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
    forward of ``layer`` (the first; every layer runs the same graph)."""
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
    apart: :meth:`fused_bytes` scales them by the fused/eager ratio of the layer's forward."""

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
