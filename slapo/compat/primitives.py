"""2023 primitive `replace_all(target_type, make_mod_fn, **kw)`, as a loop over `replace`.

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
from ..primitives.base import Primitive, get_primitive, register_primitive


def _targets(sch, target_type: type) -> list:
    """Outermost matches only: replacing an outer module replaces what it contains."""
    found: list = []
    for _, node in list(sch.named_schedules()):
        if node.parent is None or not isinstance(node.mod, target_type):
            continue
        if not any(node.path.startswith(f.path + ".") for f in found):
            found.append(node)
    return found


@register_primitive
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
