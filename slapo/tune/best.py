"""The best schedule `slapo tune` finds for one GPU model, in a bounded time.

`slapo tune --space gpu` (the CLI) and `benchmarks/gpu_train.py`'s `slapo_tuned` row share
this module, so the row is what the tuner does and not a copy of it:

* `gpu_search_setup(spec, space_args, ...)`: the GPU space of one model, its cost model and its
  trial evaluator (the CLI's `--space gpu` setup; the benchmark passes its own models' specs).
* `predict_configs(spec, configs, workers=...)`: the cost model over a list of configs, in
  parallel processes. Why: one prediction is a fake training step of the whole model (10-60 s
  for the 1.1B model on one CPU core), and a benchmark call has minutes, not hours.
* `restrict(space, {"compile_blocks": (True,)})`: keep only some candidates of a space's knobs
  (the GPU space's own candidate lists are fixed; a constraint narrows them without a second
  space function).
* `seed_database(db, space, measured)`: measurements taken elsewhere (e.g. the benchmark's
  `slapo_gpu` row of the same run) enter the trial database as finished trials, so the guided
  search starts from them instead of measuring them again.
* `tune_best(space, predictions, evaluate, db, ...)`: `driver.tune`'s guided search with at most
  `max_trials` new measured trials and a wall-clock budget (a trial that could not finish
  before the budget ends is not started), returning the winner with its prediction.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .database import Database, Record
from .driver import OBJECTIVE, TrialBudgetExhausted, TuneReport, tune
from .space import Config, Space, config_key

__all__ = ["BestSchedule", "GPUSearch", "gpu_search_setup", "predict_configs", "restrict",
           "seed_database", "tune_best"]

# Imported once by the trials' forkserver (no CUDA is initialised by importing them), so a
# trial starts without re-importing torch, transformers and the model code.
_PRELOAD = ("slapo.tune.evaluators", "slapo.model_schedule", "slapo.runtime.build",
            "transformers")


@dataclass
class GPUSearch:
    """What a GPU search needs: the space, the cost model, the trial evaluator, and the
    settings (for `results.json`)."""

    space: Space
    predict: Any  # GPUCostModel
    evaluate: Any  # GPUTrialEvaluator
    meta: dict


def gpu_search_setup(spec: Any, space_args: Any, *, device: str = "cuda", steps: int = 3,
                     warmup: int = 1, mem_cap_bytes: int | None = None, seed: int = 0,
                     trial_timeout: float = 600.0, efficiency: float = 1.0,
                     start_method: str = "spawn", prune: bool = True) -> GPUSearch:
    """The GPU space of `spec` (a `model_spaces.GPUModelSpec`) with `space_args`
    (`GPUSpaceArgs`); its `GPUCostModel` and a `GPUTrialEvaluator` (one process per trial,
    a peak above `mem_cap_bytes` is `oom`) for `device`.

    `prune`: configs the cost model predicts above `mem_cap_bytes` are not enumerated (each
    enumeration then predicts every config in this process). `tune_best` prunes on
    precomputed predictions instead (its `mem_cap`), so the benchmark passes `prune=False`."""
    from .evaluators import GPUTrialEvaluator, GPUTrialSettings
    from .model_spaces import gpu_space
    from .predict_gpu import GPUCostModel

    predict = GPUCostModel(spec, efficiency=efficiency)
    if mem_cap_bytes and prune:
        space_args = replace(space_args, fits=lambda c: predict(c)["memory"] <= mem_cap_bytes)
    settings = GPUTrialSettings(model=spec.name, device=device, steps=steps,
                                warmup=max(warmup, 1), mem_cap_bytes=mem_cap_bytes, seed=seed)
    evaluate = GPUTrialEvaluator(settings, trial_timeout, start_method=start_method, spec=spec,
                                 preload=_PRELOAD)
    meta = {"model": spec.name, "space": "gpu", "settings": settings.to_json(),
            "calibration": predict.device.to_json(), "efficiency": efficiency}
    return GPUSearch(gpu_space(spec, space_args), predict, evaluate, meta)


def restrict(space: Space, keep: Mapping[str, Sequence[Any]]) -> Space:
    """Keep only the configs whose knob `name` is one of `keep[name]` (a knob a config does
    not have, e.g. `ckpt_policy` without checkpointing, passes). Returns `space`."""
    for name, vals in keep.items():
        allowed = {config_key({"v": v}) for v in vals}
        space.add_constraint(
            lambda c, n=name, a=allowed: n not in c or config_key({"v": c[n]}) in a,
            f"{name} in {list(vals)}")
    return space


# ------------------------------------------------------------------------------------------------
# predictions, in parallel processes
# ------------------------------------------------------------------------------------------------

def _predict_one(spec: Any, efficiency: float, config: Config) -> dict:
    from .predict_gpu import GPUCostModel

    return GPUCostModel(spec, efficiency=efficiency).predict(config)


def _quiet_worker(nice: int) -> None:
    """A prediction worker: one torch thread, lowered priority (it may run beside a measured
    GPU step, which must keep its CPU)."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    if nice:
        os.nice(nice)


def predict_configs(spec: Any, configs: Iterable[Config], *, efficiency: float = 1.0,
                    workers: int = 1, nice: int = 0,
                    on_result: Callable[[Config, dict], None] | None = None) -> dict[str, dict]:
    """{config_key: prediction} of `GPUCostModel(spec, efficiency)` for every config.

    `workers > 1` predicts in that many spawned processes (each prediction is an independent
    fake step); `on_result(config, prediction)` is called as each one lands (the benchmark
    appends it to a file that the tuning process reads)."""
    configs = list(configs)
    out: dict[str, dict] = {}
    if workers <= 1 or len(configs) <= 1:
        model = None
        for c in configs:
            if model is None:
                from .predict_gpu import GPUCostModel

                model = GPUCostModel(spec, efficiency=efficiency)
            out[config_key(c)] = p = model.predict(c)
            if on_result is not None:
                on_result(c, p)
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(min(workers, len(configs)), mp_context=mp.get_context("spawn"),
                             initializer=_quiet_worker, initargs=(nice,)) as pool:
        futures = {pool.submit(_predict_one, spec, efficiency, c): c for c in configs}
        for fut in as_completed(futures):
            c = futures[fut]
            out[config_key(c)] = p = fut.result()
            if on_result is not None:
                on_result(c, p)
    return out


# ------------------------------------------------------------------------------------------------
# seeding and the bounded search
# ------------------------------------------------------------------------------------------------

def seed_database(db: Database, space: Space,
                  measured: Iterable[tuple[Config, dict]]) -> list[Config]:
    """Commit (config, metrics) measured elsewhere as finished trials of `space`; returns the
    configs that entered. A config enters only when it is exactly one of the space's configs
    once the knobs it does not name take `model_schedule.apply`'s defaults (a row measured with
    another knob set is not this space's config) and the database has no trial of it yet.
    `metrics` must hold the objective (`throughput`, tokens/s)."""
    from .model_spaces import apply_knobs

    defaults = apply_knobs()
    keys = {config_key(c): c for c in space.configs()}
    entered = []
    for given, metrics in measured:
        full = space.complete(given)
        if full is None or config_key(full) not in keys or db.get(full) is not None:
            continue
        if any(full[k] != given.get(k, defaults.get(k)) for k in full):
            continue  # a knob the row did not set took a non-default value
        if any(full.get(k, defaults.get(k)) != v for k, v in given.items()):
            continue  # the row set a knob the space lacks (e.g. fuse) or another value
        db.commit(Record(full, "ok", dict(metrics), "", {}, 0.0))
        entered.append(full)
    return entered


@dataclass
class BestSchedule:
    """The winner of `tune_best` and how it was found. `config` is None when no trial
    succeeded. `seeded` is True when the winner is a measurement that was seeded, not a trial
    of this search."""

    config: Config | None
    measured: dict
    predicted: dict
    seeded: bool
    report: TuneReport
    tune_s: float
    trials: list[dict] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "measured": _scalars(self.measured),
                "predicted": _scalars(self.predicted), "seeded": self.seeded,
                "space_size": self.report.space_size, "new_trials": self.report.new_trials,
                "stopped_because": self.report.stopped_because, "tune_s": self.tune_s,
                "trials": self.trials}


def _scalars(d: dict) -> dict:
    return {k: v for k, v in d.items() if isinstance(v, (int, float, str, bool))}


def _bounded(evaluate: Callable[[Config], Any], deadline: float | None,
             min_trial_s: float) -> Callable[[Config], Any]:
    """`evaluate` that starts no trial with less than `min_trial_s` left before `deadline`
    (it stops the search the way `max_trials` does) and gives each trial at most the time left
    (an evaluator with a `timeout_s` attribute gets it lowered per trial)."""
    if deadline is None:
        return evaluate

    def run(config: Config) -> Any:
        left = deadline - time.perf_counter()
        if left < min_trial_s:
            raise TrialBudgetExhausted(f"tuning budget ({left:.0f} s left)")
        inner = getattr(evaluate, "inner", evaluate)
        if not hasattr(inner, "timeout_s"):
            return evaluate(config)
        full = inner.timeout_s
        inner.timeout_s = min(full, left)
        try:
            return evaluate(config)
        finally:  # the evaluator may be reused: its own limit is lowered for this trial only
            inner.timeout_s = full

    return run


def tune_best(space: Space, predictions: Mapping[str, dict], evaluate: Callable[[Config], Any],
              db: Database, *, mem_cap: float | None = None, max_trials: int = 3,
              budget_s: float | None = None, min_trial_s: float = 10.0,
              kappa: float = 2.0) -> BestSchedule:
    """`driver.tune`'s guided search over `space` ranked by `predictions` ({config_key:
    prediction}, e.g. from `predict_configs`), with at most `max_trials` new trials and, with
    `budget_s`, no trial started after the budget (minus `min_trial_s`) is spent.

    What is already in `db` (earlier runs, `seed_database`) counts as measured. The winner is
    the best measured config (`TuneReport.best`), with its prediction."""
    t0 = time.perf_counter()
    deadline = None if budget_s is None else t0 + budget_s
    seeded = {config_key(r.config) for r in db.records()}
    report = tune(space, _bounded(evaluate, deadline, min_trial_s),
                  functools.partial(_lookup, predictions), db, "guided", mem_cap=mem_cap,
                  max_trials=max_trials, kappa=kappa, confirm=0)
    best = report.best
    trials = [_trial_json(r, predictions, config_key(r.config) in seeded) for r in report.records]
    if best is None:
        return BestSchedule(None, {}, {}, False, report, time.perf_counter() - t0, trials)
    key = config_key(best.config)
    return BestSchedule(best.config, best.metrics, predictions[key], key in seeded, report,
                        time.perf_counter() - t0, trials)


def _lookup(predictions: Mapping[str, dict], config: Config) -> dict:
    key = config_key(config)
    if key not in predictions:
        raise ValueError(f"no prediction for config {config!r}; predict every config of the "
                         "space first (predict_configs).")
    return predictions[key]


def _trial_json(r: Record, predictions: Mapping[str, dict], seeded: bool) -> dict:
    p = predictions.get(config_key(r.config), {})
    return {"config": r.config, "status": r.status, "seeded": seeded,
            "throughput": r.metrics.get(OBJECTIVE),
            "peak_memory_bytes": r.metrics.get("peak_memory_bytes"),
            "predicted_throughput": p.get(OBJECTIVE), "predicted_memory": p.get("memory"),
            "elapsed_s": r.elapsed_s, "error": r.error.strip().splitlines()[-1][:200]
            if r.error.strip() else ""}
