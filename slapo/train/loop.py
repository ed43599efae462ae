"""The `slapo train` loop, top to bottom: setup -> build -> (resume) -> steps -> finish.

    env = setup(cfg)                      # degrees and mesh (setup.py: ParallelDims, init_mesh)
    run = build(cfg, env)                 # data, model, schedule knobs, optimizer, one step fn
    resume(run)                           # optional: model, optimizer, RNG, sampler, history
    for each step: batch -> lr -> step -> (eval) -> log -> (checkpoint)
    finish                                # val loss, metrics.json, metrics.png (report.py)

Logs stream as the run goes (`metrics_log`: metrics.jsonl / metrics.csv, TensorBoard, W&B):
one record per step and per evaluation (`--eval-every N`; the val loss always at the end).

Exact resume: a checkpoint holds everything the next step depends on (weights, optimizer
moments, every RNG stream, the data sampler's position, the LR is a function of the step), so a
run resumed from step k computes bit-for-bit the losses the uninterrupted run computed after k.

The concerns live in their own modules: `config` (TrainConfig and its checks; the schedule
knobs come from `model_schedule.knobs`), `setup` (Env, mesh, devices), `assemble` (Run, build,
schedule, make_trainer), `resume` (save, pick, identity, load), `report` (progress, val loss,
metrics, plot) and `run_state` (the checkpoint format); import each name from its module.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

from ..profile import meter
from . import faults, stop_signals
from .assemble import Run, build
from .config import TrainConfig
from .metrics_log import MetricsLog
from .report import (
    evaluate,
    log_step,
    metrics,
    plot,
    progress_bar,
    trained_parameters,
    write_metrics,
)
from .resume import resume, save
from .setup import check_inputs, claim_out, setup, teardown


# ---- step -------------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at cfg.steps (step is 0-based).
    A pure function of the step, so resuming needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.peak_lr() * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    ratio = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.peak_lr() * ratio


def train_one_step(run: Run) -> float:
    """Draw the next global batch, set the LR, take one optimizer step; return the loss."""
    batch = {k: v.to(run.env.device) for k, v in run.data.next_batch(run.cfg.batch_size).items()}
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(run.step, run.cfg)
    t0 = time.perf_counter()
    loss = run.trainer.train_step(batch)
    if run.experts is not None:  # one small all-reduce (two with pp): the step's routing
        info = run.trainer.step_config.info
        run.expert_stats = run.experts.step_stats(info.replica_group(),
                                                  info.group("pp") if info.pp > 1 else None)
    run.step_times.append(time.perf_counter() - t0)
    run.step += 1
    run.losses.append(float(loss))
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at step {run.step}; lower --lr "
                                 "(or check the schedule).")
    return loss


# ---- the loop ---------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; return the metrics (also written to cfg.out on rank 0)."""
    cfg.check()
    check_inputs(cfg)
    env = setup(cfg)
    log = print if env.is_main else (lambda *a, **k: None)
    try:
        faults.watch_launcher()  # under torchrun (one process too): stop when it is gone
        stop_signals.note_phase("while setting up")
        run = build(cfg, env, log)
        log(f"slapo train: {cfg.model} ({trained_parameters(run):,} parameters on rank 0), "
            f"{env.world} process(es) ({env.dims}), device {env.device}, precision "
            f"{cfg.precision}"
            f"{' (autocast, fp32 master weights)' if cfg.precision != 'fp32' else ''}"
            f"{_fp8_note(run.precision)}, "
            f"schedule {run.schedule_note}")
        if cfg.resume_target() is not None:
            resume(run, log)
        claim_out(cfg, env)  # --out is this run's: run.json (--overwrite: the old run removed)
        meter.reset_peak(env.device)
        with open_metrics_log(run) as mlog:
            bar = progress_bar(run)
            while run.step < cfg.steps:
                stop_signals.note_phase(f"in step {run.step + 1}")
                train_one_step(run)
                if cfg.eval_every and run.step % cfg.eval_every == 0:
                    evaluate(run, mlog)
                log_step(run, bar, mlog)
                if cfg.out and cfg.save_every and run.step % cfg.save_every == 0:
                    if cfg.keep_best:  # the val loss that ranks this checkpoint
                        evaluate(run, mlog)
                    save_noted(run)
            bar.close()
            if cfg.out and (run.resumed_from != run.step) and not (
                    cfg.save_every and run.step % cfg.save_every == 0):
                if cfg.keep_best:
                    evaluate(run, mlog)
                save_noted(run)  # the final state, unless just saved (or nothing was trained)
            stop_signals.note_phase(f"after step {run.step} (computing the final metrics)")
            return finish(run, log, mlog)
    finally:
        teardown(env)


def _fp8_note(precision: Any) -> str:
    """fp8: how many GEMMs run in FP8 on this rank (the rest in bf16), and whether emulated."""
    if precision.fp8 is None:
        return ""
    where = "emulated on CPU" if precision.device_type == "cpu" else "FP8 tensor cores"
    return f", {len(precision.fp8_modules)} FP8 GEMMs ({where})"


def save_noted(run: Run) -> None:
    """`save`, with the phase a stop names. A stop inside a save abandons it: what it wrote
    stays in its `.tmp` directory, which nothing reads and the next save of that step replaces;
    every published checkpoint is intact (`run_state.save` publishes by an atomic rename)."""
    stop_signals.note_phase(f"during the save of step {run.step}")
    save(run)
    stop_signals.note_phase(f"after step {run.step}")


@contextlib.contextmanager
def open_metrics_log(run: Run):
    """The streaming log (rank 0 writes; see metrics_log), closed however the run ends."""
    cfg = run.cfg
    mlog = MetricsLog(cfg.out, enabled=run.env.is_main, tensorboard=cfg.tensorboard,
                      wandb=cfg.wandb, config=cfg.options(), resumed_from=run.resumed_from)
    try:
        yield mlog
    finally:
        mlog.close()


def finish(run: Run, log=print, mlog: MetricsLog | None = None) -> dict[str, Any]:
    """Val loss, metrics.json and metrics.png (rank 0), the final line; returns the metrics."""
    cfg = run.cfg
    val = evaluate(run, mlog)
    data = metrics(run, val, meter.peak_bytes(run.env.device))
    if cfg.out and run.env.is_main:
        out = Path(cfg.out)
        write_metrics(out, data)
        if cfg.plot:
            plot(out, data)
    if data["losses"]:
        shown_val = (f", val loss {val:.4f} (perplexity {data['val_ppl']:,.2f})"
                     if val is not None else "")
        log(f"done: {run.step} steps, loss {data['losses'][0]:.4f} -> "
            f"{data['losses'][-1]:.4f}{shown_val}, {data['tokens_per_s']:,.0f} tokens/s, peak memory "
            f"{data['peak_memory_bytes'] / 2**20:,.0f} MiB"
            + (f"; wrote {cfg.out}" if cfg.out else ""))
    breaks = data["graph_breaks"]
    if breaks["count"]:
        log(f"note: {breaks['count']} torch.compile graph break(s), each eager Python on every "
            f"step; first: {breaks['reasons'][0]} (metrics.json lists them)")
    return data
