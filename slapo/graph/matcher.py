"""Find nodes of a traced module: regex, predicate, or a pattern matched structurally.

Why our own small matcher rather than `torch.fx.passes.utils.matcher_utils.SubgraphMatcher`:
model code and pattern code rarely spell an op the same way (`x + b`, `torch.add`, `x.add`;
`F.silu(x)` against HF's `F.silu(x, inplace=False)`; `nn.GELU` against `F.gelu`), and
SubgraphMatcher compares targets and keyword sets exactly. We compare canonical op names, let a
pattern omit keyword arguments, match modules by class, and anchor each match at the pattern's
output, walking inputs backwards, with backtracking. As in Slapo 2023 a torch.nn module called
as a leaf is the same op as its functional form (`nn.GELU` and `F.gelu`: only the input is
compared), and, unlike 2023's matcher (which compared ops in graph order but not which value
feeds which operand), operands are matched: `F.relu(x) - x` does not match `x - F.relu(x)`, while
the operands of `+` and `*` are tried in both orders (`bias + x` matches `x + bias`).
"""

from __future__ import annotations

import inspect
import keyword
import re
from collections.abc import Callable, Iterator
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
    """Every match of `pattern` in `gm`, in graph order of the node matching the pattern's
    output; matches share no op (a node already matched is not matched again, as in Slapo)."""
    pat = trace_pattern(pattern)
    pnodes = [n for n in pat.graph.nodes if n.op not in ("placeholder", "output")]
    out_node = next(n for n in pat.graph.nodes if n.op == "output")
    anchor = out_node.args[0]
    if not isinstance(anchor, fx.Node) or anchor.op == "placeholder" or not pnodes:
        raise ValueError("a pattern must compute something from its inputs and return one value")
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    matches, used = [], set()
    for gn in gm.graph.nodes:
        for mapping in _match(anchor, gn, {}, pat, gm):
            nodes = {mapping[p] for p in pnodes if p in mapping and p.op != "get_attr"}
            if used.isdisjoint(nodes):
                used.update(nodes)
                matches.append(Subgraph(gm, sorted(nodes, key=order.__getitem__)))
                break
    return matches


# Ops whose two tensor operands may be given in either order (`bias + x` matches `x + bias`).
_COMMUTATIVE = {"add", "mul"}

# A torch.nn module and its functional form compute the same op once traced (`nn.GELU` called as
# a leaf and `F.gelu`); as in Slapo, only the input (the first argument) is compared, the module
# holds the rest (sizes, weights, eps, p).
_FUNCTIONAL_MODULES: dict[str, tuple[type[nn.Module], ...]] = {
    "relu": (nn.ReLU,), "gelu": (nn.GELU,), "silu": (nn.SiLU,), "tanh": (nn.Tanh,),
    "sigmoid": (nn.Sigmoid,), "softmax": (nn.Softmax,), "dropout": (nn.Dropout,),
    "layer_norm": (nn.LayerNorm,), "group_norm": (nn.GroupNorm,), "linear": (nn.Linear,),
    "conv1d": (nn.Conv1d,), "conv2d": (nn.Conv2d,), "conv3d": (nn.Conv3d,),
    "embedding": (nn.Embedding,), "mse_loss": (nn.MSELoss,),
    "cross_entropy": (nn.CrossEntropyLoss,),
}


def _match(pn: fx.Node, gn: fx.Node, mapping: dict, pat: nn.Module,
           gm: nn.Module) -> Iterator[dict]:
    """Each way pattern node `pn` matches graph node `gn` given `mapping` (pattern -> graph
    nodes), as an extended copy of `mapping`; alternatives come from commutative operands."""
    if pn in mapping:
        if mapping[pn] is gn:
            yield mapping
        return
    if pn.op == "placeholder":
        yield {**mapping, pn: gn}
        return
    if gn.op in ("placeholder", "output"):
        return
    operands = _operands(pn, gn, pat, gm)
    if operands is None:
        return
    pargs, gargs, kwargs = operands
    if len(pargs) > len(gargs):
        return
    mapping = {**mapping, pn: gn}
    orders = [list(zip(pargs, gargs))]
    if _commutes(pn, gn, pat, pargs, gargs):
        orders.append([(pargs[0], gargs[1]), (pargs[1], gargs[0])])
    for pairs in orders:
        yield from _match_all(pairs + kwargs, mapping, pat, gm)


def _operands(pn: fx.Node, gn: fx.Node, pat: nn.Module, gm: nn.Module):
    """(pattern args, graph args, keyword pairs) to compare if `pn` and `gn` are the same op,
    else None."""
    regex = _module_regex(pn)
    if regex is not None:  # slapo.pattern.call_module: any submodule whose path matches
        if gn.op != "call_module" or not re.search(regex, str(gn.target)):
            return None
        return pn.args[1:], gn.args, []
    pc, gc = _canon(pn, pat), _canon(gn, gm)
    if pc == gc:
        return pn.args, gn.args, [(v, gn.kwargs.get(k, _MISSING)) for k, v in pn.kwargs.items()]
    if _same_op_as_module(pc, pn, pat, gc, gn, gm):
        return pn.args[:1], gn.args[:1], []
    return None


def _same_op_as_module(pc, pn, pat, gc, gn, gm) -> bool:
    """One side calls a torch.nn module (with its own forward: no kernel), the other the
    module's functional form."""
    if pc[0] == "op" and gc[0] == "module":
        fn, mod = pc[1], gm.get_submodule(gn.target)
    elif pc[0] == "module" and gc[0] == "op":
        fn, mod = gc[1], pat.get_submodule(pn.target)
    else:
        return False
    return module_patch.kernel(mod) is None and \
        issubclass(module_patch.original_class(mod), _FUNCTIONAL_MODULES.get(fn, ()))


def _commutes(pn, gn, pat, pargs, gargs) -> bool:
    return (_canon(pn, pat) in {("op", name) for name in _COMMUTATIVE}
            and len(pargs) == len(gargs) == 2 and "alpha" not in pn.kwargs
            and "alpha" not in gn.kwargs)


def _match_all(pairs: list, mapping: dict, pat, gm) -> Iterator[dict]:
    if not pairs:
        yield mapping
        return
    (pa, ga), rest = pairs[0], pairs[1:]
    for m in _match_arg(pa, ga, mapping, pat, gm):
        yield from _match_all(rest, m, pat, gm)


_MISSING = object()


def _module_regex(pn: fx.Node) -> str | None:
    """The regex of a `slapo.pattern.call_module` pattern node, else None."""
    if pn.op == "call_function" and getattr(pn.target, "_slapo_module_regex", False):
        return pn.args[0]
    return None


def _match_arg(pa, ga, mapping, pat, gm) -> Iterator[dict]:
    if isinstance(pa, fx.Node):
        if isinstance(ga, fx.Node):
            yield from _match(pa, ga, mapping, pat, gm)
    elif isinstance(pa, (tuple, list)):
        if isinstance(ga, (tuple, list)) and len(pa) == len(ga):
            yield from _match_all(list(zip(pa, ga)), mapping, pat, gm)
    elif isinstance(pa, float) and isinstance(ga, (int, float)):
        if abs(pa - ga) <= 1e-12 * max(1.0, abs(pa)):
            yield mapping
    elif pa == ga:
        yield mapping
