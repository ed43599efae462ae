"""`checkpoint`: recompute a module's activations in backward instead of storing them."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import module_patch
from ..distributed.rng import get_rng_tracker
from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import GRAPH_HANDLERS, Primitive, register_primitive


class CheckpointWrapper(module_patch.ForwardWrapper):
    """Non-reentrant torch.utils.checkpoint around the module's forward.

    Keyword arguments pass through untouched (no flattening). The default RNG state is preserved
    by torch, and the tensor-parallel RNG streams (`fork_rng`) are snapshotted here, so dropout
    draws the same masks during recomputation.
    """

    name = "checkpoint"

    def __init__(self, order_args_fn: Callable | None = None, condition: Callable | None = None):
        self.order_args_fn = order_args_fn
        self.condition = condition

    def __call__(self, module, fn, args, kwargs):
        if not torch.is_grad_enabled() or (self.condition is not None and
                                           not self.condition(module)):
            return fn(*args, **kwargs)
        args, kwargs = _drop_empty_caches(module, args, kwargs)
        if self.order_args_fn is not None:
            args, kwargs = tuple(self.order_args_fn(*args, **kwargs)), {}
        tracker = get_rng_tracker()
        snapshot = tracker.get_states()
        first = [True]

        def run(*a, **k):
            if first[0]:
                first[0] = False
                return fn(*a, **k)
            current = tracker.get_states()
            tracker.set_states(snapshot)
            try:
                return fn(*a, **k)
            finally:
                tracker.set_states(current)

        return _torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                 **kwargs)


def _is_kv_cache(x) -> bool:
    return hasattr(x, "get_seq_length") and hasattr(x, "update")


_WARNED: set[str] = set()


def _drop_empty_caches(module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A KV cache is state the forward *appends to*: recomputation would append twice (the keys
    double in length). As HF's own gradient checkpointing does, a checkpointed layer runs
    without the cache (outputs are unchanged; the returned cache lacks this layer's keys)."""
    if not any(_is_kv_cache(a) for a in (*args, *kwargs.values())):
        return args, kwargs
    name = type(module).__name__
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(f"checkpointed {name} runs without its KV cache (recomputation would "
                      "append to it twice); pass use_cache=False to silence this.",
                      stacklevel=4)
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


@register_primitive
class CheckpointPrimitive(Primitive):
    """Activation checkpointing for this module (non-reentrant `torch.utils.checkpoint`).

    Only the module's inputs are kept for backward; its internals are recomputed. Keyword
    arguments are supported as they are. `condition(module) -> bool` is evaluated at each call
    (e.g. `lambda m: m.training`); `order_args_fn(*args, **kwargs) -> tuple` is accepted for
    compatibility with Slapo 2023 and turns the call into positional arguments. Passing a
    subgraph (from `find`) checkpoints only those ops of a traced module.
    """

    name = "checkpoint"

    @classmethod
    def validate(cls, sch, subgraph=None, order_args_fn=None, condition=None):
        if subgraph is not None:
            refuse_in_export_capture(sch, "subgraph checkpoint", "trace with tracer='fx', or "
                                     "checkpoint the whole module.")
            if "checkpoint" not in GRAPH_HANDLERS:
                raise SchedulingError(sch.path, "subgraph checkpointing needs the compute "
                                      "primitives, which are not available.",
                                      "checkpoint the whole module instead.")
            return
        for nm, f in (("order_args_fn", order_args_fn), ("condition", condition)):
            if f is not None and not callable(f):
                raise SchedulingError(sch.path, f"{nm} must be callable, got {f!r}.",
                                      f"pass a function or None for {nm}.")
        if any(isinstance(w, CheckpointWrapper) for w in module_patch.wrappers(sch.mod)):
            raise SchedulingError(sch.path, "this module is already checkpointed.",
                                  "remove the second checkpoint call.")

    @classmethod
    def apply(cls, sch, subgraph=None, order_args_fn=None, condition=None):
        if subgraph is not None:
            return GRAPH_HANDLERS["checkpoint"](sch, subgraph)
        module_patch.add_wrapper(sch.mod, CheckpointWrapper(order_args_fn, condition))
