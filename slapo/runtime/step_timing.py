"""Timing the training step: the one place a caller measures `Trainer.train_step` (tune trials,
the progressive demo), so what is tuned and demonstrated is the step `slapo train` runs."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .batch import Batch
from .trainer import Trainer


@dataclass
class StepTimes:
    """Wall seconds and loss of each `train_step` that `time_steps` ran, in order."""

    seconds: list[float]
    losses: list[float]

    def fastest(self, skip: int = 0) -> float:
        """The least disturbed estimate of a step's cost: on a shared machine other jobs only
        ever add time, so the minimum after `skip` warm-up steps (NaN when none is left)."""
        rest = self.seconds[skip:]
        return min(rest) if rest else float("nan")


def _synchronize(trainer: Trainer) -> None:
    """Wait for the accelerator, so the clock covers the work the step queued."""
    for part in trainer.parts:
        for p in part.parameters():
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)
            return  # a rank's parts share one device: the first parameter's


def _barrier(enabled: bool) -> None:
    if enabled and dist.is_available() and dist.is_initialized():
        dist.barrier()


def time_steps(trainer: Trainer, batches: Iterable[Batch], *,
               barrier: bool = False) -> StepTimes:
    """Run `trainer.train_step(batch)` for each batch; return each step's seconds and loss.

    Why a helper: tune trials and `slapo train --progressive` time exactly the step `slapo
    train` runs, and time it the same way: the device is synchronised before each clock read
    (queued kernels count). `barrier=True` aligns the ranks before and after each step, so
    every rank reports the slowest rank's time (a tensor-parallel step is a collective; a rank
    that started late would otherwise look slow)."""
    seconds, losses = [], []
    for batch in batches:
        _barrier(barrier)
        _synchronize(trainer)
        t0 = time.perf_counter()
        loss = trainer.train_step(batch)
        _synchronize(trainer)
        _barrier(barrier)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    return StepTimes(seconds, losses)
