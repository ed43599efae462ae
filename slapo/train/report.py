"""What a `slapo train` run reports: the progress bar, the val loss, metrics.json and the plot.

Peak memory is `slapo.profile.meter`'s (the one meter `slapo train`, tune trials and the
progressive demo share), so the numbers of the three are the same measurement.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from ..profile import meter
from .metrics_log import perplexity

__all__ = ["evaluate", "grad_norm", "metrics", "plot", "progress_bar", "log_step", "throughput", "tokens_per_step",
           "trained_parameters", "val_loss", "warn", "write_metrics"]


def trained_parameters(run: Any) -> int:
    """Parameters this rank trains (its TP shards, its pipeline stages, its FSDP2 shards: a
    DTensor counts its local part), counted once."""
    params = {id(p): p for g in run.optimizer.param_groups for p in g["params"]}
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params.values())


def tokens_per_step(cfg: Any) -> int:
    return cfg.batch_size * cfg.seq_len


def throughput(run: Any) -> float:
    """Tokens/s over this process's steps, skipping the first (warm-up) when there are more."""
    times = run.step_times[1:] if len(run.step_times) > 1 else run.step_times
    return tokens_per_step(run.cfg) * len(times) / sum(times) if times else 0.0


def warn(run: Any, message: str) -> None:
    """A warning on stderr, once (rank 0)."""
    if run.env.is_main:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def progress_bar(run: Any):
    from tqdm import tqdm

    return tqdm(total=run.cfg.steps, initial=run.step, desc=f"train {run.cfg.model}",
                disable=not (run.env.is_main and run.cfg.progress), file=sys.stderr,
                dynamic_ncols=True, leave=True)


def log_step(run: Any, bar, log: Any = None) -> None:
    """The progress bar's line (loss, tokens/s, peak memory, the latest val loss and
    perplexity) and the step's record in the streaming metrics log."""
    tok_s = tokens_per_step(run.cfg) / run.step_times[-1]
    mem = meter.peak_bytes(run.env.device) / 2**20
    skipped = run.precision.skipped_steps
    val = (f"  val {run.evals[-1]['val_loss']:.4f} (ppl {run.evals[-1]['val_ppl']:,.1f})"
           if run.evals else "")
    bar.set_postfix_str(f"loss {run.losses[-1]:.4f}{val}{_experts_note(run)}  {tok_s:,.0f} "
                        f"tok/s  peak {mem:,.0f} MiB" + (f"  skipped {skipped}" if skipped
                                                         else ""), refresh=False)
    bar.update(1)
    if log is not None:
        log.log(run.step, loss=run.losses[-1], lr=run.optimizer.param_groups[0]["lr"],
                grad_norm=grad_norm(run), tokens=run.step * tokens_per_step(run.cfg),
                tokens_per_s=tok_s, peak_memory_mib=mem, skipped_steps=skipped,
                **run.expert_stats)


def _experts_note(run: Any) -> str:
    """A mixture of experts' step: `  aux 2.013  imbalance 1.42` (the aux loss and the most
    imbalanced layer's max/mean tokens per expert: `moe_metrics`); "" otherwise."""
    stats = run.expert_stats
    if not stats:
        return ""
    aux = f"  aux {stats['aux_loss']:.3f}" if stats.get("aux_loss") is not None else ""
    return f"{aux}  imbalance {stats['load_imbalance']:.2f}"


def grad_norm(run: Any) -> float | None:
    """The last step's gradient norm before clipping (the whole model's, every rank alike:
    `runtime.train_step.clip_grad_norm`); None without clipping (`--grad-clip 0`: not computed)
    or when it is not finite (an fp16 step skipped for inf/NaN gradients)."""
    norm = run.trainer.last_grad_norm
    value = None if norm is None else float(norm)
    return value if value is not None and math.isfinite(value) else None


def evaluate(run: Any, log: Any = None) -> float | None:
    """Collective (every rank runs the val forward). The val loss now, recorded in `run.evals`
    (step, val_loss, val_ppl) and the metrics log; None when there is no val loss."""
    if run.evals and run.evals[-1]["step"] == run.step:
        return run.evals[-1]["val_loss"]  # already evaluated at this step
    val = val_loss(run)
    if val is not None:
        run.evals.append({"step": run.step, "val_loss": val, "val_ppl": perplexity(val)})
        if log is not None:
            log.log(run.step, val_loss=val)
    return val


def val_loss(run: Any) -> float | None:
    """Mean loss on the first `eval_batches` val batches (fixed, independent of the step), by
    the run's `Trainer.eval_step` (forward only, eval mode, the training precision; pipelines
    too). Collective: every rank runs it."""
    if run.cfg.eval_batches == 0 or run.dataset is None:
        return None
    val = run.dataset.val_loader()
    if val is None:
        warn(run, f"no val loss: the val split ({len(run.dataset.val_tokens)} tokens) is too "
             f"small for blocks of {run.cfg.seq_len}; raise --val-fraction")
        return None
    total = 0.0
    for _ in range(run.cfg.eval_batches):
        batch = {k: v.to(run.env.device) for k, v in val.next_batch(run.cfg.batch_size).items()}
        total += run.trainer.eval_step(batch)
    return total / run.cfg.eval_batches


def metrics(run: Any, val: float | None, peak: int) -> dict[str, Any]:
    """Everything metrics.json holds about the run."""
    return {
        "losses": run.losses,
        "val_loss": val,
        "val_ppl": perplexity(val),
        "evals": run.evals,
        "lrs": run.lrs,
        "tokens_per_s": throughput(run),
        "tokens_per_step": tokens_per_step(run.cfg),
        "tokens_seen": run.step * tokens_per_step(run.cfg),
        "step_times_s": run.step_times,
        "peak_memory_bytes": peak,
        "peak_memory_kind": meter.peak_kind(run.env.device),
        "parameters_on_rank0": trained_parameters(run),
        "steps": run.step,
        "resumed_from": run.resumed_from,
        "resume_skipped": run.resume_skipped,
        "schedule": run.schedule_note,
        "task": run.task,
        "data": run.dataset.source if run.dataset is not None else None,
        "tokenizer": run.dataset.tokenizer.name if run.dataset is not None else None,
        "train_tokens": getattr(run.data, "num_tokens", None) or len(run.data.tokens),
        "precision": run.precision.name,
        "skipped_steps": run.precision.skipped_steps,
        "world_size": run.env.world,
        "parallel_dims": str(run.env.dims),
        "device": str(run.env.device),
        "torch": torch.__version__,
        "graph_breaks": graph_breaks(run.graph_breaks_before),
        "experts_last_step": run.expert_stats or None,  # a mixture of experts' router numbers
        "config": run.cfg.options(),
    }


def graph_break_counts() -> dict[str, int]:
    """dynamo's graph-break counters of this process, by reason (a copy)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def graph_breaks(before: dict[str, int] | None = None) -> dict[str, Any]:
    """dynamo's graph breaks since `before` (`graph_break_counts()` then; None: all of the
    process's) as {"count", "reasons"} (the first line of each new reason): with
    `--compile-blocks` each one is eager Python on every step, so the run reports them
    (docs/model_schedule.md lists what breaks a compiled block)."""
    before = before or {}
    new = {r: n - before.get(r, 0) for r, n in graph_break_counts().items()
           if n > before.get(r, 0)}
    return {"count": sum(new.values()),
            "reasons": [reason.split("\n")[0][:200] for reason in new]}


def write_metrics(out: Path, data: dict[str, Any]) -> Path:
    """metrics.json, written atomically (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def plot(out: Path, data: dict[str, Any]) -> Path | None:
    """metrics.png: train (and val) loss, tokens/s and the learning rate per step (matplotlib,
    imported only here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = data["losses"]
    times = data["step_times_s"]
    first = len(losses) - len(times) + 1  # step number of times[0] (after a resume)
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 3.5))
    ax1.plot(range(1, len(losses) + 1), losses, label="train")
    evals = data.get("evals") or []
    if evals:
        ax1.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", label="val")
        ax1.legend()
    ax1.set(xlabel="step", ylabel="loss", title=f"{data['config']['model']}: loss")
    ax2.plot(range(first, first + len(times)), [data["tokens_per_step"] / t for t in times])
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    lrs = data.get("lrs") or []
    ax3.plot(range(1, len(lrs) + 1), lrs)
    ax3.set(xlabel="step", ylabel="learning rate", title="learning rate")
    fig.tight_layout()
    path = out / "metrics.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
