"""Process-group helpers that also work when torch.distributed is not initialised.

A schedule built without a process group behaves as a world of one rank: shards are the whole
tensor and every collective is the identity, so the same schedule runs in a notebook and under
torchrun. A `VirtualGroup` is a group of several ranks that exists only in this process (the cost
model's stand-in for one rank of a tensor-parallel group).
"""

from __future__ import annotations

import atexit
import time

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    if isinstance(group, VirtualGroup):
        return group.size
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    if isinstance(group, VirtualGroup):
        return group.rank
    return dist.get_rank(group) if is_initialized() else 0


def default_group():
    """The default process group if torch.distributed is initialised, else None."""
    return dist.group.WORLD if is_initialized() else None


class VirtualGroup:
    """A tensor-parallel group of `size` ranks that exists only in this process, where this
    process plays rank `rank`.

    Why: the cost model (`slapo.model_schedule.plan_block.shard_block`) applies a family's real plan to
    a copy of one block to capture what *one rank* computes and saves, without starting `size`
    processes. `world_size()`/`rank()` report it like a process group, so `shard` keeps this
    rank's slices; the collectives in `slapo.distributed.collectives` move no data on it (an
    all-reduce is the identity, a gather repeats this rank's piece, a scatter keeps this rank's
    chunk), so activations have one real rank's shapes but not the model's values."""

    def __init__(self, size: int, rank: int = 0):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"VirtualGroup size must be a positive int, got {size!r}.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"VirtualGroup rank must be in [0, {size}), got {rank!r}.")
        self.size, self.rank = size, rank

    def __repr__(self) -> str:
        return f"VirtualGroup(size={self.size}, rank={self.rank})"


def is_virtual(group) -> bool:
    return isinstance(group, VirtualGroup)


GLOO_EXIT_GRACE_S = 0.1


def leave_process_group() -> None:
    """Destroy the default process group (a no-op when there is none), then, under gloo, sleep
    `GLOO_EXIT_GRACE_S` so gloo's worker threads can release their last collectives before the
    interpreter finalises.

    Why the sleep: a gloo worker thread drops its reference to a collective only *after*
    marking it complete. When the collective holds tensors Python also holds (DeepSpeed
    ZeRO-3's all-gathers do), that drop needs the GIL. If the main thread has begun finalising
    by then, CPython ends the worker with `pthread_exit`; the unwind meets a `noexcept` frame,
    and the process aborts with "terminate called without an active exception" (exit -6)
    after training finished (gdb: `ProcessGroupGloo::runLoop` -> `~AsyncAllgatherWork` ->
    `decref_pyobject` -> `take_gil` -> `PyThread_exit_thread`). Gloo has no `shutdown()` that
    joins those threads (only its destructor does, and ZeRO-3's parameters keep the group
    alive). The sleep releases the GIL so a waiting worker gets it. Measured on a 2-core VM,
    torch 2.13, the 2023 OPT ZeRO-3 script on 2 ranks: 5 aborts in 25 runs with
    `destroy_process_group()` alone, 0 in 60 with the grace, and 0 in 30 with no teardown but
    `guard_gloo_exit`'s hook. NCCL's teardown is not affected and skips the sleep."""
    if not is_initialized():
        return
    gloo = _is_gloo()
    dist.destroy_process_group()
    if gloo:
        time.sleep(GLOO_EXIT_GRACE_S)


_exit_grace_registered = False


def guard_gloo_exit() -> None:
    """Register, once per process, an `atexit` hook giving gloo's worker threads the grace of
    `leave_process_group` when a script ends without leaving its group (2023 scripts never
    did). `atexit` hooks run before the interpreter starts finalising, so a worker waiting for
    the GIL still gets it. `slapo.build` calls this."""
    global _exit_grace_registered
    if not _exit_grace_registered and is_initialized() and _is_gloo():
        atexit.register(_exit_grace)
        _exit_grace_registered = True


def _exit_grace() -> None:
    if is_initialized() and _is_gloo():
        time.sleep(GLOO_EXIT_GRACE_S)


def _is_gloo() -> bool:
    return "gloo" in str(dist.get_backend()).lower()
