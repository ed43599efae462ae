"""`checkpoint`: recompute a module's activations in backward instead of storing them."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from .. import module_patch
from ..distributed.rng import get_rng_tracker
from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive


class CheckpointWrapper(module_patch.ForwardWrapper):
    """Non-reentrant torch.utils.checkpoint around the module's forward.

    Keyword arguments pass through untouched (no flattening). The default RNG state is preserved
    by torch, and the tensor-parallel RNG streams (`fork_rng`) are snapshotted here, so dropout
    draws the same masks during recomputation.
    """

    name = "checkpoint"

    def __init__(self, order_args_fn: Callable | None = None, condition: Callable | None = None,
                 policy: str | Callable | None = None):
        self.order_args_fn = order_args_fn
        self.condition = condition
        self.policy = policy

    def __call__(self, module, fn, args, kwargs):
        if not torch.is_grad_enabled() or (self.condition is not None and
                                           not self.condition(module)):
            return fn(*args, **kwargs)
        args, kwargs = _drop_empty_caches(module, args, kwargs)
        if self.order_args_fn is not None:
            args, kwargs = tuple(self.order_args_fn(*args, **kwargs)), {}
        extra = {}
        if self.policy is not None:
            extra["context_fn"] = selective_context_fn(self.policy)
        if not _forks_rng(module):  # nothing to replay: no Python side effects, so
            # torch.compile traces the checkpoint as one region
            return _torch_checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                                     **extra, **kwargs)
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
                                 **extra, **kwargs)


# Ops whose outputs selective checkpointing keeps: the matmuls and attention kernels (costly to
# recompute, and their outputs are what the next op needs). Everything else (norms, activations,
# dropout, residual adds, casts) is recomputed: cheap, memory-bound, and the bulk of the bytes.
def _compute_intensive_ops() -> set:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward", "convolution",
             "_scaled_dot_product_fused_attention_overrideable"]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)}


POLICIES = ("selective",)


def selective_policy(ctx, op, *args, **kwargs):
    """Save matmul/attention outputs, recompute the rest (see `_compute_intensive_ops`)."""
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


_SAVE_OPS = _compute_intensive_ops()


def selective_context_fn(policy: str | Callable) -> Callable:
    """`context_fn` for torch.utils.checkpoint: "selective" or a policy
    `(ctx, op, *args, **kwargs) -> CheckpointPolicy` of the user's."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    fn = selective_policy if policy == "selective" else policy
    # a functools.partial (not a closure): torch.compile traces checkpoint only with one
    return functools.partial(create_selective_checkpoint_contexts, fn)


def _forks_rng(module) -> bool:
    """Whether dropout inside `module` draws from a tensor-parallel RNG stream (`fork_rng`),
    whose state the recomputation must replay."""
    return any(w.name == "fork_rng" for m in module.modules() for w in module_patch.wrappers(m))


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

    `policy="selective"` is selective activation checkpointing (op-level, as torchtitan's SAC):
    outputs of matmuls and attention kernels are kept, cheap elementwise ops (norms,
    activations, dropout, adds) are recomputed: most of the memory of full checkpointing for a
    fraction of its recompute cost. A callable `(ctx, op, *args, **kwargs) -> CheckpointPolicy`
    is used as torch's SAC policy as it is.
    """

    name = "checkpoint"

    @classmethod
    def validate(cls, sch, subgraph=None, order_args_fn=None, condition=None, policy=None):
        if policy is not None and policy not in POLICIES and not callable(policy):
            raise SchedulingError(sch.path, f"unknown checkpoint policy {policy!r}.",
                                  f"use one of {POLICIES}, a torch SAC policy function, or "
                                  "None (full checkpointing).")
        if policy is not None and subgraph is not None:
            raise SchedulingError(sch.path, "a checkpoint policy applies to a whole module, "
                                  "not a subgraph.", "drop policy= or the subgraph.")
        if subgraph is not None:
            refuse_in_export_capture(sch, "subgraph checkpoint", "trace with tracer='fx', or "
                                     "checkpoint the whole module.")
            return
        for nm, f in (("order_args_fn", order_args_fn), ("condition", condition)):
            if f is not None and not callable(f):
                raise SchedulingError(sch.path, f"{nm} must be callable, got {f!r}.",
                                      f"pass a function or None for {nm}.")
        if any(isinstance(w, CheckpointWrapper) for w in module_patch.wrappers(sch.mod)):
            raise SchedulingError(sch.path, "this module is already checkpointed.",
                                  "remove the second checkpoint call.")

    @classmethod
    def apply(cls, sch, subgraph=None, order_args_fn=None, condition=None, policy=None):
        if subgraph is not None:
            from .fuse import checkpoint_subgraph  # the graph variant lives with the graph ones

            return checkpoint_subgraph(sch, subgraph)
        module_patch.add_wrapper(sch.mod, CheckpointWrapper(order_args_fn, condition, policy))
