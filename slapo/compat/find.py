"""Slapo 2023's `find` at the edge: trace by need, and a decompose done before the trace.

Trace by need. In 2023, `sch.find(regex | pattern_fn | Pattern())` on a node that was never
traced traced it first, with `trace()`'s defaults (recursive, not flattened, the "pytorch" fx
tracer, torch.nn built-ins and modules marked `traceable = False` kept as leaves), then matched.
The `find` adapter does the same with today's primitives: the query's own arguments are checked
first (a bad regex, `kind` or pattern type changes nothing), then the node is traced by the
typed `sch.trace()` (today's defaults, which are 2023's: `flatten=False`, torch.nn built-ins and
`traceable = False` modules as leaves; recorded in the node's history), then `find` runs on the
graph. A module that cannot be traced raises the trace's located `TraceError` and is left as it
was (2023 logged a warning and found nothing). A pattern that matches nothing raises as `find`
does, and the node stays untraced: the search first runs on a graph traced aside (`_dry_run`),
so a failed call changes nothing (2023 left the node traced).
The core primitive (`FindPrimitive.run`) still refuses an untraced module.

Decompose, then trace. 2023's `sch["fc"].decompose(); sch.trace(flatten=True)` put the bias add
in the traced graph (its `LinearWithSeparateBias` was traced through), where
`find(lambda x, b: F.gelu(b + x))` saw it. Today `decompose` on an untraced layer runs matmul
and bias inside the layer, and puts the add in the graph only when an ancestor is already
traced. So the `trace` adapter (slapo/compat/spellings.py) re-applies each such decompose once
the trace has made the layer a `call_module` leaf of a graph: the layer runs bias-free and the
graph gets `get_attr(<layer>.bias)` + `add`, exactly what decomposing after the trace gives.
A layer whose forward was changed in other ways too (a reducing sync kernel, hooks, wrappers)
keeps its bias inside, since moving the add after them would change what it computes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .. import module_patch
from ..primitives.decompose import DecomposePrimitive
from ..primitives.find import FindPrimitive
from ..schedule import Schedule
from ..sharding import Conv1DKernel, LinearKernel


# -------------------------------------------------------------------------------- find by need
def find_by_need(run: Callable[..., Any], sch: Schedule, kwargs: dict) -> Any:
    if not isinstance(sch.mod, fx.GraphModule):
        FindPrimitive.validate_query(sch, kwargs.get("pattern"), kwargs.get("kind"))
        if not decomposed_below(sch):
            _dry_run(sch, kwargs)
        sch.trace()
    return run(**kwargs)


def _dry_run(sch: Schedule, kwargs: dict) -> None:
    """The search on a graph traced aside (not installed): a module that cannot be traced or a
    pattern that matches nothing raises here, before the node is traced, so the failed call
    changes nothing. (With layers decomposed off-graph below the node, the installed trace
    moves their bias adds into the graph first, which an aside trace would not show: then the
    node is traced and a search that finds nothing leaves it traced, as 2023 did.)"""
    from types import SimpleNamespace

    from ..primitives.trace import _capture
    from .spellings import trace_kwargs

    leaves = trace_kwargs(sch, {}).get("leaves")  # what `sch.trace()` keeps as leaves
    gm = _capture(sch, sch.mod, leaves, False, "auto", None, None)[0]
    FindPrimitive.apply(SimpleNamespace(mod=gm, path=sch.path), kwargs.get("pattern"),
                        kwargs.get("kind"))


# ------------------------------------------------------------------------- decompose then trace
def _off_graph_decompose(node: Schedule) -> bool:
    """Whether `node` was decomposed while untraced and its forward changed in no other way."""
    mod = node.mod
    k = module_patch.kernel(mod)
    return (any(h.name == "decompose" for h in node.history)
            and not node.metadata.get("decomposed_in_graph")
            and type(k) in (LinearKernel, Conv1DKernel) and not k.reduce
            and k.scatter_dim is None and getattr(mod, "post_bias", None) is None
            and not module_patch.wrappers(mod) and not _has_hooks(mod))


def _has_hooks(mod: nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks
                or getattr(mod, "_backward_pre_hooks", None))


def decomposed_below(sch: Schedule) -> list[nn.Module]:
    """The layers below `sch` decomposed off-graph (looked up before `sch` is traced: a flattened
    trace may give their schedule nodes new parents, and with them empty histories)."""
    return [node.mod for path, node in sch.named_schedules() if path and
            _off_graph_decompose(node)]


def move_bias_adds_into_graph(sch: Schedule, layers: list[nn.Module]) -> None:
    """After `sch` was traced: each layer of `layers` that a graph below `sch` now calls as a
    leaf is decomposed again, in that graph (bias add as its own node), as 2023's trace did."""
    if not layers:
        return
    wanted = {id(m) for m in layers}
    done: set[int] = set()
    for _, node in list(sch.named_schedules()):
        mod = node.mod
        if id(mod) not in wanted or id(mod) in done or not _called_by_graph(node):
            continue
        done.add(id(mod))
        kernel = module_patch.kernel(mod)
        module_patch.set_kernel(mod, None)
        try:
            DecomposePrimitive.validate(node)
            DecomposePrimitive.apply(node)
        except Exception:
            module_patch.set_kernel(mod, kernel)  # keep the off-graph decompose
            raise


def _called_by_graph(node: Schedule) -> bool:
    """Whether the nearest traced ancestor's graph calls `node`'s module as a leaf."""
    rel, up = node.name, node.parent
    while up is not None:
        if isinstance(up.mod, fx.GraphModule):
            return any(n.op == "call_module" and n.target == rel for n in up.mod.graph.nodes)
        rel, up = f"{up.name}.{rel}", up.parent
    return False


__all__ = ["decomposed_below", "find_by_need", "move_bias_adds_into_graph"]
