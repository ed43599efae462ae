"""`fork_rng`: run a module in the per-rank tensor-parallel RNG stream."""

from __future__ import annotations

import numbers

import torch
from torch import nn

from .. import module_patch
from ..distributed.rng import TP_STREAM, default_states, get_rng_tracker
from ..errors import SchedulingError
from .base import Primitive, register_primitive

DRAWS = ("any", "dropout")
STREAMS = ("tp", "shared")


class ForkRNGWrapper(module_patch.ForwardWrapper):
    """Swap in the TP stream around the module's forward. With `draws="dropout"` (the module's
    only random ops are dropouts) a call that cannot drop anything (`may_drop`) runs without
    the swap: the result is the same (no number is drawn from either stream), and under
    `torch.compile` the swap's `get_rng_state`/`set_rng_state` are graph breaks, which split
    every compiled block of a TP model in two or three (seen: LLaMA at tp=2 with
    `compile_blocks`, attention dropout 0, 4 graphs and 12 breaks per step instead of 1)."""

    name = "fork_rng"

    def __init__(self, seed_offset: int, draws: str = "any", stream: str = "tp"):
        self.seed_offset = seed_offset
        self.draws = draws
        self.stream = stream

    def __call__(self, module, fn, args, kwargs):
        if self.draws == "dropout" and not may_drop(module, args, kwargs):
            if torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            return _without_draws(module, fn, args, kwargs)
        tracker = get_rng_tracker()
        if self.stream == "shared":
            with tracker.shared():
                return fn(*args, **kwargs)
        if not tracker.has(TP_STREAM):  # not seeded by set_random_seed: derive deterministically
            tracker.add(TP_STREAM, torch.initial_seed() + self.seed_offset)
        with tracker.fork(TP_STREAM):
            return fn(*args, **kwargs)


def _without_draws(module: nn.Module, fn, args: tuple, kwargs: dict):
    """Run `fn` outside the TP stream and check that it drew no random number (eager only; a
    compiled block relies on the tests of every family). A draw here means `may_drop` missed
    a probability (a transformers release that keeps it elsewhere, a module with noise of its
    own): its masks would be the same on every rank, so it is an error, not a warning."""
    before = default_states()
    out = fn(*args, **kwargs)
    after = default_states()
    if not all(a is None or torch.equal(a, b) for a, b in zip(before, after, strict=True)):
        raise SchedulingError(
            "", f"{type(module).__name__} drew random numbers although every dropout "
            "probability fork_rng(draws='dropout') sees in it is 0 (or it is in eval mode): "
            "its draws would be the same on every tensor-parallel rank.",
            "fork it with fork_rng(draws='any'), or report the module: Slapo's ready "
            "schedule should have seen its dropout.")
    return out


def may_drop(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether this call of `module`, whose only random ops are dropouts, may draw a random
    number: some module in it is training and some dropout probability it can see is above 0.

    Seen probabilities: an `nn.Dropout`'s `p`; a number attribute of the module or a submodule
    whose name has "drop" in it or is `p` (HF attention keeps `attention_dropout`, T5 and OPT
    `dropout`, Slapo's ops `p` / `dropout`); a keyword argument of the call so named (HF hands
    an attention core `dropout=`), and any positional number argument. Conservative: any such
    number above 0 counts, and a module it cannot judge should keep `draws="any"`. Traceable by
    `torch.compile` without a break (attribute reads become guards: a changed probability
    recompiles, then forks)."""
    if not any(m.training for m in module.modules()):
        return False
    if any(_positive(v) for v in args):
        return True
    if any(_droplike(k) and _positive(v) for k, v in kwargs.items()):
        return True
    compiling = torch.compiler.is_compiling()
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            return True
        names = m.__dict__.get(_NAMES) if compiling else droplike_names(m)
        if names is None:  # never looked at outside dynamo: look now, without keeping it
            names = _scan(m)
        if any(_positive(getattr(m, k, None)) for k in names):
            return True
    return False


# The names of a module's droplike number attributes, kept on the module. torch 2.11's dynamo
# cannot iterate a module's `__dict__` (a graph break in every forked call), so a compiled call
# reads the names found by the last eager look: `fork_rng(draws="dropout")` and `checkpoint`
# look at their subtrees when applied, and every eager call looks again. The values are read
# live (guards), so a changed probability is seen. A module never looked at is scanned in the
# compiled call itself (exact; on torch 2.11 a graph break, on 2.12+ none).
_NAMES = "_slapo_droplike"


def _scan(module: nn.Module) -> tuple[str, ...]:
    return tuple(k for k, v in module.__dict__.items()
                 if _droplike(k) and isinstance(v, numbers.Real) and not isinstance(v, bool))


def droplike_names(module: nn.Module) -> tuple[str, ...]:
    """Find (and keep on `module`) the names of its droplike number attributes."""
    names = module.__dict__[_NAMES] = _scan(module)
    return names


def look_for_dropouts(module: nn.Module) -> None:
    """Keep the droplike names of every module in `module`'s subtree (see `_NAMES`)."""
    for m in module.modules():
        droplike_names(m)


def _droplike(name: str) -> bool:
    return name == "p" or "drop" in name.lower()


def _positive(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


@register_primitive
class ForkRNGPrimitive(Primitive):
    """Draw random numbers (dropout) in this module from the tensor-parallel RNG stream.

    Inside a sharded region each rank holds different heads/features, so their dropout masks
    must differ; outside, masks must agree. The stream is seeded per rank by
    `slapo.set_random_seed(seed, tp_rank=rank)` (or, if not seeded, from `torch.initial_seed()`
    + 2718 + rank), is reproducible, and is replayed exactly under `checkpoint`.

    `draws="dropout"` says the module's only random ops are dropouts whose probabilities it
    holds or is handed (`may_drop`): a call that cannot drop (every probability 0, or eval
    mode) then skips the stream swap, which keeps a compiled block whole. The default "any"
    always swaps (a module drawing noise of its own). The ready schedules use "dropout" on the
    HF modules they fork, whose dropouts `tests/test_silent_wrong.py` checks are all seen.

    `stream="shared"` does the opposite inside a forked region: the module draws from the
    default stream, the same on every rank (a LoRA dropout on a column-parallel projection's
    replicated input, inside a per-rank attention module: `model_schedule/lora.py`).
    """

    name = "fork_rng"

    @classmethod
    def validate(cls, sch, draws: str = "any", stream: str = "tp"):
        if draws not in DRAWS:
            raise SchedulingError(sch.path, f"fork_rng(draws={draws!r}) is not a kind of random "
                                  "op.", f"use one of {', '.join(map(repr, DRAWS))}.")
        if stream not in STREAMS:
            raise SchedulingError(sch.path, f"fork_rng(stream={stream!r}) is not a stream.",
                                  f"use one of {', '.join(map(repr, STREAMS))}.")
        if any(isinstance(w, ForkRNGWrapper) for w in module_patch.wrappers(sch.mod)):
            raise SchedulingError(sch.path, "fork_rng was already applied to this module.",
                                  "remove the second call.")

    @classmethod
    def apply(cls, sch, draws: str = "any", stream: str = "tp"):
        module_patch.add_wrapper(sch.mod, ForkRNGWrapper(2718 + sch.tp_rank, draws, stream))
        if draws == "dropout":
            look_for_dropouts(sch.mod)
