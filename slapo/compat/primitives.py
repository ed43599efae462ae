"""2023 schedule methods that today's primitives do not spell: `replace_all`, `find_node`,
`trace_until`, `get_module`, `get_top_schedule`, each a thin loop or query over the modern
primitives (registered by `slapo.compat.install`, listed in `PRIMITIVES_2023`); and
`register_primitive`, the public registration that also takes 2023's primitive classes.

`replace_all(target_type, make_mod_fn, **kw)` is a loop over `replace`:

Every module of `target_type` under this node (found in one snapshot taken before any change,
so a replacement that itself contains `target_type` is not replaced again) is replaced by
`make_mod_fn(path, module, **kw)`, `path` being the module's full schedule path. All new modules
are built and every replacement validated before the first one is applied, so an error leaves
the model unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from ..errors import SchedulingError
from ..primitives.base import Primitive, get_primitive
from ..primitives.base import register_primitive as _register_primitive


def _targets(sch, target_type: type) -> list:
    """Outermost matches only: replacing an outer module replaces what it contains."""
    found: list = []
    for _, node in list(sch.named_schedules()):
        if node.parent is None or not isinstance(node.mod, target_type):
            continue
        if not any(node.path.startswith(f.path + ".") for f in found):
            found.append(node)
    return found


class ReplaceAllPrimitive(Primitive):
    """Replace every `target_type` module below this node by `make_mod_fn(path, mod, **kw)`."""

    name = "replace_all"

    @classmethod
    def validate(cls, sch, target_type: type, make_mod_fn: Callable, **kwargs) -> None:
        if not (isinstance(target_type, type) and issubclass(target_type, nn.Module)):
            raise SchedulingError(sch.path, f"target_type {target_type!r} is not an nn.Module "
                                  "class.", "pass a class, e.g. nn.GELU.")
        if not callable(make_mod_fn):
            raise SchedulingError(sch.path, "make_mod_fn is not callable.",
                                  "pass a function (path, module, **kw) -> nn.Module.")
        if not _targets(sch, target_type):
            raise SchedulingError(sch.path, f"no {target_type.__name__} module below this node.",
                                  "check the class (or the node the primitive is applied to).")

    @classmethod
    def apply(cls, sch, target_type: type, make_mod_fn: Callable, **kwargs) -> int:
        replace = get_primitive("replace")
        plan = [(node, make_mod_fn(node.path, node.mod, **kwargs))
                for node in _targets(sch, target_type)]
        for node, new in plan:
            replace.validate(node, new)
        for node, new in plan:
            replace.run(node, new)
        return len(plan)


class FindNodePrimitive(Primitive):
    """2023 `sch.find_node(fn)`: the nodes for which `fn(node)` is true, as one Subgraph (2023
    returned (parent_name, node) pairs). Like 2023's `find`, an untraced module is traced first
    (default options)."""

    name = "find_node"

    @classmethod
    def validate(cls, sch, fn: Callable) -> None:
        if not callable(fn):
            raise SchedulingError(sch.path, "find_node needs a predicate fn(node) -> bool.",
                                  "e.g. lambda n: n.op == 'call_method' and n.target == 'view'.")

    @classmethod
    def apply(cls, sch, fn: Callable):
        import torch.fx as fx

        if not isinstance(sch.mod, fx.GraphModule):
            sch.trace()
        return sch.find(fn, kind="predicate")

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        return False


class TraceUntilPrimitive(Primitive):
    """2023 `sch.trace_until(paths, **trace_kw)` on the top schedule: trace from the top down
    to the module(s) at `paths`, which stay leaves (their insides untraced); each traced level
    keeps its own GraphModule, as 2023 did for pipeline cutting. A module below whose own
    forward fx cannot trace (control flow on a shape, say) stays an untraced leaf, with a
    notice, as in 2023 (slapo.compat.spellings.untraceable_children)."""

    name = "trace_until"

    @classmethod
    def validate(cls, sch, paths, **kwargs) -> None:
        if sch.parent is not None:
            raise SchedulingError(sch.path, "trace_until works on the top schedule.",
                                  "call it on the root: sch.trace_until(...).")
        for p in [paths] if isinstance(paths, str) else list(paths):
            sch[p]  # raises a ScheduleKeyError naming the missing part

    @classmethod
    def apply(cls, sch, paths, **kwargs):
        from .spellings import TRACING_2023

        leaves = [paths] if isinstance(paths, str) else list(paths)
        token = TRACING_2023.set(True)  # 2023's rule: a module it cannot trace stays a leaf
        try:
            return sch.trace(leaves=leaves, flatten=False, **kwargs)
        finally:
            TRACING_2023.reset(token)


class GetModulePrimitive(Primitive):
    """2023 `sch.get_module(name)`: the submodule at dotted path `name` (relative)."""

    name = "get_module"

    @classmethod
    def validate(cls, sch, name: str) -> None:
        if name not in dict(sch.mod.named_modules()):
            raise SchedulingError(sch.path, f"no submodule {name!r}.",
                                  "use a dotted path relative to this node.")

    @classmethod
    def apply(cls, sch, name: str) -> nn.Module:
        return dict(sch.mod.named_modules())[name]

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        return False


class GetTopSchedulePrimitive(Primitive):
    """2023 `sch.get_top_schedule()`: the root of the tree (today's `sch.root`)."""

    name = "get_top_schedule"

    @classmethod
    def apply(cls, sch):
        return sch.root

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        return False


PRIMITIVES_2023: tuple[type[Primitive], ...] = (
    ReplaceAllPrimitive, FindNodePrimitive, TraceUntilPrimitive, GetModulePrimitive,
    GetTopSchedulePrimitive)


def register_primitive(cls: type[Primitive] | None = None):
    """`slapo.register_primitive`: the core's registration (`slapo.primitives.register_primitive`),
    also for a 2023 primitive class, whose `name` is a static method `name() -> str`: its
    string is set on the class as today's `name` before the class is registered."""

    def deco(c: type[Primitive]) -> type[Primitive]:
        if isinstance(c, type) and callable(getattr(c, "name", None)):
            c.name = c.name()
        return _register_primitive(c)

    return deco(cls) if cls is not None else deco
