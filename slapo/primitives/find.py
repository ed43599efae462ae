"""`find`: select nodes of a traced module (a query: not recorded in the history)."""

from __future__ import annotations

import re

import torch.fx as fx
import torch.nn as nn

from ..errors import SchedulingError
from ..graph.matcher import is_predicate, match_pattern, regex_nodes
from ..graph.subgraph import Subgraph
from .base import Primitive, register_primitive


@register_primitive
class FindPrimitive(Primitive):
    """Find ops in this traced module.

    - a string: a regex searched in node names and op names/targets ("gelu|act"); returns ONE
      Subgraph with every matching op (in graph order);
    - a predicate `fn(node) -> bool`: likewise;
    - a pattern function (`lambda x, b: F.gelu(x + b)`) or nn.Module: matched structurally
      (op names, argument structure, module classes); returns a list of Subgraphs, one per
      non-overlapping match.

    `kind="regex"|"predicate"|"pattern"` forces the interpretation. No match raises.
    """

    name = "find"

    @classmethod
    def validate(cls, sch, pattern, kind=None):
        if not isinstance(sch.mod, fx.GraphModule):
            raise SchedulingError(sch.path, f"find needs a traced module, but this is a "
                                  f"{type(sch.mod).__name__}.", "call .trace() on it first.")
        cls.validate_query(sch, pattern, kind)

    @classmethod
    def validate_query(cls, sch, pattern, kind=None):
        """The checks of `pattern` and `kind` alone, which need no graph (the edge's trace by
        need, slapo/compat/find.py, runs them before it traces the module)."""
        if kind not in (None, "regex", "predicate", "pattern"):
            raise SchedulingError(sch.path, f"unknown kind {kind!r}.",
                                  "use 'regex', 'predicate' or 'pattern'.")
        if not (isinstance(pattern, (str, nn.Module)) or callable(pattern)):
            raise SchedulingError(sch.path, f"cannot search for a {type(pattern).__name__}.",
                                  "pass a regex string, a predicate or a pattern function.")
        if isinstance(pattern, str):
            try:
                re.compile(pattern)
            except re.error as e:
                raise SchedulingError(sch.path, f"{pattern!r} is not a valid regular "
                                      f"expression: {e}.", "escape special characters "
                                      "(re.escape), e.g. 'gelu|act'.") from None

    @classmethod
    def apply(cls, sch, pattern, kind=None):
        gm = sch.mod
        if kind is None:
            kind = "regex" if isinstance(pattern, str) else \
                "predicate" if is_predicate(pattern, gm) else "pattern"
        if kind == "regex":
            nodes = regex_nodes(gm, pattern)
            return _one(sch, gm, nodes, f"regex {pattern!r}")
        if kind == "predicate":
            nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")
                     and pattern(n)]
            return _one(sch, gm, nodes, f"predicate {getattr(pattern, '__name__', pattern)}")
        try:
            found = match_pattern(gm, pattern)
        except Exception as e:  # noqa: BLE001 - report a pattern that cannot be traced
            raise SchedulingError(sch.path, f"the pattern could not be traced: "
                                  f"{type(e).__name__}: {e}", "write the pattern as a "
                                  "function of tensors returning one tensor.") from None
        if not found:
            raise SchedulingError(sch.path, f"pattern {getattr(pattern, '__name__', pattern)} "
                                  "matches nothing in this graph.", _ops_hint(gm))
        return found

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        return False


def _one(sch, gm, nodes, what) -> Subgraph:
    if not nodes:
        raise SchedulingError(sch.path, f"{what} matches no node of this graph.", _ops_hint(gm))
    return Subgraph(gm, nodes)


def _ops_hint(gm: fx.GraphModule) -> str:
    from ..graph.matcher import op_name

    names = list(dict.fromkeys(op_name(n) for n in gm.graph.nodes
                               if n.op not in ("placeholder", "output", "get_attr")))
    return f"ops in this graph: {', '.join(names[:25])}{' ...' if len(names) > 25 else ''}."
