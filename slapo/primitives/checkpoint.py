"""`checkpoint`: recompute a module's activations in backward instead of storing them."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint as _torch_checkpoint
from torch.utils.checkpoint import noop_context_fn

from .. import module_patch
from ..distributed.rng import get_rng_tracker
from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive
from .fork_rng import ForkRNGWrapper, look_for_dropouts, may_drop


class CheckpointWrapper(module_patch.ForwardWrapper):
    """Non-reentrant torch.utils.checkpoint around the module's forward.

    Keyword arguments pass through untouched (no flattening). The default RNG state is preserved
    by torch; two more kinds of state are handled here, because recomputation runs the forward
    a second time: the tensor-parallel RNG streams (`fork_rng`) are snapshotted so dropout
    draws the same masks (`_rng_replaying`), and the running statistics of BatchNorms in the
    subtree are kept as the real forward left them (`_context_fn`), so they are updated once
    per forward, not twice, for full and selective policies alike.
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
        context_fn = _context_fn(module, self.policy)
        extra = {} if context_fn is None else {"context_fn": context_fn}
        # with nothing to replay there are no Python side effects, so torch.compile traces
        # the checkpoint as one region
        run = _rng_replaying(module, fn, args, kwargs)
        if run is None:  # not `... or fn`: torch 2.11's dynamo cannot branch on a closure
            run = fn
        return _torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True,
                                 **extra, **kwargs)


def _rng_replaying(module: nn.Module, fn: Callable, args: tuple = (),
                   kwargs: dict | None = None) -> Callable | None:
    """`fn` whose second and later calls (the recomputation in backward; the first call is the
    real forward) draw from the tensor-parallel RNG streams as the real forward did; None when
    nothing in the subtree can draw from them (then `fn` itself is checkpointed): no module is
    forked, or every fork is for dropouts (`fork_rng(draws="dropout")`) and no dropout
    probability in the subtree or the call is above 0 (`may_drop`).

    The replay keeps a Python flag, a side effect torch.compile cannot put inside its
    checkpoint region: a compiled TP block with checkpointing then ran entirely eager (no graph
    at all, seen at tp=2 for every family). Without dropout it is not needed, so under
    torch.compile it is left out and the block compiles whole; with dropout the forks break the
    graph anyway, and the eager fallback replays. Eager calls always replay (cheap, and exact
    whatever `may_drop` sees)."""
    forks = _fork_wrappers(module)
    if not forks:
        return None
    if torch.compiler.is_compiling() and all(w.draws == "dropout" for w in forks) and \
            not may_drop(module, args, kwargs or {}):
        return None
    snapshot = get_rng_tracker().get_states()
    first = [True]

    def run(*a, **k):
        if first[0]:
            first[0] = False
            return fn(*a, **k)
        with _rng_replayed(snapshot):
            return fn(*a, **k)

    return run


def _context_fn(module: nn.Module, policy: str | Callable | None) -> Callable | None:
    """torch's `context_fn` for this call: the selective policy's contexts (if any), and, when
    BatchNorms in the subtree update running statistics, a recompute context that keeps them
    (`running_stats_kept`). Under torch.compile no guard is needed (AOTAutograd applies a
    buffer mutation once, after the graph; its recomputation is functional) and torch accepts
    only dispatch modes there."""
    sac = selective_context_fn(policy) if policy is not None else None
    compiling = torch.compiler.is_compiling()
    norms = [] if compiling else batchnorms_updating(module)
    if not norms:
        return sac
    return functools.partial(_stats_kept_contexts, norms, sac)


def _stats_kept_contexts(norms: list[nn.Module], sac: Callable | None) -> tuple:
    """(forward, recompute) contexts; the statistics are saved and restored *outside* the
    selective policy's recompute context, whose dispatch mode requires the recomputation to
    issue exactly the forward's ops (a `clone` inside it is refused)."""
    forward, recompute = sac() if sac is not None else noop_context_fn()
    return forward, _nested(running_stats_kept(norms), recompute)


@contextlib.contextmanager
def _nested(outer: contextlib.AbstractContextManager,
            inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def batchnorms_updating(module: nn.Module) -> list[nn.Module]:
    """The BatchNorms in `module`'s subtree whose forward updates running statistics now: any
    `_BatchNorm` (BatchNorm1d/2d/3d, SyncBatchNorm, the lazy ones, user subclasses) in training
    mode with `track_running_stats`. Found at each call, so modules swapped in after
    `checkpoint` (`replace`) and `train()`/`eval()` switches are seen."""
    return [m for m in module.modules()
            if isinstance(m, _BatchNorm) and m.training and m.track_running_stats]


@contextlib.contextmanager
def running_stats_kept(norms: list[nn.Module]) -> Iterator[None]:
    """Run the body, then put every buffer of `norms` (running mean/var, num_batches_tracked)
    back as it was before: a recomputed BatchNorm in training mode would otherwise update its
    statistics a second time (plain `torch.utils.checkpoint` does). The recomputed *output* is
    unaffected: training-mode BN normalises with the batch's own statistics. Restored even when
    the body raises (torch stops a recomputation early by raising once it has what backward
    needs)."""
    saved = [(b, b.detach().clone()) for m in norms for b in m._buffers.values()
             if b is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


@contextlib.contextmanager
def _rng_replayed(snapshot: dict | None) -> Iterator[None]:
    """Run the body with the tensor-parallel RNG streams as they were at the real forward."""
    if snapshot is None:
        yield
        return
    tracker = get_rng_tracker()
    current = tracker.get_states()
    tracker.set_states(snapshot)
    try:
        yield
    finally:
        tracker.set_states(current)


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


def _fork_wrappers(module: nn.Module) -> list[ForkRNGWrapper]:
    """The `fork_rng` wrappers in `module`'s subtree: their dropouts draw from a
    tensor-parallel RNG stream, whose state the recomputation must replay."""
    return [w for m in module.modules() for w in module_patch.wrappers(m)
            if isinstance(w, ForkRNGWrapper)]


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

    BatchNorms in the subtree update their running statistics once per forward, as without
    checkpointing (the recomputation restores them), under either policy.
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
        if any(w.name == "offload" for w in module_patch.wrappers(sch.mod)):
            raise SchedulingError(sch.path, "this module is offloaded: its saved activations "
                                  "already live in host memory, and a checkpoint would keep "
                                  "only its inputs.", "checkpoint another module, or this one "
                                  "without offload.")

    @classmethod
    def apply(cls, sch, subgraph=None, order_args_fn=None, condition=None, policy=None):
        if subgraph is not None:
            from .fuse import checkpoint_subgraph  # the graph variant lives with the graph ones

            return checkpoint_subgraph(sch, subgraph)
        module_patch.add_wrapper(sch.mod, CheckpointWrapper(order_args_fn, condition, policy))
        look_for_dropouts(sch.mod)  # what `_rng_replaying` asks `may_drop` in compiled calls
