"""Subgraphs of a traced module and the surgery shared by fuse / replace / checkpoint.

A `Subgraph` is an ordered set of fx nodes of one GraphModule. Moving it into a submodule needs
it to be *convex* (no path leaves the set and comes back) and to have exactly one node used
outside it; otherwise the rewrite would create a cycle or drop a value, so we refuse clearly.

Parameters and leaf modules used by the ops are never re-registered under the new submodule
(that would add `state_dict` keys and break name-based tools such as `Verify`): parameters are
passed in as arguments (their `get_attr` stays in the parent graph), and leaf modules are held
by an unregistered reference, so they stay owned by (and named after) their original parent.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch.fx as fx
import torch.nn as nn

from ..errors import SchedulingError


@dataclass
class Subgraph:
    """Nodes (in graph order) of the GraphModule `owner`, as returned by `find`."""

    owner: fx.GraphModule
    nodes: list[fx.Node]

    def __iter__(self) -> Iterator[fx.Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i):
        return self.nodes[i]

    def __repr__(self) -> str:
        return f"Subgraph([{', '.join(n.name for n in self.nodes)}])"

    @property
    def inputs(self) -> list[fx.Node]:
        """External nodes the subgraph reads, in first-use order."""
        inside, seen, out = set(self.nodes), set(), []
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in inside and a not in seen:
                    seen.add(a)
                    out.append(a)
        return out

    @property
    def outputs(self) -> list[fx.Node]:
        """Nodes of the subgraph used outside it."""
        inside = set(self.nodes)
        return [n for n in self.nodes if any(u not in inside for u in n.users)]


def as_subgraph(sch, target, what: str) -> Subgraph:
    """Normalise what a user passes (Subgraph, [Subgraph], list of nodes) to one Subgraph."""
    gm = sch.mod
    if not isinstance(gm, fx.GraphModule):
        raise SchedulingError(sch.path, f"{what} of a subgraph needs a traced module, but this is "
                              f"a {type(gm).__name__}.", "call .trace() on this module first.")
    if isinstance(target, (list, tuple)) and len(target) == 1 and isinstance(target[0],
                                                                             Subgraph):
        target = target[0]
    if isinstance(target, (list, tuple)) and target and all(isinstance(t, Subgraph)
                                                            for t in target):
        raise SchedulingError(sch.path, f"{what} got {len(target)} subgraphs; it is ambiguous "
                              "which one to use.", "pass one of them, e.g. subgraphs[0], or "
                              "apply the primitive once per subgraph.")
    if isinstance(target, (list, tuple)) and all(isinstance(t, fx.Node) for t in target):
        target = Subgraph(gm, list(target))
    if not isinstance(target, Subgraph):
        raise SchedulingError(sch.path, f"{what} expects a subgraph from .find(), got "
                              f"{type(target).__name__}.", "pass the result of sch.find(...).")
    if target.owner is not gm or any(n.graph is not gm.graph for n in target.nodes):
        raise SchedulingError(sch.path, f"this subgraph belongs to another (or an older) graph "
                              f"than {sch.path or '<root>'}'s.", "call .find() again on this "
                              "module after the last graph change.")
    if not target.nodes:
        raise SchedulingError(sch.path, f"{what} got an empty subgraph.", "find something first.")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    bad = [n.name for n in target.nodes if n.op in ("placeholder", "output", "get_attr")]
    if bad:
        raise SchedulingError(sch.path, f"{what}: nodes {bad} are inputs/parameters/outputs, "
                              "which cannot be moved into a submodule.", "select only ops.")
    return Subgraph(gm, sorted(dict.fromkeys(target.nodes), key=order.__getitem__))


def check_movable(sch, sub: Subgraph, what: str) -> fx.Node:
    """Raise unless `sub` can become one submodule call; return its single output node."""
    outs = sub.outputs
    inside = set(sub.nodes)
    if len(outs) != 1 or (outs and outs[0] is not sub.nodes[-1] and
                          any(u not in inside for u in sub.nodes[-1].users)):
        desc = ", ".join(f"{n.name} (used by {', '.join(u.name for u in n.users if u not in inside)})"
                         for n in outs) or "none"
        raise SchedulingError(sch.path, f"{what}: the subgraph is not contiguous: it needs exactly "
                              f"one value used outside it, but these are: {desc}.",
                              "extend the subgraph to include those users, or pick a smaller one "
                              "that ends in a single value.")
    # convexity: no external node on a path between two subgraph nodes
    frontier = [u for n in sub.nodes for u in n.users if u not in inside]
    reach: set[fx.Node] = set()
    while frontier:
        n = frontier.pop()
        if n in reach:
            continue
        reach.add(n)
        frontier.extend(n.users)
    back = [n for n in sub.nodes if any(a in reach for a in n.all_input_nodes)]
    if back:
        raise SchedulingError(sch.path, f"{what}: the subgraph is not contiguous: {back[0].name} "
                              "reads a value computed from the subgraph's own output outside it.",
                              "include the ops in between, or split the subgraph.")
    return outs[0]


def extract(sub: Subgraph, name: str) -> tuple[fx.GraphModule, list[fx.Node]]:
    """Copy `sub` into a new GraphModule taking the external inputs as placeholders."""
    gm, inputs = sub.owner, sub.inputs
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = graph.placeholder(_safe(a.name))
    modules: dict[str, nn.Module] = {}
    for n in sub.nodes:
        new = graph.node_copy(n, lambda x: env[x])
        if n.op == "call_module":
            flat = _safe(n.target)
            modules[flat] = gm.get_submodule(n.target)
            new.target = flat
        env[n] = new
    graph.output(env[sub.nodes[-1]])
    out = fx.GraphModule(dict(modules), graph, class_name=name)
    for flat, mod in modules.items():  # reference, not own: names stay with the parent
        del out._modules[flat]
        out.__dict__[flat] = mod
    return out, inputs


def install(sub: Subgraph, new: nn.Module | Callable, name: str, inputs: Sequence[fx.Node],
            extra_kwargs: dict | None = None) -> fx.Node:
    """Register `new` in the owner (if a module) and replace `sub` by one call to it."""
    gm = sub.owner
    last = sub.nodes[-1]
    with gm.graph.inserting_after(last):
        if isinstance(new, nn.Module):
            gm.add_module(name, new)
            call = gm.graph.call_module(name, tuple(inputs), dict(extra_kwargs or {}))
        else:
            call = gm.graph.call_function(new, tuple(inputs), dict(extra_kwargs or {}))
    last.replace_all_uses_with(call)
    for n in reversed(sub.nodes):
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return call


def fresh_name(gm: nn.Module, base: str) -> str:
    base = _safe(base) or "sub"
    name, i = base, 1
    while hasattr(gm, name):
        name, i = f"{base}_{i}", i + 1
    return name


def _safe(s: str) -> str:
    return re.sub(r"\W", "_", s)


def rebuild_tree(sch) -> None:
    """Re-sync the schedule subtree with the modules after a graph rewrite.

    `Schedule._build_children` keeps a child node whenever the parent still has a module under
    that name, so nodes under a *replaced* child would go stale; walk the whole subtree."""
    sch._build_children()
    for child in sch.child.values():
        rebuild_tree(child)
