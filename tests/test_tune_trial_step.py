"""One training step: a tune trial trains with the step `slapo train` runs (the `Trainer` of
`build_trainer`, timed by `runtime.step_timing.time_steps`), so the same model, knobs, batches and seed give the
same losses, bit for bit."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from slapo.tune.evaluators import TrialSettings, train_trial

SIZE = dict(hidden_size=32, num_layers=2, num_heads=2, seq_len=16)


@pytest.mark.parametrize("knobs, precision", [
    ({"attention": "sdpa", "ckpt_ratio": 0.5, "tempo": True}, "fp32"),
    ({"attention": "sdpa"}, "bf16"),
    ({"ckpt_ratio": 1.0}, "fp32"),  # every layer checkpointed, no attention knob
])
def test_tune_trial_and_slapo_train_take_the_same_steps(one_thread, knobs, precision):
    """slapo train (constant LR) and a trial given slapo train's own batches: same losses."""
    from slapo.data import make_data
    from slapo.train import TrainConfig, train

    warnings.simplefilter("ignore")
    steps, batch = 3, 2
    cfg = TrainConfig(**SIZE, batch_size=batch, steps=steps, min_lr_ratio=1.0, eval_batches=0,
                      progress=False, plot=False, precision=precision, **knobs)
    losses = train(cfg)["losses"]
    data = make_data("causal", cfg.seq_len, cfg.seed)  # what slapo train drew, in order
    batches = [data.train.next_batch(batch) for _ in range(steps)]
    settings = TrialSettings(**SIZE, steps=steps - 1, warmup=1)
    trial = train_trial(settings, {"batch_size": batch, "mixed_precision": precision, **knobs},
                        batches=batches)
    assert len(losses) == steps and losses[0] > losses[-1]  # it trained
    assert trial["losses"] == losses


def _tiny_trainer(seed: int = 0):
    from slapo.tune.evaluators import build_scheduled, trial_trainer

    settings = TrialSettings(**SIZE, seed=seed)
    cfg = {"batch_size": 2, "attention": "sdpa"}
    return trial_trainer(build_scheduled(settings, cfg), settings, cfg)


def test_time_steps_times_train_step_itself(one_thread):
    """`time_steps` returns one time and the loss of each `train_step`: the losses of a twin
    model stepped by hand, and `fastest(skip)` is the minimum after the warm-up steps."""
    from slapo.runtime.step_timing import time_steps

    warnings.simplefilter("ignore")
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 200, (2, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    timed_trainer = _tiny_trainer()
    twin = _tiny_trainer()
    timed = time_steps(timed_trainer, batches, barrier=True)  # no process group: no barrier
    assert timed.losses == [twin.train_step(b) for b in batches]
    assert len(timed.seconds) == 3 and all(s > 0 for s in timed.seconds)
    assert timed.fastest(1) == min(timed.seconds[1:])
    assert math.isnan(timed.fastest(3))


def test_trial_reports_the_meter_peak(one_thread):
    """The trial's peak is `slapo.profile.meter`'s, restarted when the trial begins: at least
    the resident set it ends with, and not the (larger) peak of an earlier phase."""
    from slapo.profile import meter

    warnings.simplefilter("ignore")
    meter.reset_peak("cpu")  # a long-lived test worker's own history is not the earlier phase
    blob = torch.ones(256 << 20, dtype=torch.uint8)  # 256 MiB resident before the trial
    blob.add_(1)
    before = meter.peak_bytes("cpu")
    del blob
    m = train_trial(TrialSettings(**SIZE, steps=1, warmup=0), {"batch_size": 2})
    assert meter.rss_bytes() <= m["peak_memory_bytes"]
    assert m["peak_memory_bytes"] < before or not meter.reset_peak("cpu")
