"""2023 `slapo.env`: `setup(rank, world_size)`, `cleanup()`, `execute(fn, args)`.

Fixed 2023 bugs: `setup` hard-coded MASTER_ADDR/PORT (overwriting a launcher's) and the NCCL
backend (failing on CPU). Here an address/port already in the environment wins, and the backend
defaults to NCCL only when CUDA is available, else gloo.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slapo.distributed.group import leave_process_group


def setup(rank: int, world_size: int, backend: str | None = None) -> None:
    """Join a process group of `world_size` ranks as `rank` (what the spawned `fn` calls)."""
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def cleanup() -> None:
    """Leave the process group (no-op when none was joined), letting gloo's worker threads
    finish first (`slapo.distributed.group.leave_process_group`)."""
    leave_process_group()


def execute(fn: Callable[..., Any], args: Any) -> None:
    """Spawn `fn(rank, args)` on N processes: N is `args` when it is an int, else
    `args.world_size` (the 2023 contract)."""
    import torch.multiprocessing as mp

    nprocs = args if isinstance(args, int) else args.world_size
    mp.spawn(fn, args=(args,), nprocs=nprocs, join=True)
