"""`slapo eval TARGET`: the loss and perplexity of a trained model on a data set, no training.

    slapo eval runs/llama                      # the run's newest checkpoint, on its own val split
    slapo eval runs/llama --data notes.jsonl   # ... on the val split of other data
    slapo eval ckpts/llama --data notes.jsonl  # a Hugging Face directory (config.json + weights)

Why it goes through `slapo train`'s own pieces: the number must be the one the run would log.
A run directory is rebuilt as `--resume` rebuilds it (`assemble.build` from the checkpoint's
config: the same model, LoRA wrapper, schedule knobs and mesh, so it also runs under torchrun
with `--tp`), its checkpoint loaded (`run_state.load`; the random streams are not touched), and
the loss is `report.val_loss`: the mean of `Trainer.eval_step` (forward only, eval mode, the
training precision) over the first `--batches` fixed batches of the data's val split, exactly
the run's own val loss. A Hugging Face directory is built as `slapo train --model DIR` builds
it, with no checkpoint to load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..data.sources import InputError
from . import checkpoints
from . import run_state as ckpt

__all__ = ["eval_target"]

# options a run's config may not carry into an evaluation: nothing is written or resumed
_NO_RUN = {"out": None, "resume": None, "resume_or_start": False, "overwrite": False,
           "save_every": 0, "keep_last": 0, "keep_best": False, "tensorboard": False,
           "wandb": None,
           "progress": False, "plot": False, "eval_every": 0,
           # this job's layout: one process (or data parallel over torchrun's), whatever the
           # run's was (its checkpoint loads into any layout, as a resume on another does)
           "tp": None, "pp_stages": None, "pp_schedule": None, "cp": 1, "ep": 1,
           "sequence_parallel": None, "vocab_parallel": None, "dp_shard": False}


def _config(target: Path, step: int | None, given: dict[str, Any]):
    """(TrainConfig, checkpoint or None): a run directory's config with `given` applied, or a
    Hugging Face directory's."""
    from .config import TrainConfig
    from .export import pick, run_config

    if (target / checkpoints.CHECKPOINTS).is_dir():
        path = pick(target, step, what="evaluate")
        saved = run_config(ckpt.read_trainer(path), path).options()
        return TrainConfig(**{**saved, **given, **_NO_RUN}), path
    if (target / "config.json").is_file():
        if step is not None:
            raise InputError(str(target), "--step picks a run's checkpoint, and this is a "
                             "Hugging Face model directory.", "leave --step out.")
        return TrainConfig(model=str(target), **given, **_NO_RUN), None
    raise InputError(str(target), "is neither a `slapo train` run directory (checkpoints/) "
                     "nor a Hugging Face model directory (config.json).",
                     "pass a run's --out directory or a save_pretrained directory.")


def eval_target(target: str | Path, *, step: int | None = None, log=print,
                **given: Any) -> dict[str, Any]:
    """Evaluate `target` (module docstring); `given`: `slapo train` options that replace the
    run's (`data`, `text_field`, `tokenizer`, `val_fraction`, `seq_len`, `batch_size`,
    `eval_batches`, `device`). Returns {val_loss, val_ppl, step, checkpoint, data, batches};
    bad input raises InputError or ValueError before anything is built."""
    from .assemble import build
    from .config import default_of
    from .metrics_log import perplexity
    from .report import val_loss
    from .setup import check_inputs, setup, teardown

    given = {k: v for k, v in given.items() if v is not None}
    cfg, path = _config(Path(target), step, given)
    if "eval_batches" not in given and not cfg.eval_batches:  # a run that logged no val loss
        cfg.eval_batches = default_of("eval_batches")
    if cfg.eval_batches < 1:
        raise ValueError(f"--batches must be >= 1, got {cfg.eval_batches}")
    cfg.check()
    check_inputs(cfg)
    env = setup(cfg)
    try:
        run = build(cfg, env, log=lambda *a, **k: None)
        if path is not None:
            ckpt.load(path, run.model, run.optimizer, env.rank, rng=False)
        val = val_loss(run)
    finally:
        teardown(env)
    if val is None:
        raise InputError(str(cfg.data or "the shipped corpus"), "its val split is too small "
                         f"for one block of {cfg.seq_len} tokens.",
                         "pass --val-fraction larger, or more data.")
    result = {"val_loss": val, "val_ppl": perplexity(val), "checkpoint": str(path) if path
              else None, "step": checkpoints.step_of(path) if path else None,
              "data": run.dataset.source, "batches": cfg.eval_batches}
    log(f"slapo eval: {target}" + (f" (step {result['step']})" if path else "")
        + f": val loss {val:.4f}, perplexity {result['val_ppl']:,.2f} ({cfg.eval_batches} "
        f"batches of {cfg.batch_size} x {cfg.seq_len} tokens of the val split of "
        f"{result['data']})")
    return result
