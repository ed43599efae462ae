"""2023 `slapo.random` (and `slapo.checkpoint`): the Megatron-style RNG API over today's
device-agnostic tracker (`slapo.distributed.rng`).

- `set_random_seed(seed=2013, dp_rank=None, pp_rank=None, tp_rank=None,
  always_enable_tp_seed=False)`: the 2023 signature (positional order included). The default
  stream is offset by 100*pp_rank + 10*dp_rank; with a `tp_rank` the tensor-parallel stream is
  seeded per rank, **on CPU too** (2023 added it only with CUDA, so `fork_rng` failed on CPU with
  "rng state not added"). `always_enable_tp_seed` seeds the default stream with the TP seed as
  well (2023's switch for sequence parallelism).
- `get_cuda_rng_tracker()`: the tracker (`add`, `fork`, `get_states`, `set_states`, `reset`);
  it holds CPU and CUDA states, the name is kept for 2023 code.
- `is_random_seed_set()`: whether the tracker holds a stream.
- `checkpoint(function, *args, use_reentrant=..., **kwargs)`: activation checkpointing of a
  function that replays the tracker's streams in recomputation. Always non-reentrant: 2023's
  default reentrant checkpoint could not take keyword arguments and is deprecated by PyTorch;
  gradients are the same. `use_reentrant` is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .distributed import rng as _rng
from .distributed.rng import RNGStatesTracker, get_rng_tracker


def set_random_seed(seed: int = 2013, dp_rank: int | None = None, pp_rank: int | None = None,
                    tp_rank: int | None = None, always_enable_tp_seed: bool = False) -> None:
    """Seed python/numpy/torch and (with `tp_rank`) the per-rank tensor-parallel stream."""
    _rng.set_random_seed(seed, tp_rank=tp_rank, dp_rank=dp_rank or 0, pp_rank=pp_rank or 0)
    if always_enable_tp_seed and tp_rank is not None:
        base = seed + 100 * (pp_rank or 0) + 10 * (dp_rank or 0)
        torch.manual_seed(base + _rng._TP_SEED_OFFSET + tp_rank)


def get_cuda_rng_tracker() -> RNGStatesTracker:
    """The RNG tracker (2023 name; it tracks CPU and CUDA generators)."""
    return get_rng_tracker()


def is_random_seed_set() -> bool:
    """Whether `set_random_seed(..., tp_rank=...)` added a stream to the tracker."""
    return bool(get_rng_tracker().get_states())


def checkpoint(function: Callable, *args: Any, use_reentrant: bool = True,
               **kwargs: Any) -> Any:
    """`function(*args, **kwargs)` with its activations recomputed in backward; dropout in
    tracker streams draws the same masks in the recomputation as in the forward."""
    tracker = get_rng_tracker()
    snapshot = tracker.get_states()
    first = [True]

    def run(*a, **k):
        if first[0] or not snapshot:  # the forward itself: nothing to replay
            first[0] = False
            return function(*a, **k)
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            return function(*a, **k)
        finally:
            tracker.set_states(current)

    return _torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


__all__ = ["checkpoint", "get_cuda_rng_tracker", "is_random_seed_set", "set_random_seed"]
