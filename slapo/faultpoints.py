"""The one seam through which tests inject faults into production paths: a no-op hook.

Production code marks the points a test may want to fail at (`reach("save", step)` inside a
checkpoint save, `reach("pp_backward")` inside a guarded pipeline-stage backward) and reports
how many steps a resumed run has done (`steps_done`). Without a hook these cost one global
lookup and do nothing. A test enables a hook with `enable`, or, for a process it launches
(torchrun), sets `SLAPO_FAULT`, which `slapo.train.fault_injection.install` reads here
(`requested`, the one place the variable is read) and turns into a hook.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Protocol

ENV = "SLAPO_FAULT"


class Hook(Protocol):
    """What a test enables: called at every marked point while enabled."""

    def reach(self, point: str, step: int | None) -> None: ...

    def steps_done(self, done: int) -> None: ...


_HOOK: list[Hook] = []  # at most one


def requested(environ: Mapping[str, str] | None = None) -> str:
    """The fault `SLAPO_FAULT` asks for ("" for none): the one place the variable is read."""
    return (os.environ if environ is None else environ).get(ENV, "")


def reach(point: str, step: int | None = None) -> None:
    """A marked point (`step`: the training step it belongs to, None: the one in progress);
    the enabled hook may raise here or end the process."""
    if _HOOK:
        _HOOK[0].reach(point, step)


def steps_done(done: int) -> None:
    """The run's completed steps (a resumed run starts counting from its checkpoint's)."""
    if _HOOK:
        _HOOK[0].steps_done(done)


def enable(hook: Hook) -> Callable[[], None]:
    """Route every marked point to `hook` (instead of the hook enabled before); returns what
    disables it again (and restores the one before)."""
    previous = list(_HOOK)
    _HOOK[:] = [hook]

    def disable() -> None:
        if _HOOK and _HOOK[0] is hook:
            _HOOK[:] = previous

    return disable
