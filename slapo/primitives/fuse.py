"""`fuse`: move matched ops into one named submodule compiled by a torch.compile backend.

This file also registers the graph handlers of `replace(new, target_ops=subgraph)` and
`checkpoint(subgraph)`, which share the same surgery (slapo.graph.subgraph).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable

import torch
import torch.fx as fx
import torch.nn as nn

from ..errors import SchedulingError
from ..graph.subgraph import as_subgraph, check_movable, extract, fresh_name, install, rebuild_tree
from . import checkpoint as _ckpt
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive


def available_backends() -> list[str]:
    """Every torch.compile backend name (debug ones such as aot_eager included)."""
    names = set(torch._dynamo.list_backends(exclude_tags=()))
    if importlib.util.find_spec("hidet") is not None:
        names.add("hidet")
    return sorted(names)


@register_primitive
class FusePrimitive(Primitive):
    """Fuse a subgraph (from `find`) into one submodule `name`, compiled with
    `torch.compile(backend=compiler)` ("inductor", "aot_eager", any registered backend, "hidet"
    when installed; "eager" or None: no compilation, just the GraphModule).

    The subgraph must end in a single value used outside it and be contiguous. Parameters it
    reads are passed in as arguments, so parameter names do not change.
    """

    name = "fuse"

    @classmethod
    def validate(cls, sch, subgraph, compiler="inductor", name="FusedOp", **compile_kwargs):
        refuse_in_export_capture(sch, "fuse", "trace this module with tracer='fx' to fuse its ops.")
        sub = as_subgraph(sch, subgraph, "fuse")
        check_movable(sch, sub, "fuse")
        if compiler not in (None, "eager") and compiler not in available_backends():
            raise SchedulingError(sch.path, f"unknown torch.compile backend {compiler!r}.",
                                  f"use one of: {', '.join(available_backends())}, or 'eager'.")
        if not isinstance(name, str) or not name.isidentifier():
            raise SchedulingError(sch.path, f"name {name!r} is not a valid attribute name.",
                                  "pass e.g. name='bias_gelu'.")
        if compiler == "hidet":
            importlib.import_module("hidet")

    @classmethod
    def apply(cls, sch, subgraph, compiler="inductor", name="FusedOp", **compile_kwargs):
        sub = as_subgraph(sch, subgraph, "fuse")
        gm = sch.mod
        attr = fresh_name(gm, name)
        fused, inputs = extract(sub, name)
        if compiler not in (None, "eager"):
            fused.compile(backend=compiler, **compile_kwargs)
        install(sub, fused, attr, inputs)
        rebuild_tree(sch)
        sch.metadata.setdefault("fused", {})[attr] = compiler or "eager"
        return sch[attr]


def replace_subgraph(sch, new_mod_or_fn, target_ops, name=None, **kwargs):
    sub = as_subgraph(sch, target_ops, "replace")
    check_movable(sch, sub, "replace")
    inputs = sub.inputs
    problem = _arity_problem(new_mod_or_fn, len(inputs), kwargs)
    if problem:
        raise SchedulingError(sch.path, f"replace: {problem}", "the new module/function must take "
                              f"the subgraph's inputs ({', '.join(n.name for n in inputs)}) "
                              "positionally, plus the keyword arguments given here.")
    gm = sch.mod
    if isinstance(new_mod_or_fn, nn.Module):
        attr = fresh_name(gm, name or type(new_mod_or_fn).__name__)
        install(sub, new_mod_or_fn, attr, inputs, kwargs)
        rebuild_tree(sch)
        return sch[attr]
    install(sub, new_mod_or_fn, "", inputs, kwargs)
    return None


def _arity_problem(fn: Callable, n_inputs: int, kwargs: dict) -> str | None:
    target = fn.forward if isinstance(fn, nn.Module) else fn
    if not callable(target):
        return f"cannot replace with {fn!r}."
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.name not in kwargs]
    required = [p for p in positional if p.default is p.empty]
    if not len(required) <= n_inputs <= len(positional):
        return (f"the subgraph has {n_inputs} input(s) but the replacement takes "
                f"{len(required)}..{len(positional)} positional argument(s).")
    return None


class CheckpointedRegion(nn.Module):
    """Runs the extracted ops (`region`, a parameter-free GraphModule) under slapo's activation
    checkpointing: only the region's inputs are kept for backward."""

    def __init__(self, region: fx.GraphModule):
        super().__init__()
        self.region = region
        self._wrapper = _ckpt.CheckpointWrapper()

    def forward(self, *args):
        return self._wrapper(self, self.region, args, {})


def checkpoint_subgraph(sch, subgraph, name="checkpointed"):
    sub = as_subgraph(sch, subgraph, "checkpoint")
    check_movable(sch, sub, "checkpoint")
    gm = sch.mod
    attr = fresh_name(gm, name)
    region, inputs = extract(sub, attr)
    install(sub, CheckpointedRegion(region), attr, inputs)
    rebuild_tree(sch)
    return sch[attr]

