"""`reduce_param_grads`: sum the gradients of a module's replicated parameters over the group.

Why it exists: under sequence parallelism a module outside the tensor-parallel regions (LayerNorm,
RMSNorm) keeps its parameters *replicated* but runs on this rank's slice of the sequence only. The
gradient each rank computes for those parameters therefore covers only its own tokens; the true
gradient is the sum over ranks. Without the sum the replicated copies drift apart after the first
optimizer step (Korthikanti et al. 2022, section 4.2.2; Megatron all-reduces these "sequence
parallel" gradients across the tensor-parallel group).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from .. import module_patch, sharding
from ..distributed import collectives
from ..errors import SchedulingError
from ._util import direct_tensor
from .base import Primitive, register_primitive


class ReduceParamGradsWrapper(module_patch.ForwardWrapper):
    """For the duration of the module's forward, each named parameter is seen through
    `collectives.reduce_backward` (identity forward, all-reduce of the gradient backward).

    Only the gradient flowing from *this* module's use is summed (a tied parameter used elsewhere
    on replicated activations is unaffected), the parameter objects and state-dict keys never
    change, and recomputation under `checkpoint` re-enters the wrapper, so the recomputed graph
    carries the same reduction."""

    name = "reduce_param_grads"

    def __init__(self, names: tuple[str, ...], group):
        self.names, self.group = names, group

    def __call__(self, module: nn.Module, fn, args: tuple, kwargs: dict):
        params = module._parameters
        saved = {n: params[n] for n in self.names}
        try:
            for n, p in saved.items():  # a non-leaf view; Module.__getattr__ returns it as is
                params[n] = collectives.reduce_backward(p, self.group)
            return fn(*args, **kwargs)
        finally:
            params.update(saved)


def _reduced_names(mod: nn.Module) -> set[str]:
    """Parameters of `mod` whose gradient is already summed (by this primitive, or by a
    reduce-scatter kernel that adds the bias to sequence-sharded outputs)."""
    done = set(module_patch.module_meta(mod).get("reduced_grad_params", ()))
    for w in module_patch.wrappers(mod):
        if isinstance(w, ReduceParamGradsWrapper):
            done |= set(w.names)
    return done


def _resolve(sch, names) -> tuple[str, ...]:
    """The parameter names the call refers to; validates their kind (mutates nothing)."""
    mod = sch.mod
    if names is None:
        chosen = tuple(n for n, p in mod._parameters.items()
                       if p is not None and sharding.shard_spec(p) is None)
        if not chosen:
            raise SchedulingError(sch.path, f"{type(mod).__name__} has no direct replicated "
                                  "parameter to reduce.", "call it on the module that owns the "
                                  "parameters (e.g. the LayerNorm), or pass names=[...].")
        return chosen
    chosen = (names,) if isinstance(names, str) else tuple(names) \
        if isinstance(names, Sequence) else None
    if not chosen:
        raise SchedulingError(sch.path, f"names must be a parameter name or a non-empty list of "
                              f"them, got {names!r}.", "pass e.g. names=['weight', 'bias'] or "
                              "omit it for every replicated parameter.")
    if len(set(chosen)) != len(chosen):
        raise SchedulingError(sch.path, f"duplicate names in {list(chosen)}.", "list each once.")
    for n in chosen:
        kind, t = direct_tensor(sch, n)
        if kind != "parameter":
            raise SchedulingError(sch.path, f"{n!r} is a buffer; buffers have no gradient.",
                                  "pass parameter names only.")
        spec = sharding.shard_spec(t)
        if spec is not None:
            raise SchedulingError(sch.path, f"{n!r} is sharded (axis {spec.axis}): each rank's "
                                  "gradient is already its own slice's full gradient, and "
                                  "summing would mix slices.", "apply reduce_param_grads only to "
                                  "replicated parameters.")
    return chosen


@register_primitive
class ReduceParamGradsPrimitive(Primitive):
    """Sum (all-reduce) over the tensor-parallel group the gradients of this module's replicated
    parameters, as contributed by this module's forward.

    Use it on every module with replicated parameters that runs on sequence-sharded activations
    (norm layers under sequence parallelism): each rank sees only its tokens, so its gradient is
    partial. `names`: a parameter name or list of names; None = every direct parameter that is not
    sharded. A row-parallel bias after `sync("fwd_post", "reduce_scatter")` is already handled by
    that kernel. With a world of one rank it changes nothing.
    """

    name = "reduce_param_grads"

    @classmethod
    def validate(cls, sch, names: str | Sequence[str] | None = None):
        chosen = _resolve(sch, names)
        again = sorted(set(chosen) & _reduced_names(sch.mod))
        if again:
            raise SchedulingError(sch.path, f"the gradient of {again} is already summed over the "
                                  "group (by reduce_param_grads, or by the reduce-scatter kernel "
                                  "of a row-parallel sync); summing again would multiply it by "
                                  "the world size.", "remove the second call.")

    @classmethod
    def apply(cls, sch, names: str | Sequence[str] | None = None):
        module_patch.add_wrapper(sch.mod, ReduceParamGradsWrapper(_resolve(sch, names), sch.group))
