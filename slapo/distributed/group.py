"""Process-group helpers that also work when torch.distributed is not initialised.

A schedule built without a process group behaves as a world of one rank: shards are the whole
tensor and every collective is the identity, so the same schedule runs in a notebook and under
torchrun. A `VirtualGroup` is a group of several ranks that exists only in this process (the cost
model's stand-in for one rank of a tensor-parallel group).
"""

from __future__ import annotations

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

    Why: the cost model (`slapo.model_schedule.plan.shard_block`) applies a family's real plan to
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
