"""Named RNG streams that work on CPU and CUDA (a device-agnostic Megatron RNG tracker).

Dropout inside a tensor-parallel region must draw *different* masks on each rank (each rank holds
different heads), while dropout outside must draw the *same* mask. `fork_rng` runs a module inside
the "tensor-parallel" stream, seeded per rank, and leaves the default stream untouched.

Checkpointed regions snapshot the tracker so the recomputation draws the same masks.
"""

from __future__ import annotations

import contextlib
import random

import torch

TP_STREAM = "tensor-parallel"
_TP_SEED_OFFSET = 2718


def default_states() -> tuple[torch.Tensor, torch.Tensor | None]:
    """The default generators' states (CPU, and CUDA when present)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None


def _restore(state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


class RNGStatesTracker:
    """Holds one (cpu, cuda) generator state per named stream.

    `fork(name)` runs a block in a stream; `shared()` runs a block in the default (shared)
    stream even inside a fork: a LoRA dropout on the replicated input of a column-parallel
    projection inside a per-rank region must draw the same mask on every rank. While a stream
    is forked its live state is in the generators, so the active forks are kept on a stack:
    `shared()` writes the live state back and restores the state the fork saved, and the fork
    then leaves with the default stream as `shared()` advanced it. A fork of the stream that is
    already live is a no-op (restoring its saved state there would draw the same numbers again).
    """

    def __init__(self) -> None:
        self._states: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._active: list[list] = []  # [stream name or None (shared), outer state]

    def reset(self) -> None:
        self._states.clear()

    def has(self, name: str) -> bool:
        return name in self._states

    def add(self, name: str, seed: int) -> None:
        outer = default_states()
        torch.manual_seed(seed)
        self._states[name] = default_states()
        _restore(outer)

    # The state tensors are snapshots (`get_rng_state` returns a new tensor, and nothing here
    # writes into one), so sharing them is safe and needs no tensor op: a snapshot taken inside
    # a selectively checkpointed region must not run ops the forward did not run.
    def get_states(self) -> dict:
        return dict(self._states)

    def set_states(self, states: dict) -> None:
        self._states = dict(states)

    def live(self) -> str | None:
        """The stream the generators hold now (None: the default one)."""
        return self._active[-1][0] if self._active else None

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        if name not in self._states:
            raise KeyError(name)
        if self.live() == name:
            yield
            return
        entry = [name, default_states()]
        self._active.append(entry)
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = default_states()
            self._active.pop()
            _restore(entry[1])

    @contextlib.contextmanager
    def shared(self):
        """Run the block in the default stream, also inside a fork."""
        name = self.live()
        if name is None:
            yield
            return
        fork_entry = self._active[-1]
        self._states[name] = default_states()
        self._active.append([None, None])
        _restore(fork_entry[1])
        try:
            yield
        finally:
            fork_entry[1] = default_states()
            self._active.pop()
            _restore(self._states[name])


_TRACKER = RNGStatesTracker()


@contextlib.contextmanager
def states_kept():
    """Run a block that must leave every random stream as it found it (the default generators
    and the tracker's streams): e.g. torch's pipeline shape inference, whose throw-away forward
    draws dropout masks."""
    outer, tracked = default_states(), _TRACKER.get_states()
    try:
        yield
    finally:
        _restore(outer)
        _TRACKER.set_states(tracked)


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


def set_random_seed(seed: int = 2013, *, tp_rank: int | None = None, dp_rank: int = 0,
                    pp_rank: int = 0, cp_rank: int = 0) -> None:
    """Seed python, numpy and torch, and the per-rank tensor-parallel stream.

    The default stream is the same on all tensor-parallel ranks of a data-parallel replica
    (offset by dp/pp rank, as Megatron does); the tensor-parallel stream differs per `tp_rank`.
    Context-parallel ranks hold different tokens of the same sequences, so they draw apart too
    (`cp_rank`): with one stream their chunks' dropout masks would repeat each other, a
    different distribution from one process's independent mask over the whole sequence.
    """
    base = seed + 100 * pp_rank + 10 * dp_rank + 7919 * cp_rank
    random.seed(base)
    try:
        import numpy as np

        np.random.seed(base % (2**32))
    except ImportError:  # pragma: no cover
        pass
    torch.manual_seed(base)
    _TRACKER.reset()
    if tp_rank is not None:
        _TRACKER.add(TP_STREAM, base + _TP_SEED_OFFSET + tp_rank)
