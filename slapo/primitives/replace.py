"""`replace`: swap a module for another module or a function of the same signature."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch.nn as nn

from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive


class FunctionModule(nn.Module):
    """Runs a plain function in place of a module (so hooks and the schedule still apply)."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn
        self.__doc__ = getattr(fn, "__doc__", None)

    def forward(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def _forward_params(obj) -> list[inspect.Parameter] | None:
    try:
        sig = inspect.signature(obj.forward if isinstance(obj, nn.Module) else obj)
    except (TypeError, ValueError):
        return None
    return list(sig.parameters.values())


def _signature_problem(old: nn.Module, fn: Callable) -> str | None:
    """Arguments are matched by position (callers may use any names for positional args)."""
    old_params, new_params = _forward_params(old), _forward_params(fn)
    if old_params is None or new_params is None:
        return None
    pos = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    old_pos = [p for p in old_params if p.kind in pos]
    old_required = [p for p in old_pos if p.default is p.empty]
    old_var = any(p.kind is p.VAR_POSITIONAL for p in old_params)
    new_pos = [p for p in new_params if p.kind in pos]
    new_required = [p for p in new_pos if p.default is p.empty]
    new_var = any(p.kind is p.VAR_POSITIONAL for p in new_params)
    if not old_var and len(new_required) > len(old_pos):
        return (f"the function requires {len(new_required)} positional argument(s), but the "
                f"module's forward takes at most {len(old_pos)} "
                f"({', '.join(p.name for p in old_pos)}).")
    if not new_var and len(new_pos) < len(old_required):
        return (f"the function accepts {len(new_pos)} positional argument(s), but the module's "
                f"forward requires {len(old_required)} "
                f"({', '.join(p.name for p in old_required)}).")
    return None


@register_primitive
class ReplacePrimitive(Primitive):
    """Replace this module by `new_mod_or_fn` (an nn.Module, or a function with the same
    signature as the module's forward), keeping its place and name in the parent.

    Forward/backward hooks (e.g. from `sync`) move to the new module, and the schedule node and
    its path stay valid; the node's children are rebuilt from the new module. With
    `target_ops=` (a subgraph from `find`), only those ops of a traced module are replaced.
    """

    name = "replace"

    @classmethod
    def validate(cls, sch, new_mod_or_fn=None, target_ops=None, **kwargs):
        if target_ops is not None:
            refuse_in_export_capture(sch, "subgraph replace", "trace with tracer='fx' to "
                                     "rewrite the graph.")
            return
        if kwargs:
            raise SchedulingError(sch.path, f"unexpected arguments {sorted(kwargs)} for a "
                                  "whole-module replace.", "pass only the new module.")
        if new_mod_or_fn is None or not (isinstance(new_mod_or_fn, nn.Module) or
                                         callable(new_mod_or_fn)):
            raise SchedulingError(sch.path, f"cannot replace with {new_mod_or_fn!r}.",
                                  "pass an nn.Module or a function.")
        if new_mod_or_fn is sch.mod:
            raise SchedulingError(sch.path, "the new module is the current module.",
                                  "pass a different module.")
        if not isinstance(new_mod_or_fn, nn.Module):
            problem = _signature_problem(sch.mod, new_mod_or_fn)
            if problem:
                raise SchedulingError(sch.path, problem, "give the function the same "
                                      "parameters as the module's forward.")

    @classmethod
    def apply(cls, sch, new_mod_or_fn=None, target_ops=None, **kwargs):
        if target_ops is not None:
            from .fuse import replace_subgraph  # the graph variant lives with the graph primitives

            return replace_subgraph(sch, new_mod_or_fn, target_ops, **kwargs)
        new = new_mod_or_fn
        if not isinstance(new, nn.Module):
            new = FunctionModule(new)
        old = sch.mod
        _move_hooks(old, new)
        new.train(old.training)
        if sch.parent is None:
            sch._root.model = new
        else:
            sch.parent.mod._modules[sch.name] = new
        sch.metadata.clear()
        sch._build_children()
        return new


def _move_hooks(old: nn.Module, new: nn.Module) -> None:
    for attr in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                 "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_backward_hooks", "_backward_pre_hooks"):
        src, dst = getattr(old, attr, None), getattr(new, attr, None)
        if src and dst is not None:
            dst.update(src)
    if getattr(old, "_is_full_backward_hook", None) is not None:
        new._is_full_backward_hook = old._is_full_backward_hook
