"""Schedule primitives: one file per primitive, each a registered `Primitive` class.

Importing this package imports every module in it, which registers the primitives.
"""

import importlib
import pkgutil

from .base import Primitive, get_primitive, list_primitives, register_primitive

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name != "base" and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["Primitive", "get_primitive", "list_primitives", "register_primitive"]
