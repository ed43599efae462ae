"""``predict(config)`` for the guided search: step time and peak memory from the cost model.

What each term comes from:

* **Per-layer FLOPs, bytes moved and saved activations**: :func:`slapo.tune.cost.block_cost`
  on one scheduled layer per attention core (FakeTensor capture, sympy in batch and seq).
* **Fuse and Tempo**: neither can be captured under FakeTensorMode (compiled regions, Tempo's
  data-dependent lookups), so one real forward of the scheduled layer at batch 2 measures the
  bytes it saves (:func:`~slapo.tune.capture.measure_saved_bytes`). The saved set scales with
  batch at a fixed seq, so the ratio to the unfused layer carries over to every batch size. A
  tensor that is no longer saved is also no longer written in forward or read in backward, so
  it comes off the memory traffic too. Any other time effect (Tempo's recomputation, fusion's
  kernel savings) is left to the guided search's per-knob correction, which learns it from the
  first measurements.
* **Time**: :func:`~slapo.tune.timing.roofline_time` with a GEMM peak and a copy bandwidth
  measured by :func:`~slapo.tune.timing.calibrate` at the trials' thread count. Checkpointed
  layers run their forward twice. The LM head (logits GEMM, fp32 softmax traffic) and AdamW
  (about 32 bytes of traffic per parameter) are added analytically.
* **Memory**: the process's resident set at start + weights + AdamW state (12 B/param) + saved
  activations (a checkpointed layer keeps only its input) + logits and their log-softmax +
  the larger of the gradients and one re-materialised layer.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .evaluators import TrialSettings, build_scheduled_model, rss_bytes
from .space import Config
from .spaces import schedule_knobs
from .timing import DeviceConstants, calibrate, roofline_time

_ADAM_TRAFFIC = 32  # bytes per parameter: read p, g, m, v and write p, m, v (fp32), plus temps


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
                 calibration_path: str | Path | None = None, base_rss: int | None = None):
        import torch

        self.settings = settings
        self.seq = settings.seq_len
        if device is None:
            threads = torch.get_num_threads()
            torch.set_num_threads(settings.threads)
            try:
                device = calibrate(cache_path=calibration_path)
            finally:
                torch.set_num_threads(threads)
        self.device = device
        self.base_rss = rss_bytes() if base_rss is None else base_rss
        self._layers: dict[tuple, LayerCost] = {}
        self._saved_ratio: dict[tuple, float] = {}
        full = build_scheduled_model(settings, {"batch_size": 1})
        self.num_params = sum(p.numel() for p in full.parameters())
        self.vocab = full.config.vocab_size
        del full

    # ------------------------------------------------------------------ per-layer costs
    def _one_layer(self, config: Config) -> Any:
        from dataclasses import replace

        model = build_scheduled_model(replace(self.settings, num_layers=1),
                                      {**config, "ckpt_ratio": 0.0})
        return model.transformer.h[0]

    def layer_cost(self, attention: str) -> LayerCost:
        """Symbolic costs of one layer with this attention core, cached."""
        if (attention,) not in self._layers:
            import torch

            from .cost import BATCH, SEQ, block_cost

            block = self._one_layer({"attention": attention})
            x = torch.randn(2, min(self.seq, 32), self.settings.hidden_size)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cost = block_cost(block, (x,), backward=True)
            e = {k: v.subs(SEQ, self.seq) for k, v in cost.exprs.items()}
            fn = {k: _batch_fn(v, BATCH) for k, v in e.items()}
            self._layers[(attention,)] = LayerCost(
                fn["fwd_flops"], fn["bwd_flops"], fn["fwd_bytes"], fn["bwd_bytes"],
                _batch_fn(e["saved_bytes"] + e["saved_input_bytes"], BATCH), fn["input_bytes"])
        return self._layers[(attention,)]

    def saved_ratio(self, attention: str, fuse: bool, tempo: bool) -> float:
        """Saved bytes of the fused/Tempo layer over the plain layer (same attention), measured."""
        key = (attention, fuse, tempo)
        if not (fuse or tempo):
            return 1.0
        if key not in self._saved_ratio:
            self._saved_ratio[key] = (self._measure_saved(attention, fuse, tempo)
                                      / self._measure_saved(attention, False, False))
        return self._saved_ratio[key]

    def _measure_saved(self, attention: str, fuse: bool, tempo: bool) -> int:
        import torch

        from .capture import measure_saved_bytes

        block = self._one_layer({"attention": attention, "fuse": fuse, "tempo": tempo})
        x = torch.randn(2, self.seq, self.settings.hidden_size, requires_grad=True)
        return measure_saved_bytes(block, (x,), include_inputs=True)

    # ------------------------------------------------------------------ prediction
    def __call__(self, config: Config) -> dict[str, float]:
        knobs = schedule_knobs(config)
        bs, seq, h = int(config["batch_size"]), self.seq, self.settings.hidden_size
        layers = self.settings.num_layers
        n_ckpt = int(knobs["ckpt_ratio"] * layers + 0.5)  # as model_schedule.apply rounds
        lc = self.layer_cost(knobs["attention"])
        ratio = self.saved_ratio(knobs["attention"], knobs["fuse"], knobs["tempo"])
        saved = float(lc.saved(bs)) * ratio
        not_saved = float(lc.saved(bs)) - saved  # no longer written in fwd nor read in bwd
        dev = self.device
        fwd = float(roofline_time(lc.fwd_flops(bs), lc.fwd_bytes(bs) - not_saved, dev))
        bwd = float(roofline_time(lc.bwd_flops(bs), lc.bwd_bytes(bs) - not_saved, dev))
        tokens = bs * seq
        logits = tokens * self.vocab * 4
        head = float(roofline_time(3 * 2 * tokens * h * self.vocab, 6 * logits, dev))
        optim = self.num_params * _ADAM_TRAFFIC / dev.mem_bandwidth
        step = layers * (fwd + bwd) + n_ckpt * fwd + head + optim
        weights = 4 * self.num_params
        acts = (layers - n_ckpt) * saved + n_ckpt * float(lc.input_bytes(bs)) + 2 * logits
        transient = max(weights, saved if n_ckpt else 0.0)
        memory = self.base_rss + 3 * weights + acts + transient
        return {"throughput": tokens / step, "step_time_s": step, "memory": memory,
                "saved_activation_bytes": acts}


def _batch_fn(expr: Any, batch_sym: Any) -> Any:
    import sympy

    return sympy.lambdify(batch_sym, expr, "math")
