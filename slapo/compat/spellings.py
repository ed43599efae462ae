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
(slapo/compat/find.py).

find: an untraced node is traced first (trace by need, as 2023's `find` did; slapo/compat/find.py).

fuse: `compiler="TorchInductor"` -> "inductor"; `compiler="TorchScript"` (deprecated by PyTorch)
-> "inductor" with a one-time notice. `compiler=None` keeps today's meaning (no compilation).

shard: 2023 code reads `param.orig_shape` (the full shape) on a shard; the adapter adds it as an
annotation (carried through copies, `build` and `consolidate` like any `annotate` tag).

`sch.world_size` / `sch.rank`: the 2023 names of `tp_size` / `tp_rank` (they always meant the
schedule's group, which is the tensor-parallel group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn

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


def _trace(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    kw = trace_kwargs(sch, kwargs)
    decomposed = decomposed_below(sch)
    out = run(**kw)
    move_bias_adds_into_graph(sch, decomposed)
    return out


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


SPELLINGS: dict[str, MethodAdapter] = {
    "trace": MethodAdapter(_trace, keywords=("recursive", "leaf_modules", "config")),
    "fuse": MethodAdapter(_fuse),
    "shard": MethodAdapter(_shard),
    "find": MethodAdapter(find_by_need),
}

ATTRIBUTES: dict[str, Callable[[Schedule], Any]] = {
    "world_size": lambda node: node.tp_size,
    "rank": lambda node: node.tp_rank,
}

__all__ = ["ATTRIBUTES", "COMPILERS_2023", "SPELLINGS", "TRACERS_2023", "fuse_kwargs",
           "trace_kwargs"]
