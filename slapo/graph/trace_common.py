"""What the fx tracer's parts share: the value markers on nodes, the run-time guards a traced
graph keeps (`guard_equal`, `guard_absent`, `guard_kwargs`), and locating a failure in the
model's own code (`_TraceFailure`, `_user_frame`)."""

from __future__ import annotations

import linecache
import os
import traceback
from typing import Any

import torch.fx as fx
import torch.nn as nn
from torch.fx.node import has_side_effect

_UNKNOWN = object()
_VALUE, _DATA = "slapo_value", "slapo_data"
_SKIP_FRAMES = (os.sep + "torch" + os.sep, os.sep + "slapo" + os.sep + "graph" + os.sep,
                "contextlib.py", "functools.py")


class TraceGuardError(RuntimeError):
    """A traced graph was called with inputs that take another path than at trace time."""


@has_side_effect
def guard_equal(value: Any, expected: Any, what: str) -> None:
    """Run-time check of a decision made at trace time (kept by dead-code elimination)."""
    if isinstance(value, fx.Proxy):  # re-traced (an inlined GraphModule): stay a node
        return value.tracer.create_proxy("call_function", guard_equal, (value, expected, what),
                                         {})
    if value != expected:
        raise TraceGuardError(f"the traced graph was specialised on {what} == {expected!r}, "
                              f"but this call has {value!r}; re-trace with these inputs.")


@has_side_effect
def guard_absent(value: Any, what: str) -> None:
    """An input traced as None must stay None (an empty KV cache counts as absent)."""
    if isinstance(value, fx.Proxy):
        return value.tracer.create_proxy("call_function", guard_absent, (value, what), {})
    if value is None or _is_empty_cache(value):
        return
    raise TraceGuardError(f"the traced graph was specialised on {what} being None/absent, but "
                          f"this call passes a {type(value).__name__}; re-trace with it.")


@has_side_effect
def guard_kwargs(kwargs: dict, known: tuple, what: str) -> None:
    """Extra keyword arguments not seen at trace time must be None (they would be ignored)."""
    if isinstance(kwargs, fx.Proxy):
        return kwargs.tracer.create_proxy("call_function", guard_kwargs, (kwargs, known, what), {})
    extra = [k for k, v in kwargs.items() if k not in known and v is not None
             and not _is_empty_cache(v) and not isinstance(v, bool)]
    if extra:
        raise TraceGuardError(f"{what} got keyword argument(s) {extra} that were not present "
                              "when it was traced; re-trace with example_inputs including them.")


def _is_cache(value: Any) -> bool:
    return any(c.__name__.endswith("Cache") and "transformers" in c.__module__
               for c in type(value).__mro__)


def _is_empty_cache(value: Any) -> bool:
    if not _is_cache(value):
        return False
    try:
        return int(value.get_seq_length()) == 0
    except Exception:  # noqa: BLE001 - unknown cache type: treat as in use
        return False


def _user_frame() -> str:
    """file:line and code of the innermost model-code frame of the current stack."""
    for fr in reversed(traceback.extract_stack()[:-1]):
        if not any(s in fr.filename for s in _SKIP_FRAMES):
            line = fr.line or linecache.getline(fr.filename, fr.lineno).strip()
            return f"{fr.filename}:{fr.lineno} ({fr.name}): {line}"
    return "<unknown source line>"


def _frame_of(exc: BaseException) -> str:
    for fr in reversed(traceback.extract_tb(exc.__traceback__)):
        if not any(s in fr.filename for s in _SKIP_FRAMES):
            return f"{fr.filename}:{fr.lineno} ({fr.name}): {fr.line}"
    return "<unknown source line>"


class _TraceFailure(Exception):
    """Raised inside tracing with an already formatted problem (op + source line)."""

    def __init__(self, op: str, where: str, why: str):
        self.op, self.where, self.why = op, where, why
        super().__init__(f"{why} at {op!s} ({where})")


def _fetch(root: nn.Module, target: str):
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
