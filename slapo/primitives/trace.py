"""`trace`: turn this one module into a torch.fx GraphModule ("trace by need")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn

from .. import module_patch
from ..errors import SchedulingError
from ..graph import default_leaf, trace_module
from ..graph.subgraph import rebuild_tree
from .base import Primitive, register_primitive
from .replace import _move_hooks

TRACERS = ("auto", "fx")
UNSUPPORTED = {
    "export": "torch.export produces ATen-level graphs with lifted parameters; the schedule "
              "needs torch-level ops and leaf modules in place, which tracer='fx' gives",
    "dynamo": "dynamo graphs are flattened with lifted parameters; use tracer='fx' (which "
              "handles HF blocks when example_inputs are given)",
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


@register_primitive
class TracePrimitive(Primitive):
    """Replace this module by a `torch.fx.GraphModule` of its forward.

    leaves: submodules kept as `call_module` nodes (relative paths like "c_fc", class names,
    or classes); torch.nn built-ins and modules changed by other primitives always are.
    flatten: False traces each non-leaf child into its own GraphModule (hierarchy and schedule
    paths kept); True inlines them into one graph (leaves keep their full paths).
    tracer: "auto"/"fx" (slapo's fx tracer; see slapo.graph.tracer for why not export/dynamo).
    example_inputs: inputs of one real call of this module (args tuple, kwargs dict or
    (args, kwargs)); needed for HF attention/blocks (shapes are read while tracing) and used to
    specialise non-tensor inputs, with run-time guards. concrete_args: {name: value} to
    specialise. Parameter names and state_dict keys are unchanged.
    """

    name = "trace"

    @classmethod
    def validate(cls, sch, leaves=None, flatten=False, tracer="auto", concrete_args=None,
                 example_inputs=None):
        if tracer in UNSUPPORTED:
            raise SchedulingError(sch.path, f"tracer {tracer!r} is not supported: "
                                  f"{UNSUPPORTED[tracer]}.", f"use one of {TRACERS}.")
        if tracer not in TRACERS:
            raise SchedulingError(sch.path, f"unknown tracer {tracer!r}.",
                                  f"use one of {TRACERS}.")
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
        gm = trace_module(old, _leaf_predicate(list(leaves or ())), flatten=flatten,
                          example=_normalise_example(example_inputs), concrete=concrete_args,
                          path=sch.path)
        _move_hooks(old, gm)
        if sch.parent is None:
            sch._root.model = gm
        else:
            sch.parent.mod._modules[sch.name] = gm
        rebuild_tree(sch)
        sch.metadata["trace"] = {"tracer": "fx", "requested": tracer, "flatten": flatten,
                                 "example_inputs": example_inputs is not None}
        sch._root.meta.setdefault("traced", {})[sch.path] = "fx"
        return gm
