"""Measuring one scheduled variant: build it into the step `slapo train` runs, then count its
saved-for-backward bytes, time its steps (fastest after warm-up), read the meter's peak, and
search the batch that fits the activation budget."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed import group as _g
from ..profile import meter, saved_bytes
from ..runtime.build import build_trainer
from ..runtime.step_timing import time_steps
from ..runtime.trainer import Trainer
from ..schedule import Schedule
from ..sharding import shard_spec
from .budget import OVER, Budget, batch_candidates, largest_fitting
from .steps import StepResult


def hf_loss(out) -> torch.Tensor:
    return out.loss


def trainer(sch: Schedule, lr: float, precision: str) -> Trainer:
    """The step `slapo train` runs: the `Trainer` of `slapo.build` (`build_trainer`) with
    AdamW in `precision`."""
    return build_trainer(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": lr},
                         precision=precision)


def _train(trained: Trainer, batches: list[dict], warmup: int) -> tuple[float, list]:
    """Seconds per step and the losses of `train_step` on each batch (ranks aligned by a
    barrier around each step, so a TP step's time is its slowest rank's).

    The time is the *fastest* step after warm-up: other jobs on a shared machine only ever add
    time to a step, so the minimum is the least disturbed estimate of what the step costs (a
    median still moves with how long a neighbour's burst lasted)."""
    timed = time_steps(trained, batches, barrier=True)
    return timed.fastest(warmup), timed.losses


def _agree_max(value: int, device: torch.device) -> int:
    """The largest `value` over all ranks, so every rank takes the same batch decision."""
    if not _g.is_initialized():
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _measure_bytes(trained: Trainer, batch: dict) -> int:
    """Saved-for-backward bytes of one forward of the model, under the step's own autocast
    (`trained.precision`), agreed over ranks. Under autocast the cached low-precision weight
    copies count too: they are held for backward like any activation."""
    device = _device(trained.model)
    try:
        with trained.precision.autocast():
            n = saved_bytes(trained.model, **batch)
    except torch.cuda.OutOfMemoryError:  # a batch past the budget may not fit the device at all
        torch.cuda.empty_cache()
        n = OVER
    return _agree_max(n, device)


def _held(model: nn.Module) -> tuple[int, int]:
    """(largest shard degree of any weight, parameter elements on this rank): what a row
    reports so that a reader (and a test) sees how the step's weights were split."""
    ways, numel = 1, 0
    for p in model.parameters():
        spec = shard_spec(p)
        ways = max(ways, spec.world_size if spec is not None else 1)
        numel += p.numel()
    return ways, numel


def _at_budget(trained: Trainer, res: StepResult, bud: Budget) -> None:
    """Fill `res.budget_*`: the largest measured fit, and tokens/s there (reused at the demo
    batch, where the step was already timed). The same Trainer (its optimizer state too)
    trains on: timing does not depend on the weights' values."""
    res.budget_bytes = bud.bytes
    cands = batch_candidates(res.batch, bud.max_factor)
    found = largest_fitting(
        cands, lambda b: _measure_bytes(trained, bud.source.get(b, 1)[0]),
        bud.bytes, (res.batch, res.saved_bytes))
    if found is None:
        res.note = (res.note + "; " if res.note else "") + "batch 1 exceeds the budget"
        return
    res.budget_batch, res.budget_saved_bytes = found
    res.budget_capped = res.budget_batch == cands[-1]
    if res.budget_batch == res.batch:
        res.budget_tokens_per_s = res.tokens_per_s
        return
    batches = bud.source.get(res.budget_batch, bud.warmup + bud.timed_steps)
    sec, _ = _train(trained, batches, bud.warmup)
    res.budget_tokens_per_s = bud.tokens_per_sample * res.budget_batch / sec


def measure_step(trained: Trainer, res: StepResult, batches: list[dict], warmup: int,
                 tokens: int, budget: Budget | None) -> None:
    """Bytes at the demo batch, the timed steps (with the meter's peak), the budget search."""
    res.shard_ways, res.parameters = _held(trained.model)
    res.saved_bytes = _measure_bytes(trained, batches[0])
    device = _device(trained.model)
    meter.reset_peak(device)
    sec, res.losses = _train(trained, batches, warmup)
    res.peak_bytes = meter.peak_bytes(device)
    res.tokens_per_s = tokens / sec
    if budget is not None:
        budget.bytes = budget.bytes or res.saved_bytes  # the baseline's, at the demo batch
        _at_budget(trained, res, budget)
