"""`fork_rng`: run a module in the per-rank tensor-parallel RNG stream."""

from __future__ import annotations

import torch

from .. import module_patch
from ..distributed.rng import TP_STREAM, get_rng_tracker
from ..errors import SchedulingError
from .base import Primitive, register_primitive


class ForkRNGWrapper(module_patch.ForwardWrapper):
    name = "fork_rng"

    def __init__(self, seed_offset: int):
        self.seed_offset = seed_offset

    def __call__(self, module, fn, args, kwargs):
        tracker = get_rng_tracker()
        if not tracker.has(TP_STREAM):  # not seeded by set_random_seed: derive deterministically
            tracker.add(TP_STREAM, torch.initial_seed() + self.seed_offset)
        with tracker.fork(TP_STREAM):
            return fn(*args, **kwargs)


@register_primitive
class ForkRNGPrimitive(Primitive):
    """Draw random numbers (dropout) in this module from the tensor-parallel RNG stream.

    Inside a sharded region each rank holds different heads/features, so their dropout masks
    must differ; outside, masks must agree. The stream is seeded per rank by
    `slapo.set_random_seed(seed, tp_rank=rank)` (or, if not seeded, from `torch.initial_seed()`
    + 2718 + rank), is reproducible, and is replayed exactly under `checkpoint`.
    """

    name = "fork_rng"

    @classmethod
    def validate(cls, sch):
        if any(isinstance(w, ForkRNGWrapper) for w in module_patch.wrappers(sch.mod)):
            raise SchedulingError(sch.path, "fork_rng was already applied to this module.",
                                  "remove the second call.")

    @classmethod
    def apply(cls, sch):
        module_patch.add_wrapper(sch.mod, ForkRNGWrapper(2718 + sch.tp_rank))
