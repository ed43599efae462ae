"""Process-group helpers that also work when torch.distributed is not initialised.

A schedule built without a process group behaves as a world of one rank: shards are the whole
tensor and every collective is the identity, so the same schedule runs in a notebook and under
torchrun.
"""

from __future__ import annotations

import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def default_group():
    """The default process group if torch.distributed is initialised, else None."""
    return dist.group.WORLD if is_initialized() else None
