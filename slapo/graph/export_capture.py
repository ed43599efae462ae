"""Capture a module with `torch.export` (non-strict) when the fx tracer cannot follow it.

Why export as the fallback (and not dynamo): non-strict export runs the module's Python as
ordinary Python on fake tensors, so dict inputs, unusual containers and `torch.cond` work, and it
produces a *training* IR (pre-dispatch ATen ops that autograd differentiates when re-run). Its
`nn_module_stack` metadata lets `torch.export.unflatten` rebuild the original hierarchy.

What we fix after unflatten, because a schedule depends on it:
- unflatten clones every parameter and buffer; we re-point them to the *original* tensors so
  optimizers, shards, tied weights and `Verify` keep seeing the same objects;
- unflatten's modules run an `fx.Interpreter`; we turn each into a plain `fx.GraphModule`
  (same graph, same attributes) so `find` and the rest of slapo see an ordinary traced module;
- submodules that were never called come back as empty `nn.Module`s; we put the originals back;
- the graph is specialised to the example's shapes (static export), so guards on every tensor
  input's shape raise `TraceGuardError` instead of silently computing on other shapes.

Graph rewrites (fuse, subgraph replace/checkpoint) are not supported on these ATen-level graphs;
the primitive layer documents that `tracer='fx'` is needed for them.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import SchedulingError, TraceError
from .trace_common import _frame_of, guard_equal
from .tracer import _reorder, _restore_buffer_persistence

EXPORT_META = "slapo_exported"
DIALECT_META = "slapo_export_dialect"


class _ExportFailure(Exception):
    """torch.export failed; carries a one-line reason and the model source line."""

    def __init__(self, why: str, where: str):
        self.why, self.where = why, where
        super().__init__(f"{why} at {where}")


def export_module(root: nn.Module, example: tuple[tuple, dict] | None, *,
                  path: str = "") -> fx.GraphModule:
    """Capture `root` with non-strict `torch.export` as a hierarchy of GraphModules that keeps
    submodule paths, parameter objects and state_dict keys; raise `TraceError` on failure."""
    if example is None:
        raise SchedulingError(path, "tracer 'export' needs example_inputs (export runs the "
                              "module once on them).", "pass example_inputs=(args, kwargs), "
                              "e.g. from slapo.graph.capture_inputs(model, path, *inputs).")
    try:
        return _capture(root, example)
    except _ExportFailure as f:
        raise TraceError(path, f"tracer 'export' cannot capture {type(root).__name__}: "
                         f"{f.why} at {f.where}.", _fix_hint(f.why)) from None


def _capture(root: nn.Module, example: tuple[tuple, dict]) -> fx.GraphModule:
    args, kwargs = example
    try:
        with _quiet_failure():
            ep = torch.export.export(root, tuple(args), dict(kwargs), strict=False)
        dialect = ep.dialect
        unflat = torch.export.unflatten(ep)
    except Exception as e:  # noqa: BLE001 - any export failure becomes a located reason
        msg = str(e).strip().splitlines()
        raise _ExportFailure(f"{type(e).__name__}: {msg[0] if msg else ''}",
                             _frame_of(e)) from None
    gm = _as_graph_modules(unflat, root, "")
    _set_root_codegen(gm, unflat)
    _restore_originals(root, gm)
    _check_same_state(root, gm)
    _add_shape_guards(gm, args, kwargs, unflat)
    gm.meta[EXPORT_META] = True
    gm.meta[DIALECT_META] = dialect  # "TRAINING": pre-dispatch ATen, differentiable when re-run
    gm.train(root.training)
    return gm


@contextlib.contextmanager
def _quiet_failure() -> Iterator[None]:
    """On failure torch logs a warning and prints partial graph dumps to stderr before raising;
    the TraceError we raise already says what failed and where. So hold stderr back and replay
    it only when the capture succeeds (nothing is lost on success)."""
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        logger.setLevel(level)
    sys.stderr.write(buf.getvalue())


def _has_graph(mod: nn.Module) -> bool:
    return isinstance(getattr(mod, "graph", None), fx.Graph)


def _as_graph_modules(mod: nn.Module, orig: nn.Module | None, prefix: str) -> nn.Module:
    """Post-order: children first, so each parent's `call_module` targets are already
    GraphModules when the parent is built. Modules without a graph (never called) become the
    original module at that path (same class, same parameters)."""
    if type(mod).__name__ == "InterpreterModuleDispatcher":
        raise _ExportFailure(f"submodule {prefix.rstrip('.')!r} is called more than once with "
                             "different signatures", "the unflattened hierarchy")
    if not _has_graph(mod):
        if orig is not None and not any(_has_graph(m) for m in mod.modules()):
            return orig
    for name, child in list(mod._modules.items()):
        sub = orig.get_submodule(name) if orig is not None and _has_child(orig, name) else None
        mod._modules[name] = _as_graph_modules(child, sub, f"{prefix}{name}.")
    if not _has_graph(mod):
        return mod
    name = type(orig).__name__ if orig is not None else "ExportedModule"
    _unshadow_self(mod.graph)
    gm = fx.GraphModule(mod, mod.graph, class_name=name)
    for attr in ("_modules", "_parameters", "_buffers"):  # keep unused entries and their order
        src, dst = getattr(mod, attr), getattr(gm, attr)
        merged = {k: dst.get(k, v) for k, v in src.items()}
        merged.update({k: v for k, v in dst.items() if k not in merged})
        dst.clear()
        dst.update(merged)
    gm._non_persistent_buffers_set |= set(getattr(mod, "_non_persistent_buffers_set", ()))
    return gm


def _unshadow_self(graph: fx.Graph) -> None:
    """A call of a submodule named `self` (BERT's `attention.self`) yields a node named `self`,
    which would shadow the module in the generated forward: rename the node (not the target)."""
    for node in graph.nodes:
        if node.name == "self":
            node._rename("sub_self")


def _has_child(mod: nn.Module, name: str) -> bool:
    return name in mod._modules and mod._modules[name] is not None


def _set_root_codegen(gm: fx.GraphModule, unflat: nn.Module) -> None:
    """The unflattened root graph takes pytree-flattened inputs; give it the original call
    signature back (as `ExportedProgram.module()` does) so the parent calls it unchanged."""
    from torch.export._unlift import _get_codegen  # private, but the supported way ep.module()

    sig = unflat.module_call_graph[0].signature
    gm.graph._codegen = _get_codegen(sig.in_spec, sig.out_spec, sig.forward_arg_names)
    gm.recompile()


def _set_tensor(root: nn.Module, target: str, value: torch.Tensor, kind: str) -> None:
    owner_path, _, field = target.rpartition(".")
    owner = root.get_submodule(owner_path) if owner_path else root
    getattr(owner, kind)[field] = value


def _restore_originals(orig: nn.Module, gm: nn.Module) -> None:
    """unflatten clones parameters/buffers: put the original objects back under their names
    (the generated code reads attributes at call time, so this re-points the graph too)."""
    for name, p in orig.named_parameters(remove_duplicate=False):
        _set_tensor(gm, name, p, "_parameters")
    for name, b in orig.named_buffers(remove_duplicate=False):
        _set_tensor(gm, name, b, "_buffers")
    order: dict[str, int] = {}
    for name, _ in orig.named_modules(remove_duplicate=False):
        order.setdefault(name, len(order))
    for name, _ in [*orig.named_parameters(remove_duplicate=False),
                    *orig.named_buffers(remove_duplicate=False)]:
        order.setdefault(name, len(order))
    _reorder(gm, order)
    attrs = dict(orig.named_buffers(remove_duplicate=False))
    _restore_buffer_persistence(orig, gm, attrs)


def _check_same_state(orig: nn.Module, gm: nn.Module) -> None:
    """Refuse a capture that would change names or tensors (schedules and checkpoints rely on
    them)."""
    if list(gm.state_dict()) != list(orig.state_dict()):
        extra = sorted(set(gm.state_dict()) - set(orig.state_dict()))
        missing = sorted(set(orig.state_dict()) - set(gm.state_dict()))
        raise _ExportFailure(f"the unflattened module changes state_dict keys (extra {extra}, "
                             f"missing {missing})", "the unflattened hierarchy")
    mine = dict(gm.named_parameters(remove_duplicate=False))
    if any(mine.get(n) is not p for n, p in orig.named_parameters(remove_duplicate=False)):
        raise _ExportFailure("parameters could not be re-pointed to the original tensors",
                             "the unflattened hierarchy")


def _add_shape_guards(gm: fx.GraphModule, args: tuple, kwargs: dict, unflat: Any) -> None:
    """Static export bakes the example's shapes into views/reshapes; a call with other shapes
    of the same size would compute garbage silently, so guard each tensor input's shape."""
    sig = unflat.module_call_graph[0].signature
    flat, _ = pytree.tree_flatten((tuple(args), _reorder_kwargs(kwargs, sig.in_spec)))
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(phs) != len(flat):
        return  # constants were folded differently: leave the graph unguarded rather than wrong
    first = next((n for n in gm.graph.nodes if n.op != "placeholder"), None)
    for ph, value in zip(phs, flat, strict=True):
        if not isinstance(value, torch.Tensor) or first is None:
            continue
        with gm.graph.inserting_before(first):
            shape = gm.graph.call_function(getattr, (ph, "shape"))
            gm.graph.call_function(guard_equal, (shape, tuple(value.shape),
                                                 f"the shape of input {ph.name!r} (exported "
                                                 "with static shapes)"))
    gm.recompile()


def _reorder_kwargs(kwargs: dict, in_spec: pytree.TreeSpec) -> dict:
    from torch.export._tree_utils import reorder_kwargs

    return reorder_kwargs(kwargs, in_spec) if kwargs else kwargs


def is_exported(mod: nn.Module) -> bool:
    """True for the root GraphModule of an export capture."""
    return isinstance(mod, fx.GraphModule) and bool(getattr(mod, "meta", {}).get(EXPORT_META))


def _fix_hint(why: str) -> str:
    if "data-dependent" in why.lower() or "GuardOnDataDependent" in why:
        return ("write the branch with torch.cond, keep this module eager, or trace a smaller "
                "submodule that does not contain it.")
    return "keep this module eager, or trace a smaller submodule."
