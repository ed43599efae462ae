"""Search algorithms over a `Space`.

Plug points (kept deliberately small so model schedules and the CLI can be added later):

* `evaluate(config) -> metrics dict | TrialResult` runs one trial. Use
  `CallableEvaluator` / `CommandEvaluator` for isolation; a plain
  function is called in-process and an exception becomes a failed trial.
* `predict(config) -> metrics dict` is the cost model (e.g. built on `slapo.tune.cost`).
  It must return the objective; it may also return `memory` (bytes), which the guided search
  compares with `mem_cap` to prune configs that will not fit.

Every trial goes through the `Database` first, so a re-run (after a
crash or Ctrl-C) skips what was already measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .database import Database, Record
from .runner import CallableEvaluator, CommandEvaluator, InProcessEvaluator, TrialResult
from .space import Config, Space, config_key

Evaluate = Callable[[Config], Any]
Predict = Callable[[Config], dict]


@dataclass
class SearchResult:
    """Outcome of one search call."""

    best: Record | None
    records: list[Record]  # every config this search looked at, in order (cached ones included)
    new_trials: int  # trials actually run by this call (not served from the database)
    num_configs: int  # size of the space
    stopped_because: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def trial_fraction(self) -> float:
        """Fraction of the space that was measured (from this call and earlier ones)."""
        return len(self.records) / max(self.num_configs, 1)


class _Trials:
    """Database-backed trial runner shared by all algorithms."""

    def __init__(self, evaluate: Evaluate, db: Database | None, objective: str, maximize: bool,
                 on_trial: Callable[[Record], None] | None):
        if not callable(evaluate):
            raise ValueError(f"evaluate must be callable, got {evaluate!r}.")
        self.evaluate = evaluate
        self.db = db if db is not None else Database()
        self.objective, self.sign = objective, (1.0 if maximize else -1.0)
        self.on_trial = on_trial
        self.seen: dict[str, Record] = {}
        self.new_trials = 0

    def run(self, config: Config, predicted: dict | None = None) -> Record:
        key = config_key(config)
        if key in self.seen:
            return self.seen[key]
        rec = self.db.get(config)
        if rec is None:
            res = self.evaluate(config)
            if isinstance(res, dict):
                res = TrialResult("ok", res)
            elif not isinstance(res, TrialResult):
                raise ValueError(
                    f"evaluate returned {type(res).__name__}; expected a metrics dict or TrialResult."
                )
            if res.status == "ok" and self.objective not in res.metrics:
                res = TrialResult("failed", res.metrics,
                                  f"metrics lack the objective {self.objective!r}", res.elapsed_s)
            rec = Record(config, res.status, res.metrics, res.error, predicted or {}, res.elapsed_s)
            self.db.commit(rec)
            self.new_trials += 1
            if self.on_trial is not None:
                self.on_trial(rec)
        self.seen[key] = rec
        return rec

    def score(self, rec: Record) -> float:
        """Signed objective: larger is better; failed trials are -inf."""
        if not rec.ok:
            return -math.inf
        return self.sign * float(rec.metrics[self.objective])

    def best(self) -> Record | None:
        ok = [r for r in self.seen.values() if r.ok]
        return max(ok, key=self.score) if ok else None

    def result(self, num_configs: int, why: str, **extra: Any) -> SearchResult:
        return SearchResult(self.best(), list(self.seen.values()), self.new_trials, num_configs,
                            why, extra)


def _wrap(evaluate: Evaluate) -> Evaluate:
    """Plain functions run in-process with exceptions turned into failed trials."""
    if isinstance(evaluate, (InProcessEvaluator, CallableEvaluator, CommandEvaluator)):
        return evaluate
    return InProcessEvaluator(evaluate)


def exhaustive(space: Space, evaluate: Evaluate, db: Database | None = None,
               objective: str = "throughput", maximize: bool = True,
               on_trial: Callable[[Record], None] | None = None) -> SearchResult:
    """Measure every valid config (the ground truth the other searches are judged against)."""
    trials = _Trials(_wrap(evaluate), db, objective, maximize, on_trial)
    configs = space.configs()
    for c in configs:
        trials.run(c)
    return trials.result(len(configs), "exhausted")


def coordinate_descent(space: Space, evaluate: Evaluate, db: Database | None = None,
                       objective: str = "throughput", maximize: bool = True,
                       start: Config | None = None, max_rounds: int = 10,
                       on_trial: Callable[[Record], None] | None = None) -> SearchResult:
    """Slapo-style tuning: sweep one knob at a time holding the others, move to the best, repeat.

    Conditional symbols are repaired after each move with `Space.complete` (turning
    `checkpoint` on brings `ckpt_ratio` in at its first candidate). Stops after a round that
    does not improve, or after `max_rounds`.
    """
    trials = _Trials(_wrap(evaluate), db, objective, maximize, on_trial)
    configs = space.configs()
    if not configs:
        raise ValueError("the search space is empty (every config violates a constraint).")
    cur = space.complete(start or {})
    if cur is None:
        raise ValueError(f"start config {start!r} violates the space's constraints.")
    names = space.names()
    cands = {n: space.candidates(n) for n in names}
    best_score = trials.score(trials.run(cur))
    for _ in range(max_rounds):
        improved = False
        for name in names:
            for v in cands[name]:
                nxt = space.complete({**cur, name: v})
                if nxt is None:
                    continue
                s = trials.score(trials.run(nxt))
                if s > best_score:
                    cur, best_score, improved = nxt, s, True
        if not improved:
            return trials.result(len(configs), "converged")
    return trials.result(len(configs), "max_rounds")


class _Correction:
    """Measured ≈ predicted × exp(w0 + Σ w[knob=value]), a Bayesian ridge fit, plus uncertainty.

    Log-space so the correction is a per-knob *factor*: a cost model that misprices, say,
    recomputation gets that knob's factor fixed after a few trials. The ridge prior pulls
    unmeasured knob values to "no correction", and the posterior standard deviation
    `sd(x) = s·sqrt(xᵀ(XᵀX + λI)⁻¹x)` is large for configs whose knob values were never
    measured, so the search stays optimistic about them (an upper confidence bound) instead of
    trusting a correction learnt elsewhere. Objectives must be positive (throughput, time);
    otherwise the correction is additive with the same features.
    """

    def __init__(self, configs: list[Config], ridge: float, prior_sd: float):
        self.cols: dict[str, int] = {}
        for c in configs:
            for k, v in c.items():
                self.cols.setdefault(config_key({k: v}), len(self.cols) + 1)
        n = len(self.cols) + 1
        self.ridge, self.prior_sd = ridge, prior_sd
        self.w = np.zeros(n)
        self.a_inv = np.eye(n) / ridge
        self.log = True
        self.sd = prior_sd

    def features(self, c: Config) -> np.ndarray:
        x = np.zeros(len(self.cols) + 1)
        x[0] = 1.0
        for k, v in c.items():
            x[self.cols[config_key({k: v})]] = 1.0
        return x

    def fit(self, pairs: list[tuple[Config, float, float]]) -> None:
        from scipy.linalg import solve

        if not pairs:
            return
        self.log = all(p > 0 and m > 0 for _, p, m in pairs)
        X = np.stack([self.features(c) for c, _, _ in pairs])
        y = np.array([math.log(m / p) if self.log else m - p for _, p, m in pairs])
        a = X.T @ X + self.ridge * np.eye(X.shape[1])
        self.w = solve(a, X.T @ y, assume_a="pos")
        self.a_inv = np.linalg.inv(a)
        resid = y - X @ self.w
        dof = max(len(pairs) - 1, 1)
        self.sd = max(self.prior_sd, float(np.sqrt(resid @ resid / dof)))

    def __call__(self, c: Config, pred: float, kappa: float = 0.0) -> float:
        """Corrected prediction, shifted `kappa` standard deviations towards "better"."""
        x = self.features(c)
        z = float(x @ self.w) + kappa * self.sd * math.sqrt(float(x @ self.a_inv @ x))
        return pred * math.exp(z) if self.log else pred + z


def guided_search(space: Space, evaluate: Evaluate, predict: Predict, db: Database | None = None,
                  objective: str = "throughput", maximize: bool = True,
                  mem_cap: float | None = None, batch: int = 1, min_trials: int = 3,
                  max_trials: int | None = None, kappa: float = 2.0, prior_sd: float = 0.05,
                  ridge: float = 1.0,
                  on_trial: Callable[[Record], None] | None = None) -> SearchResult:
    """Cost-model-guided search: predict everything, measure only the promising configs.

    1. `predict` every config (cheap), drop those whose predicted `memory` exceeds
       `mem_cap`.
    2. Repeatedly measure the `batch` configs with the best optimistic corrected prediction
       (corrected by `_Correction`, plus `kappa` posterior standard deviations, so knob
       values the measurements say nothing about still get tried), then refit the correction and
       the memory scale (an OOM at predicted memory m means configs predicted at ≥ m will not fit
       either; a measured `peak_memory_bytes` above prediction scales all predictions up).
    3. Stop when even the optimistic prediction of every remaining config cannot beat the
       measured best.

    `prior_sd` is the expected relative error of the cost model (0.05 = 5%).
    """
    trials = _Trials(_wrap(evaluate), db, objective, maximize, on_trial)
    configs = space.configs()
    if not configs:
        raise ValueError("the search space is empty (every config violates a constraint).")
    preds: list[dict] = []
    for c in configs:
        p = predict(c)
        if not isinstance(p, dict) or objective not in p:
            raise ValueError(f"predict({c!r}) returned {p!r}; it must return a dict with {objective!r}.")
        preds.append(p)
    sign = 1.0 if maximize else -1.0
    corr = _Correction(configs, ridge, prior_sd)
    mem_scale = 1.0
    limit = max_trials if max_trials is not None else len(configs)
    why = "exhausted"
    keys = [config_key(c) for c in configs]
    pred_by_key = dict(zip(keys, preds))
    for c in configs:  # on resume, everything already measured informs the model at once
        if trials.db.get(c) is not None:
            trials.run(c)

    def refit() -> None:
        nonlocal mem_scale
        pairs, peak_ratios, oom_bound = [], [], 0.0
        for r in trials.seen.values():
            p = pred_by_key[config_key(r.config)]
            if r.ok:
                pairs.append((r.config, float(p[objective]), float(r.metrics[objective])))
            if mem_cap and float(p.get("memory", 0)) > 0:
                if r.status == "oom":
                    oom_bound = max(oom_bound, mem_cap / float(p["memory"]) * (1 + 1e-9))
                elif r.ok and "peak_memory_bytes" in r.metrics:
                    peak_ratios.append(float(r.metrics["peak_memory_bytes"]) / float(p["memory"]))
        # measured peaks calibrate the memory model both ways; an OOM is a hard lower bound
        mem_scale = max(max(peak_ratios) if peak_ratios else 1.0, oom_bound)
        corr.fit(pairs)

    while True:
        refit()
        fits = [
            i for i, k in enumerate(keys)
            if k not in trials.seen
            and not (mem_cap and "memory" in preds[i] and preds[i]["memory"] * mem_scale > mem_cap)
        ]
        if not fits:
            why = "no promising configs left"
            break
        k = sign * kappa  # "optimistic" means larger for maximise, smaller for minimise
        scored = sorted(((sign * corr(configs[i], float(preds[i][objective]), k), i) for i in fits),
                        reverse=True)
        best = trials.best()
        if best is not None and len(trials.seen) >= min_trials and scored[0][0] <= trials.score(best):
            why = "predicted best cannot beat measured best"
            break
        if len(trials.seen) >= limit:
            why = "max_trials"
            break
        for _, i in scored[: max(1, min(batch, limit - len(trials.seen)))]:
            trials.run(configs[i], preds[i])
    return trials.result(len(configs), why, mem_scale=mem_scale)
