"""Helpers shared by primitives: finding tensors, transforming inputs/outputs in hooks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..errors import SchedulingError


def direct_tensor(sch, name: str):
    """(kind, tensor) of a direct parameter or buffer of `sch.mod`, or raise."""
    mod = sch.mod
    if not isinstance(name, str) or not name:
        raise SchedulingError(sch.path, f"expected a parameter or buffer name, got {name!r}.",
                              "pass e.g. 'weight' or 'bias'.")
    if "." in name:
        head, _, leaf = name.rpartition(".")
        raise SchedulingError(sch.path, f"{name!r} is not a direct tensor of this module.",
                              f"use sch[{(sch.path + '.' if sch.path else '') + head!r}]"
                              f".<primitive>({leaf!r}, ...).")
    if name in mod._parameters and mod._parameters[name] is not None:
        return "parameter", mod._parameters[name]
    if name in mod._buffers and mod._buffers[name] is not None:
        return "buffer", mod._buffers[name]
    avail = [n for n, p in mod._parameters.items() if p is not None]
    avail += [n for n, b in mod._buffers.items() if b is not None]
    raise SchedulingError(sch.path, f"{type(mod).__name__} has no parameter or buffer {name!r}.",
                          f"use one of: {', '.join(avail) or '(none: it has no direct tensors)'}.")


def holders(root: nn.Module, tensor: torch.Tensor) -> list[tuple[nn.Module, str, str]]:
    """Every (module, attribute, kind) in `root` holding this exact tensor object (tied weights)."""
    out = []
    for m in root.modules():
        for n, p in m._parameters.items():
            if p is tensor:
                out.append((m, n, "parameter"))
        for n, b in m._buffers.items():
            if b is tensor:
                out.append((m, n, "buffer"))
    return out


def map_first_input(args: tuple, kwargs: dict, fn: Callable, arg=None,
                    position: int | None = None) -> tuple[tuple, dict]:
    """Apply `fn` to one input tensor, keeping every other argument (never drop args). A named
    `arg` is taken from the keywords, else from `position` (its place in the signature)."""
    if isinstance(arg, str):
        if arg in kwargs:
            return args, {**kwargs, arg: fn(kwargs[arg])}
        if position is not None and len(args) > position and \
                isinstance(args[position], torch.Tensor):
            return (*args[:position], fn(args[position]), *args[position + 1:]), kwargs
        raise RuntimeError(f"input {arg!r} was not passed as a keyword argument")
    idx = 0 if arg is None else int(arg)
    if len(args) > idx and isinstance(args[idx], torch.Tensor):
        return (*args[:idx], fn(args[idx]), *args[idx + 1:]), kwargs
    if arg is None:
        for k in ("hidden_states", "input", "x", "input_ids"):
            if isinstance(kwargs.get(k), torch.Tensor):
                return args, {**kwargs, k: fn(kwargs[k])}
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                return args, {**kwargs, k: fn(v)}
    raise RuntimeError("no tensor input found to synchronise")


def map_first_output(out, fn: Callable):
    """Apply `fn` to the first tensor of a module output (tensor, tuple/list, dict/ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, (tuple, list)):
        for i, v in enumerate(out):
            if isinstance(v, torch.Tensor):
                items = list(out)
                items[i] = fn(v)
                return type(out)(items) if isinstance(out, list) or type(out) is tuple \
                    else type(out)(*items)
        return out
    if isinstance(out, dict):
        for k, v in out.items():
            if isinstance(v, torch.Tensor):
                out[k] = fn(v)
                return out
    raise RuntimeError(f"cannot synchronise an output of type {type(out).__name__}")


def export_captured(sch) -> str | None:
    """Path of the nearest node (this one or an ancestor) captured with tracer="export", if any.

    An export capture is an ATen graph with fixed shapes: its ops are not the torch-level calls
    that graph rewrites match, and its submodules are graphs, not Linear/Conv1D layers, so
    sharding or syncing inside it would silently break its hard-coded shapes."""
    node = sch
    while node is not None:
        if node.metadata.get("trace", {}).get("tracer") == "export":
            return node.path
        node = node.parent
    return None


def refuse_in_export_capture(sch, what: str, fix: str) -> None:
    where = export_captured(sch)
    if where is not None:
        from ..errors import SchedulingError

        raise SchedulingError(sch.path, f"{what} is not supported inside a module captured with "
                              f"tracer='export' (at {where or '<root>'}).", fix)
