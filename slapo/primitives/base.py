"""Primitive base class and registry.

A primitive is a class with `validate` (raise `SchedulingError`, mutate nothing) and `apply`
(mutate the module/schedule). `run` calls them in that order and records the call in the node's
history, so a failed primitive leaves the model and the schedule exactly as they were.

The edge's seam (`register_method_adapter`): the public API may take other spellings of a
primitive's arguments (Slapo 2023's, docs/migrating.md). They are translated at one boundary,
`run_given`, which every typed `Schedule` method calls: it hands the call to the adapter
registered for the primitive's name. The adapters live with the API they serve
(`slapo/compat/spellings.py`), which `slapo/__init__` registers explicitly; nothing in the core
imports them, and a primitive sees only today's arguments.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
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
        "given" (`sync`'s `axis`). A registered `MethodAdapter` (the edge's seam, see the
        module docstring) gets the call first."""
        defaults = _defaults(cls)
        given = {k: v for k, v in kwargs.items() if not _is_default(v, defaults.get(k, _NONE))}
        adapter = _METHOD_ADAPTERS.get(cls.name)
        if adapter is None:
            return cls.run(sch, **given)
        return adapter.adapt(functools.partial(cls.run, sch), sch, given)

    @classmethod
    def record(cls, sch, *args, **kwargs) -> bool:
        """Whether to add this call to the node's history (graph-only queries return False)."""
        return True


def register_primitive(cls: type[Primitive] | None = None):
    """Class decorator adding a primitive to every schedule node (`sch.<name>(...)`)."""

    def deco(c: type[Primitive]) -> type[Primitive]:
        if not isinstance(c.name, str) or not c.name:
            raise ValueError(f"{c.__name__} must set `name` to a non-empty string (the method "
                             f"name on schedule nodes), got {c.name!r}.")
        _REGISTRY[c.name] = c
        return c

    return deco(cls) if cls is not None else deco


@dataclass(frozen=True)
class MethodAdapter:
    """How the public API's other spellings of one primitive's call reach it.

    `adapt(run, sch, kwargs)` translates `kwargs` (the keywords the typed method received, left
    at default ones dropped) and returns `run(**today_kwargs)` (or what the call returns plus
    what the spelling promised, e.g. a tag on the result). `keywords`: argument names the typed
    `Schedule` method must accept beyond the primitive's `apply` parameters (the generator,
    `scripts/gen_primitive_methods.py`, gives that method `**kwargs`)."""

    adapt: Callable[[Callable[..., Any], Any, dict], Any]
    keywords: tuple[str, ...] = ()


_METHOD_ADAPTERS: dict[str, MethodAdapter] = {}


def register_method_adapter(name: str, adapter: MethodAdapter) -> None:
    """Route every typed call of primitive `name` through `adapter` (one per primitive; called
    by the edge, `slapo.compat.install`)."""
    if name in _METHOD_ADAPTERS and _METHOD_ADAPTERS[name] is not adapter:
        raise ValueError(f"primitive {name!r} already has a method adapter.")
    _METHOD_ADAPTERS[name] = adapter


def method_adapter(name: str) -> MethodAdapter | None:
    """The adapter registered for primitive `name`, if any."""
    return _METHOD_ADAPTERS.get(name)


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
