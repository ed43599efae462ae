"""2023 `slapo.utils.common`: hooks of a module by kind, and moving them to a replacement.

Fixed 2023 bug: `transfer_hooks` made the new module *share* the old one's hook dicts (a hook
added to either later fired on both); here the hooks are copied into the new module's dicts,
the way `replace` moves them.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

import torch.nn as nn

from ..primitives.replace import _move_hooks

HOOK_TYPE_TO_ATTR = {
    "fwd_pre": ("_forward_pre_hooks",),
    "fwd_post": ("_forward_hooks",),
    "bwd_post": ("_backward_hooks", "_backward_pre_hooks"),
}


def get_hooks(mod: nn.Module) -> dict[str, list]:
    """{"fwd_pre": [...], "fwd_post": [...], "bwd_post": [...]}: the hook callables."""
    return {kind: [h for attr in attrs for h in getattr(mod, attr).values()]
            for kind, attrs in HOOK_TYPE_TO_ATTR.items()}


def has_hook(mod: nn.Module, hook_type: str) -> bool:
    return bool(get_hooks(mod)[hook_type])


def transfer_hooks(old_mod: nn.Module, new_mod: nn.Module,
                   hook_types: list[str] | None = None) -> None:
    """Copy `old_mod`'s hooks (all kinds, or `hook_types`) onto `new_mod`."""
    if hook_types is None:
        _move_hooks(old_mod, new_mod)
        return
    for kind in hook_types:
        for attr in HOOK_TYPE_TO_ATTR[kind]:
            getattr(new_mod, attr).update(getattr(old_mod, attr))


@cache
def importlib_or_none(name: str) -> ModuleType | None:
    """The module if it imports, else None (optional dependencies)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


__all__ = ["get_hooks", "has_hook", "importlib_or_none", "transfer_hooks"]
