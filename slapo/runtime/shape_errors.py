"""Shape errors inside a scheduled module, re-raised naming the schedule (issue 15).

A weight sharded on the wrong axis, or a column-parallel bias left whole, makes torch raise
"mat1 and mat2 shapes cannot be multiplied" three modules deep in someone else's model, naming
neither the module nor the primitive that changed the shape. Here such an error is re-raised as
`ScheduledShapeError(path, problem, fix)`: the innermost *scheduled* module whose forward was
running, its input shapes, and the primitives that changed shapes there (`shard` with its axis,
local and full shapes, a bias left whole next to a sharded weight).

Two mechanisms, one message:

- `name_shape_errors(model, sch)` (what `slapo.build` calls, once): a `ForwardWrapper` on each
  module whose shapes a primitive changed (its own history has `shard`, `set_attr`, a shape
  changing `sync`, `replace`, ...) and on the parent of each sharded module (the code that
  reshapes its outputs, e.g. attention splitting heads). Zero cost when nothing goes wrong (a
  `try` around the call). Under `torch.compile` the wrapper is a plain call (`is_compiling()` is
  constant while dynamo traces, so the `try` is never traced): compiled blocks compile as before,
  and an error raised there keeps torch's message.
- `shape_errors_named(model, sch)` (what `Verify` uses): a context manager with forward hooks
  that leaves the model exactly as it was (no class swap, hooks removed on exit).

`ScheduledShapeError` is also a `RuntimeError`, so code that caught torch's shape errors still
catches them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from .. import module_patch, sharding
from ..errors import SchedulingError, SlapoError
from ..schedule import Schedule

#: primitives that can change the shape of a module's tensors or outputs
SHAPE_PRIMITIVES = ("shard", "set_attr", "sync", "replace", "decompose", "fuse", "trace")

_HINTS = ("shape", "size", "dimension", "mat1", "mat2", "split", "expand", "broadcast")


class ScheduledShapeError(SchedulingError, RuntimeError):
    """A shape error raised inside a scheduled module (see the module doc)."""


def _is_shape_error(exc: BaseException) -> bool:
    if isinstance(exc, SlapoError) or not isinstance(exc, (RuntimeError, ValueError)):
        return False
    text = str(exc).lower()
    return any(h in text for h in _HINTS)


def _shapes(args: tuple, kwargs: dict) -> str:
    vals = [a for a in args if isinstance(a, torch.Tensor)]
    vals += [v for v in kwargs.values() if isinstance(v, torch.Tensor)]
    return ", ".join(str(tuple(v.shape)) for v in vals[:4]) or "no tensors"


def _tensor_notes(module: nn.Module, prefix: str) -> list[str]:
    """Sharded tensors of `module` (and its submodules) with local and full shapes, and a bias
    left whole next to a weight sharded along its output axis."""
    notes = []
    for name, mod in module.named_modules():
        path = f"{prefix}.{name}" if prefix and name else (name or prefix)
        weight, bias = getattr(mod, "weight", None), getattr(mod, "bias", None)
        for pname, p in mod.named_parameters(recurse=False):
            spec = sharding.shard_spec(p)
            if spec is not None:
                notes.append(f"{path}.{pname} {tuple(p.shape)} is a shard (axis {spec.axis}) "
                             f"of {tuple(spec.orig_shape)}")
        layout = module_patch.module_meta(mod).get("output_layout")
        if isinstance(weight, torch.Tensor) and isinstance(bias, torch.Tensor) \
                and sharding.shard_spec(weight) is not None and sharding.shard_spec(bias) is None \
                and layout is not None and layout[0] == sharding.PARTITION:
            notes.append(f"{path}.bias {tuple(bias.shape)} is whole although the weight is "
                         "sharded along its output axis (column parallel)")
    return notes


def _primitive_notes(node: Schedule | None) -> list[str]:
    """The shape-changing primitives applied at `node` and below, as `path: prim(args)`."""
    if node is None:
        return []
    return [f"{path or '<root>'}: {h}" for path, h in node.applied()
            if h.name in SHAPE_PRIMITIVES]


def describe(path: str, module: nn.Module, node: Schedule | None, exc: BaseException,
             args: tuple = (), kwargs: dict | None = None) -> ScheduledShapeError:
    """The `ScheduledShapeError` for `exc` raised while `module` (at `path`) ran."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    prims = _primitive_notes(node)
    notes = _tensor_notes(module, path)
    problem = f"shape error inside this scheduled module: {type(exc).__name__}: {first}."
    if args or kwargs:
        problem += f" Input shapes: {_shapes(args, kwargs or {})}."
    if prims:
        problem += " Shapes here were changed by: " + "; ".join(prims[:8]) + "."
    if notes:
        problem += " " + "; ".join(notes[:6]) + "."
    fix = ("check each shard's axis: nn.Linear axis 0 / HF Conv1D axis 1 is column parallel "
           "(output split: shard the bias too, axis 0), nn.Linear axis 1 / Conv1D axis 0 is row "
           "parallel (input split: the bias stays whole and the layer needs sync('fwd_post', "
           "'all_reduce')); a layer fed by a column-parallel one must be row parallel; divide "
           "head counts and split sizes by the tensor-parallel degree (set_attr).")
    return ScheduledShapeError(path, problem, fix)


def targets(sch: Schedule) -> list[str]:
    """Paths of the modules to watch: those whose own history changed shapes, and the parent
    of every sharded module (its code reshapes the shard's output)."""
    paths: list[str] = []
    for _, node in sch.root.named_schedules():
        names = {h.name for h in node.history}
        if names & set(SHAPE_PRIMITIVES) and node.path not in paths:
            paths.append(node.path)
        if "shard" in names and node.parent is not None and node.parent.path not in paths:
            paths.append(node.parent.path)
    return paths


class ShapeErrorWrapper(module_patch.ForwardWrapper):
    """Re-raises a shape error from this module's forward as a `ScheduledShapeError`."""

    name = "name_shape_errors"

    def __init__(self, path: str, node: Schedule | None):
        self.path, self.node = path, node

    def __call__(self, module, fn, args, kwargs):
        if _compiling():  # dynamo: a plain call, no try block in the traced code
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ValueError) as exc:
            if not _is_shape_error(exc):
                raise
            raise describe(self.path, module, self.node, exc, args, kwargs) from exc


def _compiling() -> bool:
    comp = getattr(torch, "compiler", None)
    return bool(comp is not None and hasattr(comp, "is_compiling") and comp.is_compiling())


def name_shape_errors(model: nn.Module, sch: Schedule) -> int:
    """Wrap the forward of every module a shape-changing primitive touched (see `targets`), so a
    shape error raised there names the schedule path and the primitive. Idempotent; `model` is
    `sch.mod` or a copy with the same module paths. Returns the number of modules wrapped.

    `slapo.build` calls it after the schedule is final: `name_shape_errors(sch.mod, sch)`."""
    n = 0
    for path in targets(sch):
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            continue
        if any(isinstance(w, ShapeErrorWrapper) for w in module_patch.wrappers(mod)):
            continue
        node = sch[path] if path in sch.root else None
        module_patch.add_wrapper(mod, ShapeErrorWrapper(path, node))
        n += 1
    return n


@contextlib.contextmanager
def shape_errors_named(model: nn.Module, sch: Schedule) -> Iterator[None]:
    """Within the block, a shape error raised inside a watched module (see `targets`) is
    re-raised as `ScheduledShapeError`; the model is left exactly as it was (hooks only).

    The forward pre-hooks push the module on a stack and the forward hooks pop it; an exception
    skips the pops, so when it reaches this block the stack's top is the innermost watched
    module that was running."""
    watched = []
    for path in targets(sch):
        try:
            watched.append((path, model.get_submodule(path)))
        except AttributeError:
            continue
    stack: list[tuple[str, nn.Module, tuple, dict]] = []
    handles = []
    for path, mod in watched:
        def pre(m, args, kwargs, path=path):
            stack.append((path, m, args, kwargs))

        def post(m, args, out):
            if stack:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(mod.register_forward_hook(post))
    try:
        yield
    except (RuntimeError, ValueError) as exc:
        if not stack or not _is_shape_error(exc):
            raise
        path, mod, args, kwargs = stack[-1]
        node = sch[path] if path in sch.root else None
        raise describe(path, mod, node, exc, args, kwargs) from exc
    finally:
        for h in handles:
            h.remove()
