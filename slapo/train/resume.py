"""Saving a run and resuming it exactly: which checkpoint, is it the same run, load everything.

The checkpoint format itself (DCP files, marker, checksums, safe loaders) is `run_state`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .. import faultpoints
from ..files import write_synced
from ..model_schedule.knobs import ScheduleKnobs
from ..model_schedule.knobs import names as knob_names
from . import checkpoints
from . import run_state as ckpt
from .config import RUN_IDENTITY, RUN_LAYOUT, TrainConfig, flag
from .report import warn

__all__ = ["check_identity", "pick_checkpoint", "resume", "save"]


def save(run: Any) -> Path:
    """Collective. Checkpoint everything the next step depends on into `out/checkpoints/`."""
    path = checkpoints.checkpoint_dir(Path(run.cfg.out), run.step)
    trainer = {"step": run.step, "losses": run.losses, "step_times": run.step_times,
               "data": run.data.state_dict(), "config": run.cfg.options(),
               "precision": run.precision.state_dict(),  # fp16: the loss scale
               "evals": run.evals}
    best = best_checkpoint(run) if run.cfg.keep_best else None
    ckpt.save(path, run.model, run.optimizer, trainer, run.env.rank, keep_last=run.cfg.keep_last,
              keep_step=None if best is None else best["step"], parts=_parts(run))
    if best is not None and run.env.is_main:
        write_synced(Path(run.cfg.out) / BEST_FILE, json.dumps(
            {**best, "checkpoint": str(checkpoints.checkpoint_dir(Path(run.cfg.out),
                                                                  best["step"]))}))
    return path


def _parts(run: Any) -> list | None:
    """The modules this rank runs (its pipeline stages, or the model): a checkpoint saves and
    loads only their buffers (`run_state._foreign_buffers`)."""
    return getattr(run.trainer, "parts", None)


BEST_FILE = "best.json"  # --keep-best: the kept checkpoint with the lowest val loss


def best_checkpoint(run: Any) -> dict[str, Any] | None:
    """{step, val_loss} of the lowest val loss among the steps that have a checkpoint (this
    save's included; the earlier of equal losses), or None when none was evaluated."""
    saved = {checkpoints.step_of(p) for p in checkpoints.candidates(Path(run.cfg.out))}
    scored = [e for e in run.evals if e["step"] in saved | {run.step}]
    if not scored:
        return None
    best = min(scored, key=lambda e: (e["val_loss"], e["step"]))
    return {"step": best["step"], "val_loss": best["val_loss"]}


def pick_checkpoint(run: Any) -> Path | None:
    """Collective. The checkpoint to resume from, verified (marker, sizes, sha256).

    `--resume` (latest): the newest intact checkpoint of the run in --out (`run_state`'s run
    ids: one of another run is never picked); newer damaged or foreign ones are skipped with a
    warning naming each and why (and recorded in metrics.json as `resume_skipped`).
    None only with --resume-or-start and no checkpoint at all. `--resume DIR`: that checkpoint,
    or an error saying what is wrong with it.
    """
    cfg, env = run.cfg, run.env
    target = cfg.resume_target()
    if target != "latest":
        reason = ckpt.verify_all(Path(target), env.rank, env.world)
        if reason is not None:
            raise checkpoints.CheckpointError(target, f"cannot resume: {reason}. `--resume` with no "
                                       "directory picks the newest intact checkpoint in --out.")
        return Path(target)
    path, skipped = ckpt.find_resumable(Path(cfg.out), env.rank, env.world)
    for bad, why in skipped:
        warn(run, f"skipping checkpoint {bad}: {why}")
        run.resume_skipped.append({"checkpoint": str(bad), "reason": why})
    if path is None and skipped:
        raise checkpoints.CheckpointError(Path(cfg.out) / checkpoints.CHECKPOINTS, "no intact checkpoint of "
                                   "this run to resume from (every one is listed above with "
                                   "why it was skipped); start a fresh run in another --out "
                                   "(or --overwrite this one), or repair one")
    if path is not None and skipped:
        warn(run, f"resuming from {path.name}, the newest intact checkpoint")
    return path


def _effective(name: str, value: Any) -> Any:
    """What an option means for the run: a knob that was not given (None) is its schema
    default (`--tp` not given is tp 1), so spelling the default out is the same run."""
    if value is not None or name not in knob_names():
        return value
    default = getattr(ScheduleKnobs(), name)
    return 1 if name == "tp" and default is None else default


def _shown(value: Any) -> str:
    return "not given" if value is None else str(value)


def check_identity(cfg: Any, path: Path, saved: dict[str, Any]) -> None:
    """The options that define the run must match the checkpoint's; checked before any tensor
    is read, so a different model or size gets this message, not a loader error."""
    defaults = TrainConfig()  # a key a checkpoint predates had its default value
    diff = {}
    for k in RUN_IDENTITY:
        old, new = saved.get(k, getattr(defaults, k)), getattr(cfg, k)
        if _effective(k, old) != _effective(k, new):
            diff[k] = (old, new)
    if diff:
        shown = ", ".join(f"--{flag(k)} {_shown(new)} (checkpoint: {_shown(old)})"
                          for k, (old, new) in diff.items())
        raise ValueError(f"cannot resume from {path}: it is a different run: {shown}.")


def resume(run: Any, log=print) -> None:
    """Resume from cfg.resume ("latest" in cfg.out, or a directory): verify, check identity,
    then load weights, optimizer, RNG streams, sampler and history."""
    path = pick_checkpoint(run)
    if path is None:
        log(f"--resume-or-start: no checkpoint in {run.cfg.out}/checkpoints; starting from "
            "step 0")
        return
    trainer = ckpt.read_trainer(path)
    check_identity(run.cfg, path, trainer["config"])
    changed = layout_changes(run.cfg, trainer["config"], ckpt.saved_world(path), run.env.world)
    ckpt.load(path, run.model, run.optimizer, run.env.rank, rng=not changed,
              parts=_parts(run))
    run.step = trainer["step"]
    if changed:
        reseed_after_resharding(run, trainer["step"])
    run.losses = list(trainer["losses"])
    run.evals = [e for e in trainer.get("evals", []) if e["step"] <= run.step]
    run.data.load_state_dict(trainer["data"])
    if "precision" in trainer:
        run.precision.load_state_dict(trainer["precision"])
    run.resumed_from = run.step
    faultpoints.steps_done(run.step)  # SLAPO_FAULT steps count as the run does
    log(f"resumed from {path} at step {run.step}")
    if changed:
        log(f"note: resumed on another layout ({', '.join(changed)}): weights, optimizer "
            "state, step, data position and loss scale are the run's; the random streams "
            "(dropout) restart from the seed and the step, so the losses are not bit for bit "
            "those of an uninterrupted run")


def layout_changes(cfg: Any, saved: dict[str, Any], saved_world: int, world: int) -> list[str]:
    """How this job's layout differs from the checkpoint's ("--tp 1 (checkpoint: 2)", ...):
    the number of processes and the `RUN_LAYOUT` options, compared by effective value."""
    defaults = TrainConfig()
    changes = [] if saved_world == world else \
        [f"{world} process(es) (checkpoint: {saved_world})"]
    for k in RUN_LAYOUT:
        old, new = saved.get(k, getattr(defaults, k)), getattr(cfg, k)
        if _effective(k, old) != _effective(k, new):
            changes.append(f"--{flag(k)} {_shown(new)} (checkpoint: {_shown(old)})")
    return changes


def reseed_after_resharding(run: Any, step: int) -> None:
    """The saved streams are per rank, and the ranks changed: start new ones, distinct per rank
    as at the start of a run (`seed_training_rng`), and different for every resumed step."""
    from .setup import seed_training_rng

    seed_training_rng(run.cfg.seed + 7919 * step, run.env)
