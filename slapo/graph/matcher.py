"""Find nodes of a traced module: regex, predicate, or a pattern matched structurally.

Why our own small matcher rather than `torch.fx.passes.utils.matcher_utils.SubgraphMatcher`:
model code and pattern code rarely spell an op the same way (`x + b`, `torch.add`, `x.add`;
`F.silu(x)` against HF's `F.silu(x, inplace=False)`; `nn.GELU` against `F.gelu`), and
SubgraphMatcher compares targets and keyword sets exactly. We compare canonical op names, let a
pattern omit keyword arguments, match modules by class, and anchor each match at the pattern's
output, walking inputs backwards. Like Slapo's, it does not try commuted operands.
"""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn as nn

from .. import module_patch
from .subgraph import Subgraph

_ALIASES = {"truediv": "div", "iadd": "add", "imul": "mul", "isub": "sub", "radd": "add",
            "rmul": "mul", "matmul": "matmul", "getitem": "getitem", "floordiv": "floor_divide",
            "neg": "neg", "pow": "pow"}


def op_name(node: fx.Node) -> str:
    """A readable name of what a node computes (used for regex search)."""
    if node.op == "call_method":
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return str(node.target)


def _canon(node: fx.Node, gm: nn.Module) -> tuple:
    if node.op == "call_module":
        return ("module", module_patch.original_class(gm.get_submodule(node.target)))
    if node.op in ("call_function", "call_method"):
        name = op_name(node).strip("_")
        return ("op", _ALIASES.get(name, name))
    return (node.op, node.target)


def regex_nodes(gm: fx.GraphModule, pattern: str) -> list[fx.Node]:
    rx = re.compile(pattern)
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
            and (rx.search(n.name) or rx.search(op_name(n)))]


def is_predicate(fn: Callable, gm: fx.GraphModule) -> bool:
    """A one-argument callable returning a bool for a node (vs a pattern function)."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                         p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return False
    if len(params) != 1 or isinstance(fn, nn.Module):
        return False
    probe = next((n for n in gm.graph.nodes if n.op not in ("placeholder", "output")), None)
    if probe is None:
        return False
    try:
        return isinstance(fn(probe), bool)
    except Exception:  # noqa: BLE001 - it does not accept a node: a pattern function
        return False


class _PatternTracer(fx.Tracer):
    """Traces a pattern function/module, inlining any module it calls (e.g. an activation).

    In a `slapo.pattern.Pattern` (Slapo 2023's module patterns) torch.nn submodules stay
    `call_module` nodes instead, so they match graph submodules of the same class."""

    def __init__(self, by_type: bool = False):
        super().__init__()
        self.by_type = by_type

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return False

    def call_module(self, m, forward, args, kwargs):
        if self.by_type and type(m).__module__.startswith("torch.nn") and \
                not isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return self.create_proxy("call_module", self.path_of_module(m), args, kwargs)
        return forward(*args, **kwargs)


def trace_pattern(pattern: Callable | nn.Module) -> fx.GraphModule:
    root = pattern if isinstance(pattern, nn.Module) else _fn_module(pattern)
    graph = _PatternTracer(getattr(root, "_slapo_match_by_type", False)).trace(root)
    return fx.GraphModule(root, graph)


def _fn_module(fn: Callable) -> nn.Module:
    """A module whose forward has the function's own parameter names (so placeholders do).

    The names are spliced into source for `exec`, so each must be a plain identifier:
    `inspect.Parameter` enforces that, but a forged `__signature__` can bypass it, and a name
    like `x): import os  #` would run code. Checked here; the function itself is the caller's
    own Python object, never a string from a file or the command line."""
    names = [p.name for p in inspect.signature(fn).parameters.values()]
    bad = [n for n in names if not (isinstance(n, str) and n.isidentifier()
                                     and not keyword.iskeyword(n))]
    if bad:
        raise ValueError(f"pattern {fn!r} has parameter names that are not identifiers: {bad}")
    ns: dict[str, Any] = {"_fn": fn}
    exec(f"def forward(self, {', '.join(names)}):\n    return _fn({', '.join(names)})", ns)
    return type("Pattern", (nn.Module,), {"forward": ns["forward"]})()


def match_pattern(gm: fx.GraphModule, pattern: Callable | nn.Module) -> list[Subgraph]:
    pat = trace_pattern(pattern)
    pnodes = [n for n in pat.graph.nodes if n.op not in ("placeholder", "output")]
    out_node = next(n for n in pat.graph.nodes if n.op == "output")
    anchor = out_node.args[0]
    if not isinstance(anchor, fx.Node) or anchor.op == "placeholder" or not pnodes:
        raise ValueError("a pattern must compute something from its inputs and return one value")
    matches, used = [], set()
    for gn in gm.graph.nodes:
        mapping: dict[fx.Node, fx.Node] = {}
        if _match(anchor, gn, mapping, pat, gm):
            nodes = [mapping[p] for p in pnodes if p in mapping and p.op != "get_attr"]
            if used.isdisjoint(nodes):
                used.update(nodes)
                order = {n: i for i, n in enumerate(gm.graph.nodes)}
                matches.append(Subgraph(gm, sorted(set(nodes), key=order.__getitem__)))
    return matches


def _match(pn: fx.Node, gn: fx.Node, mapping: dict, pat: nn.Module, gm: nn.Module) -> bool:
    if pn in mapping:
        return mapping[pn] is gn
    if pn.op == "placeholder":
        mapping[pn] = gn
        return True
    regex = _module_regex(pn)
    if regex is not None:  # slapo.pattern.call_module: any submodule whose path matches
        if gn.op != "call_module" or not re.search(regex, str(gn.target)):
            return False
        pargs = pn.args[1:]
    elif gn.op in ("placeholder", "output") or _canon(pn, pat) != _canon(gn, gm):
        return False
    else:
        pargs = pn.args
    if len(pargs) > len(gn.args):
        return False
    snapshot = dict(mapping)
    mapping[pn] = gn
    pairs = list(zip(pargs, gn.args)) + [(v, gn.kwargs.get(k, _MISSING))
                                         for k, v in pn.kwargs.items()]
    for pa, ga in pairs:
        if not _match_arg(pa, ga, mapping, pat, gm):
            mapping.clear()
            mapping.update(snapshot)
            return False
    return True


_MISSING = object()


def _module_regex(pn: fx.Node) -> str | None:
    """The regex of a `slapo.pattern.call_module` pattern node, else None."""
    if pn.op == "call_function" and getattr(pn.target, "_slapo_module_regex", False):
        return pn.args[0]
    return None


def _match_arg(pa, ga, mapping, pat, gm) -> bool:
    if isinstance(pa, fx.Node):
        return isinstance(ga, fx.Node) and _match(pa, ga, mapping, pat, gm)
    if isinstance(pa, (tuple, list)):
        return isinstance(ga, (tuple, list)) and len(pa) == len(ga) and \
            all(_match_arg(a, b, mapping, pat, gm) for a, b in zip(pa, ga))
    if isinstance(pa, float) and isinstance(ga, (int, float)):
        return abs(pa - ga) <= 1e-12 * max(1.0, abs(pa))
    return pa == ga

