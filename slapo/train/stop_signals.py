"""Stop signals (Ctrl-C, SIGTERM) during a `slapo train` command, and where the run was.

A **stop signal** (Ctrl-C: torchrun forwards SIGINT to every worker; SIGTERM from a job
scheduler): `stop_signals_trapped` records which signal came, so whatever exception the main
thread then unwinds with (a KeyboardInterrupt, DCP's wrapper of it, the gloo error of a peer
that stopped first) it is reported as a stop, not as a failure: no peer is blamed, and
`slapo train` prints one line naming the newest checkpoint and the command that resumes it
(`slapo/cli.py`). A SIGTERM sent because a peer died (torchrun does so) still names the peer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

from ..errors import SlapoError


class Terminated(SlapoError):
    """The launcher (or a job scheduler) sent SIGTERM: torchrun does so when another rank died."""


# signal: the first stop signal received (None: none); finishing: the rank is recording how it
# ends (a signal then is only recorded); hint: () -> "the newest checkpoint ...; resume with ...";
# phase: what the run is doing ("in step 7", "during the save of step 6"), for the one line.
_STOP: dict[str, Any] = {"signal": None, "finishing": False, "hint": None, "phase": None}


def launched_by_torchrun() -> bool:
    """Started by torchrun's agent (which is then this process's parent)?"""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _on_stop_signal(signum: int, frame: Any) -> None:
    if _STOP["signal"] is None:
        _STOP["signal"] = signum
    if _STOP["finishing"]:
        return  # recording how this rank ends (bounded): let it finish
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated("terminated by SIGTERM (torchrun sends it to every rank when one fails, "
                     "a job scheduler when it stops the job)")


def _trap() -> dict[int, Any]:
    """Install the stop-signal handler for SIGINT and SIGTERM (main thread only); return the
    handlers it replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _on_stop_signal) for s in (signal.SIGINT, signal.SIGTERM)}


@contextlib.contextmanager
def stop_signals_trapped(hint: Any = None):
    """For the span of a `slapo train` command: record which stop signal arrives (SIGINT
    raises KeyboardInterrupt, SIGTERM `Terminated`, as before) so `stopped_by` can tell a stop
    from a failure; `hint()` says where the run can be resumed from. The previous handlers are
    restored afterwards (the command may run inside another program, e.g. a test)."""
    _STOP.update(signal=None, finishing=False, hint=hint, phase=None)
    previous = _trap()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _STOP.update(signal=None, hint=None, finishing=False, phase=None)


def stop_hint() -> str:
    """The hint's text ("" without one, or if it fails: it runs while the process stops)."""
    try:
        return _STOP["hint"]() if _STOP["hint"] is not None else ""
    except Exception:  # noqa: BLE001 - a hint must never hide the stop itself
        return ""


def note_phase(text: str) -> None:
    """What the run is doing now ("in step 7"), named by the line a stop prints."""
    _STOP["phase"] = text


def phase() -> str | None:
    return _STOP["phase"]


def stopped_by(exc: BaseException | None = None) -> int | None:
    """The stop signal this process received (SIGINT, SIGTERM), or SIGINT when `exc` (or an
    error it was raised from) is a KeyboardInterrupt with no handler installed; else None."""
    if _STOP["signal"] is not None:
        return int(_STOP["signal"])
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, KeyboardInterrupt):
            return int(signal.SIGINT)
        exc = exc.__cause__ or exc.__context__
    return None



def trap_for_run() -> None:
    """Trap SIGTERM and SIGINT for the rest of the run (a `PeerWatch` run: a rank the launcher
    stops unwinds through `faults.finish_watch` and says why)."""
    _STOP.update(signal=None, finishing=False)
    _trap()


@contextlib.contextmanager
def finishing() -> Iterator[None]:
    """While this rank records how it ends, a stop signal is only recorded (`_on_stop_signal`)."""
    _STOP["finishing"] = True
    try:
        yield
    finally:
        _STOP["finishing"] = False
