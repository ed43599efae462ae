"""Primitive base class and registry.

A primitive is a class with `validate` (raise `SchedulingError`, mutate nothing) and `apply`
(mutate the module/schedule). `run` calls them in that order and records the call in the node's
history, so a failed primitive leaves the model and the schedule exactly as they were.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

_REGISTRY: dict[str, type[Primitive]] = {}


class Primitive:
    """Base class. Subclasses set `name` and implement `validate` and `apply`."""

    name: str = ""

    @classmethod
    def validate(cls, sch, *args, **kwargs) -> None:
        """Raise `SchedulingError` if the call cannot be applied; must not mutate anything."""

    @classmethod
    def apply(cls, sch, *args, **kwargs) -> Any:
        raise NotImplementedError

    @classmethod
    def run(cls, sch, *args, **kwargs) -> Any:
        cls.validate(sch, *args, **kwargs)
        out = cls.apply(sch, *args, **kwargs)
        if cls.record(sch, *args, **kwargs):
            sch._record(cls.name, args, kwargs)
        return out

    @classmethod
    def run_given(cls, sch, **kwargs) -> Any:
        """`run` with the keyword arguments a typed `Schedule` method received, minus those left
        at their default: the node's history reads as the call was written (`checkpoint()`,
        not `checkpoint(subgraph=None, ...)`), and a primitive can tell "not given" from
        "given" (`sync`'s `axis`)."""
        defaults = _defaults(cls)
        given = {k: v for k, v in kwargs.items() if not _is_default(v, defaults.get(k, _NONE))}
        return cls.run(sch, **given)

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        """Whether to add this call to the node's history (graph-only queries return False)."""
        return True


def register_primitive(cls: type[Primitive] | None = None):
    """Class decorator adding a primitive to every schedule node (`sch.<name>(...)`)."""

    def deco(c: type[Primitive]) -> type[Primitive]:
        if callable(c.name):  # Slapo 2023 primitives define `name()` as a static method
            c.name = c.name()
        if not c.name:
            raise ValueError(f"{c.__name__} must set a non-empty `name`.")
        _REGISTRY[c.name] = c
        return c

    return deco(cls) if cls is not None else deco


def get_primitive(name: str) -> type[Primitive] | None:
    return _REGISTRY.get(name)


def list_primitives() -> list[str]:
    """Names of every registered primitive, in registration order."""
    return list(_REGISTRY)


_NONE = object()


@functools.cache
def _defaults(cls: type[Primitive]) -> dict[str, Any]:
    sig = inspect.signature(cls.apply)
    return {n: p.default for n, p in sig.parameters.items() if p.default is not p.empty}


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001 - a value whose == is not a bool is not the default
        return False
