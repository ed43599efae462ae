"""`trace`: turn this one module into a torch.fx GraphModule ("trace by need")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from .. import module_patch
from ..errors import SchedulingError, TraceError
from ..graph import default_leaf, trace_module
from ..graph.export_capture import export_module
from ..graph.subgraph import rebuild_tree
from .base import Primitive, register_primitive
from .replace import _move_hooks

TRACERS = ("auto", "fx", "export")
UNSUPPORTED = {
    "dynamo": "dynamo graphs are flattened with lifted parameters; tracer='export' (non-strict "
              "torch.export, hierarchy rebuilt from nn_module_stack) covers what fx cannot "
              "follow",
}


def _normalise_example(example):
    """(args, kwargs) from a tensor, a tuple of args, a kwargs dict, or an (args, kwargs) pair."""
    if example is None:
        return None
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, (tuple, list)) and len(example) == 2 and \
            isinstance(example[0], (tuple, list)) and isinstance(example[1], dict):
        return tuple(example[0]), dict(example[1])
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(type(example).__name__)


def _leaf_predicate(leaves: Sequence) -> callable:
    names = {x for x in leaves if isinstance(x, str)}
    types = tuple(x for x in leaves if isinstance(x, type))

    def is_leaf(m: nn.Module, qual: str) -> bool:
        cls = module_patch.original_class(m)
        return (qual in names or cls.__name__ in names or (bool(types) and isinstance(m, types))
                or default_leaf(m))

    return is_leaf


def _validate_export(sch, leaves, flatten: bool, concrete_args, example_inputs) -> None:
    """Export runs the module on real inputs and inlines every submodule into ATen graphs, so
    example_inputs are required and fx-only options would be silently ignored: refuse them."""
    if example_inputs is None:
        raise SchedulingError(sch.path, "tracer 'export' is not supported without "
                              "example_inputs (export runs the module once on them).",
                              "pass example_inputs=(args, kwargs), e.g. from "
                              "slapo.graph.capture_inputs(model, path, *inputs), or use "
                              f"another of {TRACERS}.")
    if leaves or flatten or concrete_args:
        raise SchedulingError(sch.path, "leaves=, flatten= and concrete_args= are options of "
                              "tracer 'fx'; tracer 'export' keeps every submodule as its own "
                              "graph and specialises on example_inputs.",
                              "drop them, or use tracer='fx'.")


@register_primitive
class TracePrimitive(Primitive):
    """Replace this module by a `torch.fx.GraphModule` of its forward.

    leaves: submodules kept as `call_module` nodes (relative paths like "c_fc", class names,
    or classes); torch.nn built-ins and modules changed by other primitives always are.
    flatten: False traces each non-leaf child into its own GraphModule (hierarchy and schedule
    paths kept); True inlines them into one graph (leaves keep their full paths).
    tracer: "fx" (slapo's fx tracer, torch-level ops, leaves kept; see slapo.graph.tracer),
    "export" (non-strict torch.export on example_inputs, ATen-level training IR, hierarchy
    rebuilt from nn_module_stack; see slapo.graph.export_capture) or "auto" (fx, falling back to
    export when fx fails and example_inputs are given; the fx failure is kept in
    `metadata["trace"]["fx_error"]`). "dynamo" is refused.
    example_inputs: inputs of one real call of this module (args tuple, kwargs dict or
    (args, kwargs)); needed for HF attention/blocks (shapes are read while tracing) and used to
    specialise non-tensor inputs, with run-time guards. concrete_args: {name: value} to
    specialise. Parameter names and state_dict keys are unchanged.
    """

    name = "trace"

    @classmethod
    def validate(cls, sch, leaves=None, flatten=False, tracer="auto", concrete_args=None,
                 example_inputs=None):
        if not isinstance(tracer, str):
            raise SchedulingError(sch.path, f"tracer must be a name, got {tracer!r}.",
                                  f"use one of {TRACERS}.")
        if tracer in UNSUPPORTED:
            raise SchedulingError(sch.path, f"tracer {tracer!r} is not supported: "
                                  f"{UNSUPPORTED[tracer]}.", f"use one of {TRACERS}.")
        if tracer not in TRACERS:
            raise SchedulingError(sch.path, f"unknown tracer {tracer!r}.",
                                  f"use one of {TRACERS}.")
        if tracer == "export":
            _validate_export(sch, leaves, flatten, concrete_args, example_inputs)
        mod = sch.mod
        if module_patch.wrappers(mod) or module_patch.kernel(mod) is not None:
            raise SchedulingError(sch.path, "this module's forward was changed by another "
                                  "primitive (checkpoint/sync/decompose); tracing would drop it.",
                                  "trace first, then apply those primitives (or trace the "
                                  "parent, which keeps this module as a leaf).")
        for leaf in leaves or ():
            if isinstance(leaf, str) and "." in leaf or isinstance(leaf, str) and \
                    leaf in dict(mod.named_children()):
                try:
                    mod.get_submodule(leaf)
                except AttributeError:
                    raise SchedulingError(sch.path, f"leaf {leaf!r} is not a submodule.",
                                          "use paths relative to this module, e.g. 'c_fc'.") \
                        from None
            elif not isinstance(leaf, (str, type)):
                raise SchedulingError(sch.path, f"leaf {leaf!r} must be a path, class name or "
                                      "class.", "e.g. leaves=['c_fc', 'Conv1D'].")
        if concrete_args is not None and not isinstance(concrete_args, dict):
            raise SchedulingError(sch.path, "concrete_args must be a dict {name: value}.",
                                  "e.g. concrete_args={'attention_mask': None}.")
        try:
            _normalise_example(example_inputs)
        except TypeError as e:
            raise SchedulingError(sch.path, f"example_inputs of type {e} is not understood.",
                                  "pass a tuple of args, a dict of kwargs, or (args, kwargs).") \
                from None

    @classmethod
    def apply(cls, sch, leaves=None, flatten=False, tracer="auto", concrete_args=None,
              example_inputs=None):
        old = sch.mod
        example = _normalise_example(example_inputs)
        gm, used, fx_error = _capture(sch, old, leaves, flatten, tracer, concrete_args, example)
        _move_hooks(old, gm)
        if sch.parent is None:
            sch._root.model = gm
        else:
            sch.parent.mod._modules[sch.name] = gm
        rebuild_tree(sch)
        sch.metadata["trace"] = {"tracer": used, "requested": tracer, "flatten": flatten,
                                 "example_inputs": example_inputs is not None,
                                 "fx_error": fx_error}
        return gm


def _capture(sch, old: nn.Module, leaves, flatten: bool, tracer: str, concrete_args,
             example) -> tuple[nn.Module, str, str | None]:
    """(graph module, tracer used, why fx failed when auto fell back to export)."""
    if tracer == "export":
        return export_module(old, example, path=sch.path), "export", None
    try:
        gm = trace_module(old, _leaf_predicate(list(leaves or ())), flatten=flatten,
                          example=example, concrete=concrete_args, path=sch.path)
        return gm, "fx", None
    except TraceError as fx_err:
        if tracer != "auto":
            raise
        blocker = _fallback_blocker(leaves, flatten, concrete_args, example)
        if blocker:
            raise TraceError(sch.path, f"{fx_err.problem} (no fallback to tracer 'export': "
                             f"{blocker})", fx_err.fix) from None
        try:
            gm = export_module(old, example, path=sch.path)
        except TraceError as ex_err:
            raise TraceError(sch.path, f"neither tracer could capture {type(old).__name__}. "
                             f"1) {fx_err.problem} 2) {ex_err.problem}",
                             ex_err.fix) from None
        return gm, "export", fx_err.problem


def _fallback_blocker(leaves, flatten: bool, concrete_args, example) -> str | None:
    """Why auto must not fall back to export (it would silently ignore what was asked)."""
    if example is None:
        return "it needs example_inputs"
    if leaves or flatten or concrete_args:
        return "leaves=/flatten=/concrete_args= are fx-only options"
    return None
