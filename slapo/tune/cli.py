"""`slapo tune`: search a model schedule's knobs with measured trials and the cost model.

    slapo tune --model gpt2 --algorithm guided --out runs/tune-gpt2
    slapo tune --model gpt2 --algorithm exhaustive --db runs/tune-gpt2/tune.db --memory-cap 3G
    slapo tune --model gpt2 --knob sequence_parallel=false,true --knob kernels=false,true

Every trial is committed to the SQLite database (`--db`, default `OUT/tune.db`) as soon as
it ends, so a run that was interrupted (Ctrl-C, `--max-trials`, a killed job) continues where
it stopped when started again with the same `--db`. The run writes to `--out`:
`results.json` (settings, every trial with its prediction, the top configurations),
`top.txt` (the table that is also printed) and `search.png` (predicted vs measured per trial,
and the measured throughput in trial order).

This module is the command line only: the search driver is `slapo.tune.driver` (`tune`,
`TuneReport`), the outputs `slapo.tune.report` (import them from there). The knob options'
defaults and `--knob`'s names and values come from `model_schedule.knobs.ScheduleKnobs`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..model_schedule import knobs as _schema
from .database import Database, Record
from .driver import ALGORITHMS, OBJECTIVE, space_records, tune
from .model_spaces import parse_knob_option
from .report import _fmt_bytes, write_outputs
from .space import Space


# ---------------------------------------------------------------------------------- CLI
def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None

    return parse


def _knob_values(name: str) -> Callable[[str], tuple]:
    """Candidates of schedule knob `name` ("V1,V2"), parsed and checked by the schema."""
    def parse(text: str) -> tuple:
        try:
            return parse_knob_option(f"{name}={text}")[1]
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def _knob_option(text: str) -> tuple[str, tuple]:
    try:
        return parse_knob_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _knob_help(name: str) -> str:
    """The schema's help of a knob and its default candidates, for a tune option."""
    cands = ",".join(str(v) for v in _schema.tune_candidates(name))
    return f"{name}: {_schema.spec(name)['help']} (default candidates: {cands})"


_ONOFF = {"both": (False, True), "on": (True,), "off": (False,)}
GPU_OFFLOAD_RATIOS = (0.0,)  # `--space gpu`'s offload_ratio candidates: not searched unless
# asked (each candidate multiplies the fake steps to predict; docs/tune.md: on a PCIe host the
# cost model predicts offload slower than recomputation for the benchmark models)


def add_tune_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `tune` subcommand to a `slapo` subparsers object."""
    p = subparsers.add_parser(
        "tune", help="search schedule knobs with measured trials and the cost model",
        description="Search a model's schedule knobs (batch size x attention x checkpoint ratio "
        "x fuse x Tempo): each trial trains a few steps in its own process; the guided search "
        "measures only what the cost model ranks as promising. Resumable from --db.")
    a = p.add_argument
    a("--space", choices=("cpu", "gpu"), default="cpu",
      help="cpu: the CPU space (batch x attention x ckpt x fuse x Tempo on a small model); gpu: "
      "precision x compile_blocks x fused_loss x kernels x ckpt_ratio/ckpt_policy x offload_ratio "
      "x attention x batch of a benchmark model, trained through slapo.build(...).train_step (default: cpu)")
    a("--model", default=None, help="cpu space: model family (default: gpt2); gpu space: "
      "a model of slapo.tune.model_spaces.GPU_MODELS (default: llama-1b)")
    a("--device", default="cuda", help="gpu space: trial device (default: cuda)")
    a("--mem-cap-gib", type=float, default=None, metavar="GIB",
      help="gpu space: peak allocated memory per trial; configs the cost model predicts above "
      "it are not enumerated, and trials above it count as oom")
    a("--precisions", type=_csv(str), default=("fp32", "bf16"), metavar="P,..",
      help="gpu space: mixed_precision values: fp32, bf16, fp16, fp8 (fp8: torchao's FP8 "
      "GEMMs, needs torchao and a GPU with FP8 tensor cores; default: fp32,bf16)")
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
    a("--ckpt-ratios", type=_knob_values("ckpt_ratio"), metavar="R,..",
      default=_schema.tune_candidates("ckpt_ratio"), help=_knob_help("ckpt_ratio"))
    a("--offload-ratios", type=_knob_values("offload_ratio"), metavar="R,..",
      default=GPU_OFFLOAD_RATIOS, help="gpu space: offload_ratio candidates, the share of layers "
      "after the checkpointed ones whose saved activations (1 MiB or more) wait in pinned host "
      "memory (the offload primitive); ckpt_ratio + offload_ratio <= 1: recompute the first "
      "layers, offload the next, keep the rest; e.g. 0,0.25,0.5 (default: 0, offload not "
      "searched)")
    a("--attention", type=_knob_values("attention"), metavar="A,..",
      default=_schema.tune_candidates("attention"),
      help=_knob_help("attention") + "; gpu space default: sdpa")
    a("--fuse", choices=sorted(_ONOFF), default="both",
      help=f"fuse: {_schema.spec('fuse')['help']} (default: both)")
    a("--tempo", choices=sorted(_ONOFF), default="both",
      help=f"tempo: {_schema.spec('tempo')['help']} (default: both)")
    a("--knob", action="append", type=_knob_option, default=[], metavar="NAME=V1,V2",
      help="search another schedule knob of model_schedule.knobs.ScheduleKnobs too, e.g. "
      "kernels=false,true or sequence_parallel=false,true (repeatable; values are checked "
      "against the knob's domain)")
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
    a("--dry-run", action="store_true",
      help="gpu space: print every config with the cost model's prediction, best predicted "
      "first, and stop: nothing is measured or written (no GPU needed)")
    p.set_defaults(func=run_tune)
    return p


def _check_numbers(args: argparse.Namespace) -> None:
    """Every numeric option's range, and the combinations a trial would otherwise fail on one
    by one (each trial is a process; a width the heads do not divide fails in all of them)."""
    for name in ("steps", "num_layers", "seq_len", "threads", "hidden_size", "num_heads",
                 "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                             f"{getattr(args, name)}.")
    for name in ("warmup", "confirm", "confirm_repeats", "kappa"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got "
                             f"{getattr(args, name)}.")
    for name in ("trial_timeout", "efficiency"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got "
                             f"{getattr(args, name)}.")
    if args.max_trials is not None and args.max_trials < 1:
        raise ValueError(f"--max-trials must be >= 1, got {args.max_trials} (leave it out for "
                         "no limit).")
    if args.mem_cap_gib is not None and not args.mem_cap_gib > 0:
        raise ValueError(f"--mem-cap-gib must be > 0, got {args.mem_cap_gib}.")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be positive integers, got {args.batch_sizes}.")
    if args.hidden_size % args.num_heads:
        raise ValueError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads "
                         f"{args.num_heads}.")


def _preflight(args: argparse.Namespace) -> None:
    """Before anything is written: --out is (or can be) a directory, and an existing --db and
    calibration cache are readable as they are (both are only read here)."""
    from .database import check_file
    from .timing import load_cache

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory.")
    db = Path(args.db) if args.db else out / "tune.db"
    if db.exists():
        check_file(db)
    calibration = args.calibration or out / "calibration.json"
    if getattr(args, "space", "cpu") == "cpu":
        load_cache(calibration)


def _settings(args: argparse.Namespace) -> Any:
    from .evaluators import TrialSettings, parse_bytes

    _check_numbers(args)
    return TrialSettings(model=args.model, hidden_size=args.hidden_size,
                         num_layers=args.num_layers, num_heads=args.num_heads,
                         seq_len=args.seq_len, steps=args.steps, warmup=args.warmup,
                         threads=args.threads, fuse_compiler=args.fuse_compiler,
                         mem_cap_bytes=parse_bytes(args.memory_cap), seed=args.seed)


def _space(args: argparse.Namespace) -> Space:
    from .model_spaces import SpaceArgs, make_space

    return make_space(args.model, SpaceArgs(
        batch_sizes=tuple(args.batch_sizes), attention=tuple(args.attention),
        ckpt_ratios=tuple(args.ckpt_ratios), fuse=_ONOFF[args.fuse], tempo=_ONOFF[args.tempo],
        num_layers=args.num_layers, extra=tuple(args.knob)))


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


def _check_device(device: str) -> None:
    import torch

    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device; use e.g. cuda, cuda:1 "
                         "or cpu.") from None


def _check_precisions(precisions: tuple, device: str = "cpu") -> None:
    """Each name through `check_precision` (the one check of a precision name); fp8 also needs
    torchao here (the cost model installs its FP8 GEMMs) and FP8 tensor cores on a CUDA
    `device` that this machine has (`runtime.fp8.check_fp8`, as `build` checks it)."""
    import torch

    from ..errors import SchedulingError
    from ..runtime.fp8 import check_fp8
    from ..runtime.precision import PRECISIONS, PrecisionError, check_precision

    try:
        for p in precisions:
            check_precision(p)
        ok = bool(precisions)
    except PrecisionError:
        ok = False
    if not ok:
        raise ValueError(f"--precisions must name some of {', '.join(PRECISIONS)}, got "
                         f"{','.join(precisions) or 'nothing'}.")
    if "fp8" in precisions:
        kind = torch.device(device).type
        try:  # a CUDA device this machine lacks (predicting elsewhere): torchao only
            check_fp8(None, kind if kind != "cuda" or torch.cuda.is_available() else "cpu")
        except SchedulingError as e:
            raise ValueError(f"--precisions fp8: {e.problem} Fix: {e.fix}") from None


def _gpu_setup(args: argparse.Namespace) -> tuple[Space, Any, Any, dict]:
    """The GPU space, its cost model and its evaluator (`--space gpu`), through
    `best.gpu_search_setup` (the setup `benchmarks/gpu_train.py`'s tuned row uses too)."""
    from .best import gpu_search_setup
    from .model_spaces import GPU_MODELS, GPUSpaceArgs

    name = args.model or "llama-1b"
    if name not in GPU_MODELS:
        raise ValueError(f"no GPU model {name!r}; use one of {', '.join(GPU_MODELS)}.")
    spec = GPU_MODELS[name]
    cap = None if not args.mem_cap_gib else int(args.mem_cap_gib * 2**30)
    batches = tuple(args.batch_sizes) if args.batch_sizes != (2, 4, 8) else \
        (max(spec.batch // 2, 1), spec.batch, 2 * spec.batch)
    given = tuple(args.attention) != _schema.tune_candidates("attention")
    attention = tuple(args.attention) if given else ("sdpa",)
    space_args = GPUSpaceArgs(batch_sizes=batches, mixed_precision=tuple(args.precisions),
                              attention=attention, ckpt_ratios=tuple(args.ckpt_ratios),
                              offload_ratios=tuple(args.offload_ratios))
    found = gpu_search_setup(spec, space_args, device=args.device, steps=args.steps,
                             warmup=args.warmup, mem_cap_bytes=cap, seed=args.seed,
                             trial_timeout=args.trial_timeout, efficiency=args.efficiency)
    return found.space, found.predict, found.evaluate, found.meta


def run_tune(args: argparse.Namespace) -> int:
    """`slapo tune`: returns the exit status (0 ok, 1 nothing measured, 2 bad options, 130 ^C)."""
    if args.space == "gpu":
        return _run_gpu(args)
    if getattr(args, "dry_run", False):
        print("slapo tune: error: --dry-run lists the gpu space (--space gpu); the cpu space's "
              "cost model measures this machine first.", file=sys.stderr)
        return 2
    args.model = args.model or "gpt2"
    from rich.console import Console

    from .evaluators import TrialEvaluator
    from .predict_cpu import GPT2CostModel

    console = Console(stderr=True)
    try:
        settings = _settings(args)
        space = _space(args)
        space.names()  # enumerate now: a --knob clash is a usage error, not a failed search
        _preflight(args)
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
            "calibration": predict.device.to_json(),
            "train_options": {"model": args.model, "hidden_size": args.hidden_size,
                              "num_layers": args.num_layers, "num_heads": args.num_heads,
                              "seq_len": args.seq_len, "fuse_compiler": args.fuse_compiler}}
    return _search(args, console, space, evaluate, predict, db, settings.mem_cap_bytes, meta)


def _search(args, console, space, evaluate, predict, db, mem_cap, meta: dict) -> int:
    """Run the search (with progress), write the outputs, and return the exit status: the same
    for the CPU and the GPU space."""
    from rich.console import Console

    done = len(space_records(space.configs(), db))
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
    """`slapo tune --space gpu`: the same pipeline over the GPU space."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        _check_numbers(args)
        _check_device(args.device)
        _check_precisions(args.precisions, args.device)
        _preflight(args)
        space, predict, evaluate, meta = _gpu_setup(args)
        console.log("predicting every config with the GPU cost model (one fake step each)")
        n = len(space)
    except ValueError as e:
        print(f"slapo tune: error: {e}", file=sys.stderr)
        return 2
    if getattr(args, "dry_run", False):
        return _dry_run(space, predict)
    db = Database(args.db or Path(args.out) / "tune.db")
    console.log(f"space: {n} configs of {', '.join(space.names())}; db: {db.path}")
    return _search(args, console, space, evaluate, predict, db,
                   meta["settings"]["mem_cap_bytes"], meta)


def _dry_run(space: Space, predict: Any) -> int:
    """`--dry-run`: every config of the space and its prediction, best predicted first."""
    from rich.console import Console
    from rich.table import Table

    rows = sorted(((c, predict(c)) for c in space), key=lambda r: -r[1][OBJECTIVE])
    knobs = list(dict.fromkeys(k for c, _ in rows for k in c))
    table = Table(title=f"slapo tune --dry-run: {len(rows)} configs, best predicted first "
                  "(predictions, nothing measured)")
    for col in ("#", *knobs, "pred tokens/s", "pred mem", "pred ms"):
        table.add_column(col, justify="right" if col.startswith(("#", "pred")) else "left")
    for i, (c, p) in enumerate(rows):
        table.add_row(str(i + 1), *[str(c.get(k, "-")) for k in knobs],
                      f"{p[OBJECTIVE]:,.0f}", _fmt_bytes(p.get("memory")),
                      f"{1e3 * p['step_time_s']:.1f}")
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m slapo.tune.cli ...` (the same as `slapo tune ...`)."""
    parser = argparse.ArgumentParser(prog="slapo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_tune_parser(sub)
    args = parser.parse_args(["tune", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
