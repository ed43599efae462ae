"""``slapo tune``: search a model schedule's knobs with measured trials and the cost model.

    slapo tune --model gpt2 --algorithm guided --out runs/tune-gpt2
    slapo tune --model gpt2 --algorithm exhaustive --db runs/tune-gpt2/tune.db --memory-cap 3G

Every trial is committed to the SQLite database (``--db``, default ``OUT/tune.db``) as soon as
it ends, so a run that was interrupted (Ctrl-C, ``--max-trials``, a killed job) continues where
it stopped when started again with the same ``--db``. The run writes to ``--out``:
``results.json`` (settings, every trial with its prediction, the top configurations),
``top.txt`` (the table that is also printed) and ``search.png`` (predicted vs measured per trial,
and the measured throughput in trial order).

:func:`tune` is the same pipeline for any space, ``evaluate`` and ``predict`` (the tests use it
with trial functions that crash or blow the memory cap).
"""

from __future__ import annotations

import argparse
import io
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .database import Database, Record
from .runner import TrialResult
from .space import Config, Space, config_key

ALGORITHMS = ("guided", "exhaustive", "coordinate")
OBJECTIVE = "throughput"


class TrialBudgetExhausted(BaseException):
    """Raised by the budget wrapper after ``--max-trials`` new trials.

    A BaseException, like KeyboardInterrupt, so the searches' in-process evaluator does not
    record it as a failed trial: it stops the search the way Ctrl-C does, and the run resumes
    from the database.
    """


@dataclass
class TuneReport:
    """What :func:`tune` did; ``to_json`` is what lands in ``results.json``."""

    algorithm: str
    space_size: int
    records: list[Record]
    predictions: dict[str, dict]
    new_trials: int
    stopped_because: str
    interrupted: bool
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def ok_records(self) -> list[Record]:
        return sorted((r for r in self.records if r.ok),
                      key=lambda r: -float(r.metrics[OBJECTIVE]))

    @property
    def best(self) -> Record | None:
        ok = self.ok_records()
        return ok[0] if ok else None

    def to_json(self, top: int = 10) -> dict[str, Any]:
        trials = [_record_json(i, r, self.predictions.get(config_key(r.config), {}))
                  for i, r in enumerate(self.records)]
        best = self.best
        return {
            "algorithm": self.algorithm,
            "objective": OBJECTIVE,
            "space_size": self.space_size,
            "trials_total": len(self.records),
            "trials_run_now": self.new_trials,
            "trial_fraction": len(self.records) / max(self.space_size, 1),
            "status_counts": _status_counts(self.records),
            "stopped_because": self.stopped_because,
            "interrupted": self.interrupted,
            "elapsed_s": self.elapsed_s,
            "best": None if best is None else _record_json(
                self.records.index(best), best, self.predictions.get(config_key(best.config), {})),
            "top": [t for t in sorted((t for t in trials if t["status"] == "ok"),
                                      key=lambda t: -t["metrics"][OBJECTIVE])][:top],
            "trials": trials,
            **self.extra,
        }


def _record_json(order: int, r: Record, predicted: dict) -> dict[str, Any]:
    return {"order": order, "config": r.config, "status": r.status, "metrics": r.metrics,
            "predicted": predicted or r.predicted, "error": r.error[-2000:],
            "elapsed_s": r.elapsed_s}


def _status_counts(records: list[Record]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[r.status] = out.get(r.status, 0) + 1
    return out


# ---------------------------------------------------------------------------------- pipeline
def _budget(evaluate: Callable[[Config], Any], max_trials: int | None) -> Callable[[Config], Any]:
    """``evaluate`` that stops the search (like Ctrl-C) once ``max_trials`` new trials ran."""
    if max_trials is None:
        return evaluate
    count = 0

    def run(config: Config) -> Any:
        nonlocal count
        if count >= max_trials:
            raise TrialBudgetExhausted(f"{max_trials} new trials")
        count += 1
        return evaluate(config)

    return run


def _space_records(space_configs: list[Config], db: Database) -> list[Record]:
    """This space's records in the order they were measured (other spaces' rows are ignored)."""
    keys = {config_key(c) for c in space_configs}
    return [r for r in db.records() if config_key(r.config) in keys]


def tune(space: Space, evaluate: Callable[[Config], Any], predict: Callable[[Config], dict] | None,
         db: Database, algorithm: str = "guided", mem_cap: float | None = None,
         max_trials: int | None = None, kappa: float = 2.0,
         on_trial: Callable[[Record], None] | None = None, confirm: int = 0,
         repeats: int = 2) -> TuneReport:
    """Run one search over ``space``; Ctrl-C and ``max_trials`` end it early but cleanly.

    ``predict`` is required for ``guided``; for the other algorithms it only annotates the
    report (predicted vs measured). Every trial lands in ``db`` before the next one starts.
    ``confirm`` > 0 re-measures the best ``confirm`` configs ``repeats`` more times after the
    search and ranks them by the median (see :func:`confirm_best`).
    """
    from . import search

    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}.")
    if algorithm == "guided" and predict is None:
        raise ValueError("the guided search needs a predict(config) cost model.")
    configs = space.configs()
    predictions = {config_key(c): predict(c) for c in configs} if predict is not None else {}
    run = _budget(evaluate, max_trials)
    t0 = time.perf_counter()
    before = len(_space_records(configs, db))
    why, interrupted, extra = "", False, {}
    try:
        if algorithm == "guided":
            res = search.guided_search(space, run, lambda c: predictions[config_key(c)], db,
                                       mem_cap=mem_cap, kappa=kappa, on_trial=on_trial)
            extra = {k: v for k, v in res.extra.items() if isinstance(v, (int, float, str))}
        elif algorithm == "exhaustive":
            res = search.exhaustive(space, run, db, on_trial=on_trial)
        else:
            res = search.coordinate_descent(space, run, db, on_trial=on_trial)
        why = res.stopped_because
    except TrialBudgetExhausted as e:
        why, interrupted = f"max_trials ({e}); run again with the same --db to resume", True
    except KeyboardInterrupt:
        why, interrupted = "interrupted; run again with the same --db to resume", True
    if confirm > 0 and not interrupted:
        try:
            extra["confirm_runs"] = confirm_best(_space_records(configs, db), search._wrap(evaluate), db,
                                                 confirm, repeats)
        except KeyboardInterrupt:
            why, interrupted = "interrupted while confirming; run again to resume", True
    records = _space_records(configs, db)
    return TuneReport(algorithm, len(configs), records, predictions, len(records) - before, why,
                      interrupted, time.perf_counter() - t0, extra)


def confirm_best(records: list[Record], evaluate: Callable[[Config], Any], db: Database,
                 top: int, repeats: int) -> int:
    """Re-measure the ``top`` best configs ``repeats`` more times; their objective becomes the
    median. Returns the number of extra runs.

    Why: on a shared machine one timing is off by ~5%, and the best of many noisy
    measurements is biased towards a lucky one (the winner's curse). A simulation on the
    measured GPT-2 space with 5% noise found that guided search alone missed the optimum by
    more than 5% in 1-28% of runs, depending on ``prior_sd``. With the top 3 confirmed twice it
    never did (0/200), and single-pass exhaustive search missed in 42/200. The first value and
    every sample are kept (``<objective>_samples``). A config that already has its samples is
    not measured again, so a resumed run does not repeat this.
    """
    ok = sorted((r for r in records if r.ok), key=lambda r: -float(r.metrics[OBJECTIVE]))[:top]
    key = f"{OBJECTIVE}_samples"
    todo = [r for r in ok if len(r.metrics.get(key, [])) < repeats + 1]
    samples = {config_key(r.config): [float(r.metrics[OBJECTIVE])] for r in todo}
    runs = 0
    for _ in range(repeats):
        for r in todo:  # interleaved, so a slow spell of the machine hits every finalist
            res = evaluate(r.config)
            runs += 1
            if isinstance(res, dict):
                res = TrialResult("ok", res)
            if res.status == "ok" and OBJECTIVE in res.metrics:
                samples[config_key(r.config)].append(float(res.metrics[OBJECTIVE]))
    for r in todo:
        got = samples[config_key(r.config)]
        metrics = {**r.metrics, key: got, f"{OBJECTIVE}_first": got[0],
                   OBJECTIVE: statistics.median(got)}
        db.commit(Record(r.config, r.status, metrics, r.error, r.predicted, r.elapsed_s))
    return runs


# ---------------------------------------------------------------------------------- outputs
def _fmt_bytes(n: Any) -> str:
    return "-" if n is None else f"{float(n) / 2**20:,.0f} MiB"


def top_table(report: TuneReport, top: int = 10, title: str | None = None) -> Any:
    """A rich Table of the best configurations, with their predictions and the failures."""
    from rich.table import Table

    ok = report.ok_records()
    knobs = list(dict.fromkeys(k for r in report.records for k in r.config))
    t = Table(title=title or f"slapo tune: top {min(top, len(ok))} of {len(report.records)} "
              f"trials ({report.algorithm}, space of {report.space_size})")
    t.add_column("#", justify="right")
    for k in knobs:
        t.add_column(k)
    for col in ("tokens/s", "vs best", "peak mem", "pred tokens/s", "pred mem"):
        t.add_column(col, justify="right")
    best = float(ok[0].metrics[OBJECTIVE]) if ok else math.nan
    for i, r in enumerate(ok[:top]):
        p = report.predictions.get(config_key(r.config), r.predicted)
        thr = float(r.metrics[OBJECTIVE])
        t.add_row(str(i + 1), *[str(r.config.get(k, "-")) for k in knobs], f"{thr:,.0f}",
                  f"{thr / best:.2f}", _fmt_bytes(r.metrics.get("peak_memory_bytes")),
                  f"{p[OBJECTIVE]:,.0f}" if OBJECTIVE in p else "-", _fmt_bytes(p.get("memory")))
    bad = _status_counts([r for r in report.records if not r.ok])
    if bad:
        t.caption = "not ok: " + ", ".join(f"{n} {s}" for s, n in sorted(bad.items()))
    return t


def plot_search(report: TuneReport, path: str | Path) -> Path:
    """PNG: predicted vs measured throughput per trial, and measured throughput in trial order.

    Failed trials sit at the bottom of both panels as red crosses, so a search that spent its
    budget on crashes is visible at a glance.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    order = list(range(len(report.records)))
    meas = [float(r.metrics[OBJECTIVE]) if r.ok else math.nan for r in report.records]
    pred = [float(report.predictions.get(config_key(r.config), r.predicted).get(OBJECTIVE, math.nan))
            for r in report.records]
    ok = [i for i in order if report.records[i].ok]
    failed = [i for i in order if not report.records[i].ok]
    floor = min([m for m in meas if m == m] or [1.0]) * 0.9
    if ok:
        sc = ax1.scatter([pred[i] for i in ok], [meas[i] for i in ok], c=ok, cmap="viridis")
        fig.colorbar(sc, ax=ax1, label="trial #")
    if failed:
        ax1.scatter([pred[i] for i in failed], [floor] * len(failed), marker="x", c="red",
                    label="failed / oom / timeout")
        ax1.legend(loc="lower right")
    ax1.set_xlabel("predicted tokens/s (cost model)")
    ax1.set_ylabel("measured tokens/s")
    ax1.set_title("predicted vs measured")
    best_so_far, cur = [], -math.inf
    for m in meas:
        cur = max(cur, m) if m == m else cur
        best_so_far.append(cur if cur > -math.inf else math.nan)
    ax2.plot(order, meas, "o", label="measured")
    ax2.step(order, best_so_far, where="post", label="best so far")
    if failed:
        ax2.plot(failed, [floor] * len(failed), "x", color="red", label="not ok")
    ax2.set_xlabel("trial #")
    ax2.set_ylabel("tokens/s")
    ax2.set_title(f"{report.algorithm}: {len(report.records)} of {report.space_size} configs")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_outputs(report: TuneReport, out: str | Path, top: int = 10,
                  meta: dict[str, Any] | None = None, console: Any = None) -> dict[str, Path]:
    """results.json, top.txt and search.png under ``out``; prints the table to ``console``."""
    from rich.console import Console

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {**(meta or {}), **report.to_json(top)}
    paths = {"json": out / "results.json", "table": out / "top.txt", "plot": out / "search.png"}
    paths["json"].write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    table = top_table(report, top)
    text = Console(record=True, width=160, file=io.StringIO())
    text.print(table)
    paths["table"].write_text(text.export_text())
    (console or Console()).print(table)
    try:
        plot_search(report, paths["plot"])
    except ImportError:  # matplotlib is the optional `plot` extra; the rest is still useful
        (console or Console()).print("matplotlib is not installed: no search.png "
                                     "(pip install 'slapo[plot]').", markup=False)
        del paths["plot"]
    return paths


# ---------------------------------------------------------------------------------- CLI
def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    return parse


_ONOFF = {"both": (False, True), "on": (True,), "off": (False,)}


def add_tune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``tune`` subcommand to a ``slapo`` subparsers object."""
    p = subparsers.add_parser(
        "tune", help="search schedule knobs with measured trials and the cost model",
        description="Search a model's schedule knobs (batch size x attention x checkpoint ratio "
        "x fuse x Tempo): each trial trains a few steps in its own process; the guided search "
        "measures only what the cost model ranks as promising. Resumable from --db.")
    a = p.add_argument
    a("--space", choices=("cpu", "gpu"), default="cpu",
      help="cpu: the CPU space (batch x attention x ckpt x fuse x Tempo on a small model); gpu: "
      "precision x compile_blocks x fused_loss x kernels x ckpt_ratio/ckpt_policy x attention x "
      "batch of a benchmark model, trained through slapo.build(...).train_step (default: cpu)")
    a("--model", default=None, help="cpu space: model family (default: gpt2); gpu space: "
      "a model of slapo.tune.spaces.GPU_MODELS (default: llama-1b)")
    a("--device", default="cuda", help="gpu space: trial device (default: cuda)")
    a("--mem-cap-gib", type=float, default=None, metavar="GIB",
      help="gpu space: peak allocated memory per trial; configs the cost model predicts above "
      "it are not enumerated, and trials above it count as oom")
    a("--precisions", type=_csv(str), default=("fp32", "bf16"), metavar="P,..",
      help="gpu space: mixed_precision values (default: fp32,bf16)")
    a("--efficiency", type=float, default=1.0,
      help="gpu space: roofline efficiency of the time model (default: 1.0; see docs/tune.md "
      "for the values calibrated on the H100)")
    a("--algorithm", choices=ALGORITHMS, default="guided", help="search (default: guided)")
    a("--out", default="runs/tune", help="output directory (default: runs/tune)")
    a("--db", default=None, help="trial database, resumable (default: OUT/tune.db)")
    a("--trial-timeout", type=float, default=600.0, metavar="S",
      help="seconds per trial before it is killed and marked timeout (default: 600)")
    a("--memory-cap", default=None, metavar="SIZE",
      help="peak RSS per trial, e.g. 3G; above it a trial is oom (default: none)")
    a("--steps", type=int, default=3, help="measured training steps per trial (default: 3)")
    a("--warmup", type=int, default=1, help="unmeasured steps before them (default: 1)")
    a("--batch-sizes", type=_csv(int), default=(2, 4, 8), metavar="B,..",
      help="batch sizes (default: 2,4,8)")
    a("--ckpt-ratios", type=_csv(float), default=(0.0, 0.5, 1.0), metavar="R,..",
      help="checkpoint ratios (default: 0,0.5,1)")
    a("--attention", type=_csv(str), default=("eager", "sdpa"), metavar="A,..",
      help="attention cores (default: eager,sdpa)")
    a("--fuse", choices=sorted(_ONOFF), default="both", help="fuse knob values (default: both)")
    a("--tempo", choices=sorted(_ONOFF), default="both", help="tempo knob values (default: both)")
    a("--fuse-compiler", default="aot_eager",
      help="torch.compile backend of fused regions (default: aot_eager; inductor compiles "
      "take 8-60 s per graph on CPU)")
    a("--hidden-size", type=int, default=768, help="model width (default: 768, GPT-2 small)")
    a("--num-layers", type=int, default=2, help="layers (default: 2)")
    a("--num-heads", type=int, default=12, help="attention heads (default: 12)")
    a("--seq-len", type=int, default=128, help="tokens per sample (default: 128)")
    a("--threads", type=int, default=1, help="torch threads per trial (default: 1)")
    a("--seed", type=int, default=0, help="model init and token seed (default: 0)")
    a("--max-trials", type=int, default=None, help="stop after this many new trials")
    a("--kappa", type=float, default=2.0, help="guided search optimism (default: 2.0)")
    a("--confirm", type=int, default=3, metavar="K",
      help="re-measure the best K configs and rank them by the median (default: 3; 0: off)")
    a("--confirm-repeats", type=int, default=2, metavar="R",
      help="extra measurements per confirmed config (default: 2)")
    a("--top", type=int, default=10, help="rows of the final table (default: 10)")
    a("--calibration", default=None, help="device constants cache (default: OUT/calibration.json)")
    a("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    p.set_defaults(func=run_tune)
    return p


def _settings(args: argparse.Namespace) -> Any:
    from .evaluators import TrialSettings, parse_bytes

    for name in ("steps", "num_layers", "seq_len", "threads", "hidden_size", "num_heads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1.")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0.")
    return TrialSettings(model=args.model, hidden_size=args.hidden_size,
                         num_layers=args.num_layers, num_heads=args.num_heads,
                         seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
                         threads=args.threads, fuse_compiler=args.fuse_compiler,
                         mem_cap_bytes=parse_bytes(args.memory_cap), seed=args.seed)


def _space(args: argparse.Namespace) -> Space:
    from .spaces import SpaceArgs, make_space

    return make_space(args.model, SpaceArgs(
        batch_sizes=tuple(args.batch_sizes), attention=tuple(args.attention),
        ckpt_ratios=tuple(args.ckpt_ratios), fuse=_ONOFF[args.fuse], tempo=_ONOFF[args.tempo],
        num_layers=args.num_layers))


class _Progress:
    """A rich progress bar over the space plus one log line per finished trial."""

    def __init__(self, console: Any, total: int, done: int, enabled: bool):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.console = console
        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                            disable=not enabled, transient=False)
        self.task = self.bar.add_task("trials", total=total, completed=done)

    def __enter__(self) -> _Progress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, rec: Record) -> None:
        from rich.markup import escape

        knobs = " ".join(f"{k}={v}" for k, v in rec.config.items())
        if rec.ok:
            what = (f"{rec.metrics[OBJECTIVE]:,.0f} tokens/s, peak "
                    f"{_fmt_bytes(rec.metrics.get('peak_memory_bytes'))}")
        else:
            err = rec.error.strip().splitlines()[-1][:120] if rec.error.strip() else ""
            what = f"[red]{rec.status}[/red] {escape(err)}"
        self.bar.console.log(f"{escape(knobs)}: {what} ({rec.elapsed_s:.1f} s)")
        self.bar.advance(self.task)


def _gpu_setup(args: argparse.Namespace) -> tuple[Space, Any, Any, dict]:
    """The GPU space, its cost model and its evaluator (``--space gpu``)."""
    from dataclasses import replace

    from .evaluators import GPUTrialEvaluator, GPUTrialSettings
    from .predictors import GPUCostModel
    from .spaces import GPU_MODELS, GPUSpaceArgs, gpu_space

    name = args.model or "llama-1b"
    if name not in GPU_MODELS:
        raise ValueError(f"no GPU model {name!r}; use one of {', '.join(GPU_MODELS)}.")
    spec = GPU_MODELS[name]
    cap = None if not args.mem_cap_gib else int(args.mem_cap_gib * 2**30)
    predict = GPUCostModel(spec, efficiency=args.efficiency)
    batches = tuple(args.batch_sizes) if args.batch_sizes != (2, 4, 8) else \
        (max(spec.batch // 2, 1), spec.batch, 2 * spec.batch)
    attention = tuple(args.attention) if args.attention != ("eager", "sdpa") else ("sdpa",)
    space_args = GPUSpaceArgs(batch_sizes=batches, mixed_precision=tuple(args.precisions),
                              attention=attention, ckpt_ratios=tuple(args.ckpt_ratios),
                              fits=None if cap is None else
                              (lambda c: predict(c)["memory"] <= cap))
    settings = GPUTrialSettings(model=name, device=args.device, steps=args.steps,
                                warmup=max(args.warmup, 1), mem_cap_bytes=cap, seed=args.seed)
    space = gpu_space(spec, replace(space_args))
    evaluate = GPUTrialEvaluator(settings, args.trial_timeout)
    meta = {"model": name, "space": "gpu", "settings": settings.to_json(),
            "calibration": predict.device.to_json(), "efficiency": args.efficiency}
    return space, predict, evaluate, meta


def run_tune(args: argparse.Namespace) -> int:
    """``slapo tune``: returns the exit status (0 ok, 1 nothing measured, 2 bad options, 130 ^C)."""
    if args.space == "gpu":
        return _run_gpu(args)
    args.model = args.model or "gpt2"
    from rich.console import Console

    from .evaluators import TrialEvaluator
    from .predictors import GPT2CostModel

    console = Console(stderr=True)
    try:
        settings = _settings(args)
        space = _space(args)
    except ValueError as e:
        print(f"slapo tune: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    db = Database(args.db or out / "tune.db")
    console.log(f"space: {len(space)} configs of {', '.join(space.names())}; db: {db.path}")
    t0 = time.perf_counter()
    predict = GPT2CostModel(settings, calibration_path=args.calibration or out / "calibration.json")
    console.log(f"cost model ready in {time.perf_counter() - t0:.1f} s "
                f"(GEMM {predict.device.peak_flops / 1e9:.0f} GFLOP/s, "
                f"copy {predict.device.mem_bandwidth / 1e9:.1f} GB/s)")
    evaluate = TrialEvaluator(settings, args.trial_timeout)
    meta = {"model": args.model, "settings": settings.to_json(),
            "calibration": predict.device.to_json()}
    return _search(args, console, space, evaluate, predict, db, settings.mem_cap_bytes, meta)


def _search(args, console, space, evaluate, predict, db, mem_cap, meta: dict) -> int:
    """Run the search (with progress), write the outputs, and return the exit status: the same
    for the CPU and the GPU space."""
    from rich.console import Console

    done = len(_space_records(space.configs(), db))
    with _Progress(console, len(space), done, args.progress) as progress:
        report = tune(space, evaluate, predict, db, args.algorithm, mem_cap=mem_cap,
                      max_trials=args.max_trials, kappa=args.kappa, on_trial=progress,
                      confirm=args.confirm, repeats=args.confirm_repeats)
    paths = write_outputs(report, Path(args.out), args.top,
                          {**meta, "db": str(db.path), "argv": sys.argv},
                          Console(width=None if sys.stdout.isatty() else 160))
    console.log(f"{report.new_trials} new trials (+{report.extra.get('confirm_runs', 0)} "
                f"confirmation runs), {len(report.records)}/{report.space_size} measured; "
                f"stopped: {report.stopped_because}; wrote {', '.join(map(str, paths.values()))}")
    if report.interrupted:
        return 130 if "interrupted" in report.stopped_because else 0
    return 0 if report.best is not None else 1


def _run_gpu(args: argparse.Namespace) -> int:
    """``slapo tune --space gpu``: the same pipeline over the GPU space."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        space, predict, evaluate, meta = _gpu_setup(args)
        console.log("predicting every config with the GPU cost model (one fake step each)")
        n = len(space)
    except ValueError as e:
        print(f"slapo tune: error: {e}", file=sys.stderr)
        return 2
    db = Database(args.db or Path(args.out) / "tune.db")
    console.log(f"space: {n} configs of {', '.join(space.names())}; db: {db.path}")
    return _search(args, console, space, evaluate, predict, db,
                   meta["settings"]["mem_cap_bytes"], meta)


def main(argv: list[str] | None = None) -> int:
    """``python -m slapo.tune.cli ...`` (the same as ``slapo tune ...``)."""
    parser = argparse.ArgumentParser(prog="slapo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_tune_parser(sub)
    args = parser.parse_args(["tune", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
