"""`predict(config)` for the CPU space's guided search (GPT-2 on a CPU): step time and peak
memory from the cost model (the GPU space's predictor is `predict_gpu.GPUCostModel`).

What each term comes from:

* **Per-layer FLOPs, bytes moved and saved activations**: `slapo.tune.cost.block_cost`
  on one scheduled layer per attention core (FakeTensor capture, sympy in batch and seq).
* **Fuse and Tempo**: neither can be captured under FakeTensorMode (compiled regions, Tempo's
  data-dependent lookups). So each scheduled layer variant (attention x fuse x Tempo) is
  profiled once for real at batch 2 and 4, with the same dispatch-level counter the capture
  uses, plus an op count and the saved bytes. Every count is linear in batch at a fixed seq.
  A variant's bytes moved and saved bytes are the symbolic plain-layer values times the
  variant's measured ratio to the plain layer; its op count is its own (Tempo's chunked
  backward issues ~15x the ops of the plain layer, and more with batch).
* **Time**: `roofline_time` with a GEMM peak and a copy bandwidth
  measured by `calibrate` at the trials' thread count, plus ops x a
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
from .capture import _SavedRecorder
from .evaluators import TrialSettings, build_scheduled_model
from .model_spaces import schedule_knobs
from .op_costs import _CostCounter
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
    """Predicts `throughput` (tokens/s), `step_time_s` and `memory` (peak RSS bytes).

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
    """Measured costs of one layer variant: each field is `a + b * batch`."""

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
    """One real forward + backward of `block`: ops, bytes moved and saved bytes.

    Returns a dict for `LayerProfile.fit` with `ops`/`bytes`/`flops` totals for the
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
