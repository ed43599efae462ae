"""`sync`: insert a collective before/after a module, with a correct backward."""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

from .. import module_patch, sharding
from ..distributed import collectives as C
from ..errors import SchedulingError
from ._util import map_first_input, map_first_output, refuse_in_export_capture
from .base import Primitive, register_primitive

MODES = ("fwd_pre", "fwd_post", "bwd_post")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "scatter")


@register_primitive
class SyncPrimitive(Primitive):
    """Synchronise this module's input or output across the tensor-parallel group.

    mode:
    - "fwd_post": on the forward output (its first tensor, for tuple/ModelOutput outputs);
    - "fwd_pre": on the forward input (the first tensor argument, or `arg=` name/index);
    - "bwd_post": on the gradient of the input (the first tensor argument, or `arg=` name/index:
      a module may take several inputs whose gradients are partial, e.g. MoE experts' hidden
      states and routing weights), after backward ("all_reduce" or a callable full backward
      hook `fn(module, grad_input, grad_output)`). A named `arg` is found as a keyword or at its
      position in the module's forward signature.

    sync_op_or_fn: "all_reduce", "all_gather", "reduce_scatter", "scatter" (the last three need
    `axis=`; for a column-parallel output all_gather defaults to the last axis), or a callable
    registered as the corresponding torch hook.

    Each collective is an autograd function with the matching backward (all-reduce <-> identity,
    all-gather <-> reduce-scatter or split, reduce-scatter <-> all-gather). For all_gather,
    `tensor_parallel_output_grad` says whether the gathered tensor's gradient is partial per rank
    (reduce-scatter it: the default for "fwd_pre", i.e. sequence parallel) or the same on every
    rank (keep the local slice: the default for "fwd_post").

    On a row-parallel Linear/Conv1D with a bias, "fwd_post" "all_reduce" or "reduce_scatter"
    reduces *before* adding the bias, so the bias is added once, not once per rank. After a
    reduce-scatter (sequence parallelism) each rank adds the bias to its own tokens, so the kernel
    also sums the bias gradient over the group (no `reduce_param_grads` needed for it).
    """

    name = "sync"

    @classmethod
    def validate(cls, sch, mode: str, sync_op_or_fn="all_reduce", **kwargs):
        if sch.metadata.get("trace", {}).get("tracer") != "export":  # the captured root may sync
            refuse_in_export_capture(sch, "sync", "sync before tracing, or on the captured module itself.")
        if mode not in MODES:
            raise SchedulingError(sch.path, f"unknown sync mode {mode!r}.",
                                  f"use one of {', '.join(MODES)}.")
        allowed = {"axis", "tensor_parallel_output_grad", "arg"}
        bad = set(kwargs) - allowed
        if bad:
            raise SchedulingError(sch.path, f"unexpected sync arguments {sorted(bad)}.",
                                  f"allowed: {sorted(allowed)}.")
        _check_options(sch, mode, sync_op_or_fn, kwargs)
        op = sync_op_or_fn
        if callable(op):
            return
        if op not in OPS:
            raise SchedulingError(sch.path, f"unknown sync op {op!r}.",
                                  f"use one of {', '.join(OPS)} or a callable hook.")
        if mode == "bwd_post" and op != "all_reduce":
            raise SchedulingError(sch.path, f"bwd_post supports only 'all_reduce', not {op!r}.",
                                  "use 'all_reduce' or pass a backward-hook function.")
        meta = module_patch.module_meta(sch.mod)
        done = meta.get("syncs", [])
        if _record(mode, op, kwargs.get("arg")) in done:
            raise SchedulingError(sch.path, f"sync({mode!r}, {op!r}) was already applied to this "
                                  "module; applying it twice would reduce/gather twice.",
                                  "remove the second call.")
        _refuse_second_input_grad_reduction(sch, mode, op, kwargs)
        axis = kwargs.get("axis")
        if mode != "fwd_post":
            if op in ("all_gather", "reduce_scatter", "scatter") and axis is None:
                raise SchedulingError(sch.path, f"{op!r} on the {mode} input needs an axis.",
                                      "pass axis= (e.g. axis=1 for the sequence dimension).")
            return
        layout = meta.get("output_layout")
        known = sharding.has_known_layout(sch.mod)
        kind = layout[0] if layout else None
        if op == "all_reduce":
            if kind == sharding.PARTITION:
                raise SchedulingError(sch.path, "all_reduce of a partitioned (column-parallel) "
                                      "output would add different slices together.",
                                      "use sync_op_or_fn='all_gather' (or no sync: feed a "
                                      "row-parallel layer).")
            if known and kind is None:
                raise SchedulingError(sch.path, "all_reduce of an unsharded module's output "
                                      "would multiply it by the world size (sync before shard?).",
                                      "shard the weight along its input axis first.")
        if op in ("all_gather", "reduce_scatter", "scatter"):
            if op == "all_gather" and kind == sharding.PARTIAL:
                raise SchedulingError(sch.path, "all_gather of a partial-sum (row-parallel) "
                                      "output would concatenate partial sums.",
                                      "use sync_op_or_fn='all_reduce' or 'reduce_scatter'.")
            if op == "all_gather" and known and kind is None:
                raise SchedulingError(sch.path, "all_gather of an unsharded module's output "
                                      "would repeat it world-size times (sync before shard?).",
                                      "shard the weight along its output axis first.")
            if op == "reduce_scatter" and kind == sharding.PARTITION:
                raise SchedulingError(sch.path, "reduce_scatter of a partitioned output would "
                                      "add different slices together.", "use 'all_gather'.")
            if op == "reduce_scatter" and known and kind is None:
                raise SchedulingError(sch.path, "reduce_scatter of an unsharded module's output "
                                      "would add world-size copies of it (sync before shard?).",
                                      "shard the weight along its input axis first.")
            if axis is None and not (op == "all_gather" and kind == sharding.PARTITION):
                raise SchedulingError(sch.path, f"{op!r} needs an axis.", "pass axis=.")
            if op == "all_gather" and kind == sharding.PARTITION and axis is not None \
                    and axis != layout[1] and axis != -1:
                raise SchedulingError(sch.path, f"the output is partitioned along the last axis, "
                                      f"but all_gather was asked along axis {axis}.",
                                      "pass axis=-1 (or omit it).")

    @classmethod
    def apply(cls, sch, mode: str, sync_op_or_fn="all_reduce", **kwargs):
        mod, group = sch.mod, sch.group
        op = sync_op_or_fn
        if callable(op):
            _register_callable(mod, mode, op)
            return
        axis = kwargs.get("axis")
        arg = kwargs.get("arg")
        tpog = kwargs.get("tensor_parallel_output_grad")
        meta = module_patch.module_meta(mod, create=True)
        layout = meta.get("output_layout")
        if mode == "fwd_post" and op == "all_gather" and axis is None:
            axis = layout[1]
        if mode == "bwd_post":
            fn = partial(C.reduce_backward, group=group)
            if op == "all_reduce":
                meta.setdefault("grad_reduced_inputs", []).append(_input_key(mod, arg))
        elif op == "all_reduce":
            fn = partial(C.reduce_forward, group=group)
        elif op == "all_gather":
            partial_grad = (mode == "fwd_pre") if tpog is None else bool(tpog)
            fn = partial(C.all_gather, dim=axis, group=group, partial_grad=partial_grad)
            if mode == "fwd_pre" and partial_grad:
                meta.setdefault("grad_reduced_inputs", []).append(_input_key(mod, arg))
        elif op == "reduce_scatter":
            fn = partial(C.reduce_scatter, dim=axis, group=group)
        else:
            fn = partial(C.scatter, dim=axis, group=group)

        if mode == "fwd_post":
            kernel = sharding.rule_for(mod).reduce_kernel(mod, group, op, axis) \
                if op in ("all_reduce", "reduce_scatter") and layout \
                and layout[0] == sharding.PARTIAL else None
            if kernel is not None:  # reduce inside the kernel, before the bias
                module_patch.set_kernel(mod, kernel)
                if getattr(kernel, "reduces_bias_grad", False):  # seen by reduce_param_grads
                    meta.setdefault("reduced_grad_params", []).append("bias")
            else:
                mod.register_forward_hook(lambda m, a, out, f=fn: map_first_output(out, f))
            if op in ("all_reduce", "all_gather"):
                meta["output_layout"] = ("replicated", None)
            elif op == "reduce_scatter":
                meta["output_layout"] = (sharding.PARTITION, axis)
        else:
            where = _position(mod, arg) if isinstance(arg, str) else None
            mod.register_forward_pre_hook(
                lambda m, a, kw, f=fn: map_first_input(a, kw, f, arg, where), with_kwargs=True)
        meta.setdefault("syncs", []).append(_record(mode, op, arg))


def _record(mode: str, op, arg) -> tuple:
    """What `meta["syncs"]` keeps of one sync (plans compare their effects with it): the input a
    sync on a chosen `arg` acts on is part of it, so two inputs' gradients can each be reduced."""
    return (mode, op) if arg is None else (mode, op, arg)


def _input_key(mod, arg) -> Any:
    """Which input a fwd_pre/bwd_post sync acts on: a name is its position when the signature
    has it, so `arg="x"` and `arg=0` are the same input."""
    if isinstance(arg, str):
        where = _position(mod, arg)
        return arg if where is None else where
    return arg


def _refuse_second_input_grad_reduction(sch, mode: str, op, kwargs: dict) -> None:
    """An input's gradient may be summed over the group once. A "fwd_pre" all_gather that
    reduce-scatters its gradient (`tensor_parallel_output_grad`, the default there) and a
    "bwd_post" all_reduce on the same input each sum it, in either order: the gradient that
    reaches the layer before comes out world-size times too large, with no error (2023's
    sequence-parallel test schedule did this; its test never checked the input's gradient)."""
    if mode == "fwd_pre" and op == "all_gather":
        tpog = kwargs.get("tensor_parallel_output_grad")
        if tpog is False:
            return
        other = "sync('bwd_post', 'all_reduce')"
    elif mode == "bwd_post" and op == "all_reduce":
        other = "sync('fwd_pre', 'all_gather') with tensor_parallel_output_grad=True"
    else:
        return
    done = module_patch.module_meta(sch.mod).get("grad_reduced_inputs", [])
    if _input_key(sch.mod, kwargs.get("arg")) in done:
        raise SchedulingError(
            sch.path, f"{other} already sums this input's gradient over the group; "
            f"sync({mode!r}, {op!r}) would sum it a second time (world-size times too large).",
            "keep one of them: sequence parallelism needs only the all_gather (its backward "
            "reduce-scatters); to keep the bwd_post all_reduce, pass "
            "tensor_parallel_output_grad=False to the all_gather.")


def _position(mod, name: str) -> int | None:
    """The position of the forward argument `name` (for an input passed positionally)."""
    try:
        params = list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return None
    return params.index(name) if name in params else None


def _check_options(sch, mode: str, op, kwargs: dict) -> None:
    """The types of `axis`, `arg` and `tensor_parallel_output_grad`, and that each is given
    where it has a meaning: an option the call would silently ignore is a mistake to report."""
    axis = kwargs.get("axis")
    if axis is not None and (not isinstance(axis, int) or isinstance(axis, bool)):
        raise SchedulingError(sch.path, f"axis must be an int, got {axis!r}.", "pass axis=-1.")
    arg = kwargs.get("arg")
    if arg is not None:
        if not isinstance(arg, (str, int)) or isinstance(arg, bool):
            raise SchedulingError(sch.path, f"arg must be an input's name or position, got "
                                  f"{arg!r}.", "pass e.g. arg='hidden_states' or arg=0.")
        if mode == "fwd_post":
            raise SchedulingError(sch.path, "arg= selects a forward input, but mode is "
                                  "'fwd_post'.", "drop arg=, or use mode='fwd_pre' or "
                                  "'bwd_post'.")
        names = _forward_args(sch.mod)
        if isinstance(arg, str) and names is not None and arg not in names:
            raise SchedulingError(sch.path, f"arg={arg!r} is not an argument of "
                                  f"{type(sch.mod).__name__}.forward ({names}).",
                                  "pass one of its argument names, or a position.")
    tpog = kwargs.get("tensor_parallel_output_grad")
    if tpog is not None:
        if not isinstance(tpog, bool):
            raise SchedulingError(sch.path, f"tensor_parallel_output_grad must be True or "
                                  f"False, got {tpog!r}.", "pass a bool, or omit it for the "
                                  "mode's default.")
        if op != "all_gather":
            raise SchedulingError(sch.path, "tensor_parallel_output_grad applies only to "
                                  f"'all_gather', not {op!r}.", "drop it.")


def _forward_args(mod) -> list[str] | None:
    """The module's forward argument names; None when any name may be passed (a `**kwargs`
    forward, or a signature that cannot be read)."""
    try:
        params = inspect.signature(mod.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params]


def _n_params(fn) -> int:
    try:
        return len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return -1


def _register_callable(mod, mode: str, fn) -> None:
    if mode == "fwd_pre":
        mod.register_forward_pre_hook(fn, with_kwargs=_n_params(fn) == 3)
    elif mode == "fwd_post":
        mod.register_forward_hook(fn, with_kwargs=_n_params(fn) == 4)
    else:
        mod.register_full_backward_hook(fn)
