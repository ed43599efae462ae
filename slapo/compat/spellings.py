"""Slapo 2023's spellings of schedule calls, translated at the edge: the table `SPELLINGS`
(primitive name -> `MethodAdapter`) and `ATTRIBUTES` (2023 attribute names of a node).

`slapo.compat.install()` (called by `slapo/__init__`) registers them with the core's seams
(`slapo.primitives.base.register_method_adapter`, `slapo.schedule.register_attribute`); the
typed `Schedule` methods hand each call to its adapter (`Primitive.run_given`), so a 2023
schedule's calls reach the modern primitive, with its own validation, in today's words. No
primitive knows these spellings. docs/migrating.md has the table.

trace: `tracer="pytorch"|"huggingface"` -> "fx" (one tracer handles HF models now, given
`example_inputs` where HF code reads shapes); `leaf_modules=` -> `leaves=`; `recursive=False`
-> every direct child is a leaf; `config=` (the HF tracer's dummy-input config) is dropped with a
notice; modules marked `traceable = False` (2023's leaf marker) are leaves. "dynamo" stays
refused by the primitive, with its reason. 2023 returned False on failure (which hid errors,
upstream issue #89); a failure now raises, and success returns the (truthy) GraphModule. A
layer decomposed before the trace gets its bias add in the new graph, as 2023's did
(slapo/compat/find.py). A call written the 2023 way (a 2023 keyword or tracer name, or through
`trace_until` / `slapo.trace`) that fails keeps 2023's rule for submodules: 2023 traced each
module apart and kept one whose own forward fx cannot follow (control flow on a shape, say)
as an untraced leaf, with a warning; here `untraceable_children` finds them, the trace is
retried with them as leaves, and a notice names them. A plain `sch.trace()` still raises.

replace: a single fx node as `target_ops` (2023's `replace(fn, sch.find_node(...)[0])`) is the
one-node subgraph.

find: an untraced node is traced first (trace by need, as 2023's `find` did; slapo/compat/find.py).

fuse: `compiler="TorchInductor"` -> "inductor"; `compiler="TorchScript"` (deprecated by PyTorch)
-> "inductor" with a one-time notice. `compiler=None` keeps today's meaning (no compilation).

shard: 2023 code reads `param.orig_shape` (the full shape) on a shard; the adapter adds it as an
annotation (carried through copies, `build` and `consolidate` like any `annotate` tag).

`sch.world_size` / `sch.rank`: the 2023 names of `tp_size` / `tp_rank` (they always meant the
schedule's group, which is the tensor-parallel group). `sch.metadata.param_tags`: the annotation
keys in the tree; `sch.metadata.tie_weights`: its shared parameters (`METADATA_ATTRIBUTES`).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

import torch.nn as nn

from ..errors import TraceError
from ..notices import notice_once
from ..primitives.annotate import AnnotatePrimitive
from ..primitives.base import MethodAdapter
from ..schedule import Schedule
from ..sharding import shard_spec
from .find import decomposed_below, find_by_need, move_bias_adds_into_graph

TRACERS_2023 = {"pytorch": "fx", "huggingface": "fx"}
COMPILERS_2023 = {"TorchInductor": "inductor", "TorchScript": "inductor"}


# ------------------------------------------------------------------------------------- trace
def _untraceable(mod: nn.Module) -> list[str]:
    return [name for name, m in mod.named_modules() if name and
            getattr(m, "traceable", True) is False]


def trace_kwargs(sch: Schedule, kwargs: dict) -> dict:
    """Today's trace keywords for a call that may use 2023 spellings (input not mutated)."""
    kw = dict(kwargs)
    tracer = kw.get("tracer")
    if isinstance(tracer, str) and tracer in TRACERS_2023:
        kw["tracer"] = TRACERS_2023[tracer]
    if "leaf_modules" in kw:
        extra = list(kw.pop("leaf_modules") or ())
        kw["leaves"] = list(kw.get("leaves") or ()) + extra
    if "config" in kw:
        kw.pop("config")
        notice_once("trace.config", "sch.trace(config=...) is the 2023 HF tracer's dummy-input "
                    "config; it is ignored. Pass example_inputs=(args, kwargs) if the model "
                    "reads input shapes while tracing.", stacklevel=6)
    recursive = kw.pop("recursive", True)
    leaves = list(kw.get("leaves") or ())
    if recursive is False:
        leaves += [n for n, _ in sch.mod.named_children()]
    if kw.get("tracer") != "export":
        leaves += _untraceable(sch.mod)
    if leaves:
        kw["leaves"] = list(dict.fromkeys(leaves))
    return kw


# Set while a 2023-only entry point traces (`trace_until`, `slapo.trace`): those calls get 2023's
# rule for children that cannot be traced even when no 2023 keyword was spelled.
TRACING_2023: contextvars.ContextVar[bool] = contextvars.ContextVar("slapo_tracing_2023",
                                                                   default=False)


def _written_2023(kwargs: dict) -> bool:
    return (TRACING_2023.get() or kwargs.get("tracer") in TRACERS_2023 or
            any(k in kwargs for k in ("recursive", "leaf_modules", "config")))


def _trace(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    kw = trace_kwargs(sch, kwargs)
    decomposed = decomposed_below(sch)
    try:
        out = run(**kw)
    except TraceError:
        if not _written_2023(kwargs) or kw.get("flatten") or kw.get("tracer") == "export":
            raise
        untraceable = untraceable_children(sch, kw)
        if not untraceable:
            raise
        notice_once(f"trace.untraceable:{sch.path}:{untraceable}",
                    f"trace of {sch.path or '<root>'}: {untraceable} cannot be traced on their "
                    "own (e.g. Python control flow on a shape or value) and stay untraced "
                    "leaves, as Slapo 2023's tracer kept them.", stacklevel=6)
        kw["leaves"] = list(kw.get("leaves") or ()) + untraceable
        out = run(**kw)
    move_bias_adds_into_graph(sch, decomposed)
    return out


def untraceable_children(sch: Schedule, kw: dict) -> list[str]:
    """Paths (relative to `sch`) of the outermost submodules whose own forward, with their
    children as leaves, fx cannot trace: 2023's non-flattened trace traced each module apart
    and kept such a module untraced (its warning, "Cannot trace module"). Modules that are
    leaves anyway are not tried; nor is anything below a module found untraceable."""
    from ..graph import trace_module
    from ..primitives.trace import _leaf_predicate

    is_leaf = _leaf_predicate(list(kw.get("leaves") or ()))
    found: list[str] = []

    def own_leaves(prefix: str):
        def pred(m: nn.Module, qual: str) -> bool:
            parts = qual.split(".")
            direct = len(parts) == 1 or (len(parts) == 2 and isinstance(
                sch.mod.get_submodule(_join(prefix, parts[0])), (nn.ModuleList, nn.ModuleDict)))
            return direct or is_leaf(m, _join(prefix, qual))
        return pred

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            path = _join(prefix, name)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                visit(path, child)
                continue
            if is_leaf(child, path):
                continue
            try:
                trace_module(child, own_leaves(path), flatten=False, path=path)
            except TraceError:
                found.append(path)
                continue
            visit(path, child)

    visit("", sch.mod)
    return found


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# -------------------------------------------------------------------------------------- fuse
def fuse_kwargs(kwargs: dict) -> dict:
    """Today's fuse keywords for a call that may use 2023 compiler names (the typed method
    passes `compiler` by keyword, also when the caller gave it positionally)."""
    kw = dict(kwargs)
    compiler = kw.get("compiler")
    if compiler == "TorchScript":
        notice_once("fuse.TorchScript", "fuse(compiler='TorchScript'): TorchScript is "
                    "deprecated in PyTorch; the subgraph is compiled with torch.compile "
                    "(backend 'inductor') instead.", stacklevel=6)
    if compiler in COMPILERS_2023:
        kw["compiler"] = COMPILERS_2023[compiler]
    return kw


def _fuse(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    return run(**fuse_kwargs(kwargs))


# ------------------------------------------------------------------------------------- shard
def _shard(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    """Shard as today, then tag each new shard with its full shape (`orig_shape`, 2023's
    annotation) the way `annotate` does, so copies and `build` carry it."""
    out = run(**kwargs)
    names = kwargs["name_or_names"]
    for name in [names] if isinstance(names, str) else names:
        tensor = sch.mod._parameters.get(name)
        tensor = tensor if tensor is not None else sch.mod._buffers.get(name)
        spec = shard_spec(tensor)
        if spec is not None:
            AnnotatePrimitive.apply(sch, name, "orig_shape", tuple(spec.orig_shape))
    return out


# ----------------------------------------------------------------------------------- replace
def _replace(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    """2023's `replace(fn, node)` replaced one node (its `find_node(...)[0]`): a bare fx node as
    `target_ops` is the one-node subgraph it names."""
    import torch.fx as fx

    if isinstance(kwargs.get("target_ops"), fx.Node):
        kwargs = {**kwargs, "target_ops": [kwargs["target_ops"]]}
    return run(**kwargs)


SPELLINGS: dict[str, MethodAdapter] = {
    "trace": MethodAdapter(_trace, keywords=("recursive", "leaf_modules", "config")),
    "fuse": MethodAdapter(_fuse),
    "shard": MethodAdapter(_shard),
    "find": MethodAdapter(find_by_need),
    "replace": MethodAdapter(_replace),
}

ATTRIBUTES: dict[str, Callable[[Schedule], Any]] = {
    "world_size": lambda node: node.tp_size,
    "rank": lambda node: node.tp_rank,
}


def param_tags(node: Schedule) -> frozenset[str]:
    """2023's `sch.metadata.param_tags`: the annotation keys (`annotate`, and `shard`'s
    `orig_shape`) on the parameters and buffers of the whole tree, read from the tensors (which
    carry their tags through `shard`, copies and `build`). 2023 kept a set on the top node that
    `annotate` added to; here it is a read-only view, the same from every node."""
    root = node.root.mod
    keys: set[str] = set()
    for t in [*root.parameters(), *root.buffers()]:
        keys.update(getattr(t, "_slapo_tags", None) or ())
    return frozenset(keys)


def tie_weights(node: Schedule) -> dict:
    """2023's `sch.metadata.tie_weights`: {parameter: parameter} for each parameter the tree's
    modules share (2023 analysed the model once, when the schedule was created, and updated the
    entries as `shard` replaced parameters; here the current model is analysed on each read,
    `slapo.pipeline.analyze_tie_weights(model, False)`). `shard` keeps tied parameters tied."""
    from .pipeline import analyze_tie_weights

    return {p: p for p in analyze_tie_weights(node.root.mod, False)}


METADATA_ATTRIBUTES: dict[str, Callable[[Schedule], Any]] = {"param_tags": param_tags,
                                                             "tie_weights": tie_weights}

__all__ = ["ATTRIBUTES", "COMPILERS_2023", "METADATA_ATTRIBUTES", "SPELLINGS", "TRACERS_2023", "fuse_kwargs",
           "trace_kwargs"]
