"""2023 `slapo.random` (and `slapo.checkpoint`): the Megatron-style RNG API over today's
device-agnostic tracker (`slapo.distributed.rng`).

- `set_random_seed(seed=2013, dp_rank=None, pp_rank=None, tp_rank=None,
  always_enable_tp_seed=False)`: the 2023 signature (positional order included). The default
  stream is offset by 100*pp_rank + 10*dp_rank; with a `tp_rank` the tensor-parallel stream is
  seeded per rank, **on CPU too** (2023 added it only with CUDA, so `fork_rng` failed on CPU with
  "rng state not added"). `always_enable_tp_seed` seeds the default stream with the TP seed as
  well (2023's switch for sequence parallelism).
- `get_cuda_rng_tracker()` / `_CUDA_RNG_STATE_TRACKER`: a `CudaRNGStatesTracker`, the 2023
  API (`add`, `fork`, `get_states`, `set_states`, `reset`) over today's tracker, the one
  `fork_rng` and `checkpoint` use: the same streams, CPU and CUDA states both. 2023's name of
  the tensor-parallel stream, "model-parallel-rng" (`_MODEL_PARALLEL_RNG_TRACKER_NAME`), is
  today's "tensor-parallel"; `add` refuses a seed or name already in use, as 2023's did.
  A stream's state is a (CPU state, CUDA state or None) pair (2023: the CUDA state tensor).
- `model_parallel_cuda_manual_seed(seed, tp_rank, always_enable_tp_seed)`: reset the tracker,
  seed the default stream (with the TP seed if `always_enable_tp_seed`), add the TP stream
  seeded `seed + 2718 + tp_rank`, return that seed.
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
from .distributed.rng import TP_STREAM, RNGStatesTracker, get_rng_tracker

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"  # 2023's name of the TP stream


def set_random_seed(seed: int = 2013, dp_rank: int | None = None, pp_rank: int | None = None,
                    tp_rank: int | None = None, always_enable_tp_seed: bool = False) -> int:
    """Seed python/numpy/torch and (with `tp_rank`) the per-rank tensor-parallel stream;
    returns this rank's seed of the default stream (before the TP offset), as 2023 did."""
    _rng.set_random_seed(seed, tp_rank=tp_rank, dp_rank=dp_rank or 0, pp_rank=pp_rank or 0)
    base = seed + 100 * (pp_rank or 0) + 10 * (dp_rank or 0)
    if always_enable_tp_seed and tp_rank is not None:
        torch.manual_seed(base + _rng._TP_SEED_OFFSET + tp_rank)
    return base


class CudaRNGStatesTracker:
    """2023's tracker API over one of today's `RNGStatesTracker`s (a new one, or the global one
    for `get_cuda_rng_tracker()`): same streams, 2023's stream name and refusals."""

    def __init__(self, tracker: RNGStatesTracker | None = None) -> None:
        self._tracker = tracker if tracker is not None else RNGStatesTracker()
        self._seeds: dict[str, int] = {}  # the seed each stream was added with (2023's check)

    @staticmethod
    def _name(name: str) -> str:
        return TP_STREAM if name == _MODEL_PARALLEL_RNG_TRACKER_NAME else name

    def reset(self) -> None:
        self._tracker.reset()
        self._seeds.clear()

    def has(self, name: str) -> bool:
        return self._tracker.has(self._name(name))

    def get_states(self) -> dict:
        """{name: state}; the TP stream under both its names."""
        states = self._tracker.get_states()
        if TP_STREAM in states:
            states[_MODEL_PARALLEL_RNG_TRACKER_NAME] = states[TP_STREAM]
        return states

    def set_states(self, states: dict) -> None:
        states = dict(states)
        alias = states.pop(_MODEL_PARALLEL_RNG_TRACKER_NAME, None)
        if alias is not None:
            states.setdefault(TP_STREAM, alias)
        self._tracker.set_states(states)

    def add(self, name: str, seed: int) -> None:
        """Add stream `name` seeded `seed`; a seed or a name already in use is refused."""
        name = self._name(name)
        live = {n: s for n, s in self._seeds.items() if self._tracker.has(n)}
        if seed in live.values():
            raise ValueError(f"seed {seed} already exists (stream "
                             f"{next(n for n, s in live.items() if s == seed)!r}).")
        if self._tracker.has(name):
            raise ValueError(f"rng state {name!r} already exists.")
        self._tracker.add(name, seed)
        self._seeds = {**live, name: seed}

    def fork(self, name: str = TP_STREAM):
        """Context manager running its block in stream `name` (default: the TP stream)."""
        if not self._tracker.has(self._name(name)):
            raise RuntimeError(f"rng state {name!r} is not added. Did you call "
                               "slapo.set_random_seed(..., tp_rank=...)?")
        return self._tracker.fork(self._name(name))


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker(get_rng_tracker())


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The RNG tracker (2023 name and API; it tracks CPU and CUDA generators)."""
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int,
                                    always_enable_tp_seed: bool = False) -> int:
    """Reset the tracker, seed the default stream with `seed` (the TP seed when
    `always_enable_tp_seed`) and add the TP stream seeded `seed + 2718 + tp_rank`; returns
    the TP seed. (2023 seeded the CUDA generator only; here the default generators.)"""
    tp_seed = seed + _rng._TP_SEED_OFFSET + tp_rank
    _CUDA_RNG_STATE_TRACKER.reset()
    torch.manual_seed(tp_seed if always_enable_tp_seed else seed)
    _CUDA_RNG_STATE_TRACKER.add(TP_STREAM, tp_seed)
    return tp_seed


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


__all__ = ["CudaRNGStatesTracker", "checkpoint", "get_cuda_rng_tracker", "is_random_seed_set",
           "model_parallel_cuda_manual_seed", "set_random_seed"]
