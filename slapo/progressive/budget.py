"""The activation-budget search: the largest batch whose *measured* saved-for-backward bytes fit
the baseline's (see the package docstring). Pure bookkeeping: what to measure next and the
batches to measure on; `measure.py` does the measuring."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import SlapoError

OVER = 2**62  # the "bytes" of a forward that ran out of device memory: fits no budget


def batch_candidates(batch: int, max_factor: int) -> list[int]:
    """`batch` times 1, 2, 4, ... up to `max_factor`, and its halvings down to 1, ascending."""
    if batch < 1 or max_factor < 1:
        raise SlapoError(f"batch ({batch}) and max_factor ({max_factor}) must be >= 1")
    out = {batch}
    f = 2
    while f <= max_factor:
        out.add(batch * f)
        f *= 2
    b = batch // 2
    while b >= 1:
        out.add(b)
        b //= 2
    return sorted(out)


def largest_fitting(candidates: list[int], measure: Callable[[int], int], budget: int,
                    known: tuple[int, int]) -> tuple[int, int] | None:
    """(batch, measured bytes) of the largest candidate whose *measured* bytes fit `budget`.

    `known` is (batch, bytes) already measured (the demo batch): its per-sample bytes pick the
    first candidate to measure. The search then walks down while a measurement exceeds the
    budget and up while one fits, so the answer is a measured fit whose next candidate was
    measured *not* to fit (or is past the cap). A prediction alone is not trusted either way:
    fixed costs (autocast weight copies, position tensors) make bytes affine, not linear, in the
    batch. Usually two measurements. Returns None when not even the smallest candidate fits.
    """
    cache = {known[0]: known[1]}

    def m(b: int) -> int:
        if b not in cache:
            cache[b] = measure(b)
        return cache[b]

    per_sample = known[1] / known[0]
    fits = [i for i, b in enumerate(candidates) if per_sample * b <= budget]
    i, ceiling = (fits[-1] if fits else 0), len(candidates)
    while True:
        if m(candidates[i]) > budget:
            ceiling = i
            if i == 0:
                return None
            i -= 1
        elif i + 1 < ceiling:
            i += 1
        else:
            return candidates[i], m(candidates[i])


def tiled_batches(batches: list[dict]) -> Callable[[int], dict]:
    """A `make_batch(n)` that cycles through the rows of `batches` (used when the caller gives
    no source of fresh samples): every call returns the next n rows."""
    keys = [k for k, v in batches[0].items() if isinstance(v, torch.Tensor)]
    pool = {k: torch.cat([b[k] for b in batches]) for k in keys}
    total = next(iter(pool.values())).shape[0]
    pos = [0]

    def make(n: int) -> dict:
        idx = (torch.arange(n) + pos[0]) % total
        pos[0] = (pos[0] + n) % total
        return {k: v[idx.to(v.device)] for k, v in pool.items()}

    return make


class BatchSource:
    """Batches of a given size, drawn once and reused by every step (same data, fair ratios)."""

    def __init__(self, make_batch: Callable[[int], dict], device: torch.device | None):
        self.make, self.device, self.cache = make_batch, device, {}

    def get(self, size: int, n: int) -> list[dict]:
        have = self.cache.setdefault(size, [])
        while len(have) < n:
            b = self.make(size)
            if self.device is not None:
                b = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in b.items()}
            have.append(b)
        return have[:n]


@dataclass
class Budget:
    """What the budget search needs from `run`."""

    bytes: int
    max_factor: int
    timed_steps: int
    warmup: int
    source: BatchSource
    tokens_per_sample: float
