"""A rank that dies or fails in a `slapo train` job: who it was, a bounded exit.

What happens without this module (measured: torchrun, 2 gloo ranks on CPU, one rank SIGKILLed
mid-step): the survivor's next collective fails within a second ("Connection reset by peer",
gloo notices the closed socket), torchrun's agent sends SIGTERM to the rest and prints a summary
whose "Root Cause" names the killed rank. Two things were missing, and `PeerWatch` adds them:

- **the survivors' own message named no rank** (a gloo traceback). Every rank now heartbeats
  through the job's TCP store and records how it exits (`done`, or its error); when a rank stops
  on a communication error (or on the launcher's SIGTERM), `diagnose` reads the records and
  heartbeats and the run ends with `slapo train: error: rank 0 stopped: rank 1 died (no heartbeat,
  no exit recorded: killed, out of memory, or its machine was lost) ...` (a `PeerFailure`).
- **a bound that does not come from the collective timeout**: gloo fails fast on a closed
  socket, but NCCL, or a rank blocked outside a collective, waits for `--dist-timeout`. The
  heartbeat thread stops this rank (`os._exit(1)`, after printing why) when a peer has neither
  heartbeated nor recorded an exit for `HANG_S` seconds, whatever `--dist-timeout` says.

The heartbeats use a client of their own to the job's store (MASTER_ADDR:MASTER_PORT: torchrun's
agent store, which outlives any worker), so a main thread blocked in a store operation cannot
stall them. Only a process that created its process group runs a `PeerWatch` (a `slapo train`
launched by torchrun); a caller's group (tests, notebooks) is left alone.

Two more ways a run ends that are not a rank's own failure, both answered with one line:

- **the launcher is gone** (torchrun's agent SIGKILLed, or the node holding the job's store
  lost): torchrun starts every worker in a session of its own, so nothing signals them, and the
  workers' collectives go on between themselves: they kept training and writing checkpoints, and
  a `--resume` started meanwhile raced them. The heartbeat thread checks every `HEARTBEAT_S`
  that this process's parent is still the agent that started it (under torchrun) and that the
  job's store answers; when either fails it prints one line (local rank 0) and ends the process
  (`os._exit`): a save cut short leaves only its `.tmp` directory, which nothing reads.
- **a stop signal** (Ctrl-C, a job scheduler's SIGTERM): `stop_signals.py` records which signal
  came, so the run is reported as a stop, not as a failure (no peer is blamed).

The `SLAPO_FAULT` test hook that kills or fails a rank at a named point: `fault_injection.py`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ..errors import SlapoError
from .stop_signals import (
    Terminated,
    finishing,
    launched_by_torchrun,
    stop_hint,
    stopped_by,
    trap_for_run,
)

HEARTBEAT_S = 0.25   # how often a rank heartbeats (and checks its peers)
SILENT_S = 1.5       # a peer silent this long, with no exit recorded, is reported as dead
DIAGNOSE_S = 3.0     # the longest a failing rank waits to learn who failed
HANG_S = 30.0        # a peer silent this long stops this rank, whatever --dist-timeout says

__all__ = ["PeerFailure", "PeerWatch", "finish_watch", "is_comm_failure", "start_watch",
           "watch_launcher"]


class PeerFailure(SlapoError):
    """This rank stopped because another rank died or failed; the message names it."""


# ---- who failed: heartbeats and exit records through the job's store ---------------------------
_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout",
               "nccl", "gloo", "socket", "peer")


def is_comm_failure(exc: BaseException | None) -> bool:
    """Did this rank stop because talking to another rank failed, or because it was stopped
    from outside (SIGTERM, Ctrl-C), rather than for its own reason?

    The exception's causes count too: torch's pipeline stage re-raises whatever its forward
    hit (e.g. FSDP2's parameter all-gather finding its peer gone) as a bare
    `RuntimeError("[Stage 1] failed to run forward ...") from e`, and without looking at
    `e` this rank would report itself as the failing one."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _is_comm_error(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def describe(exc: BaseException) -> str:
    """`Type: message` of the error a peer should read: the original one when torch's
    pipeline stage wrapped it (`RuntimeError("\n[Stage 1] failed to run forward: args ...")
    from e`, whose first line is empty), with the stage it came from."""
    text = str(exc).strip()
    cause = exc.__cause__
    if isinstance(exc, RuntimeError) and cause is not None and "] failed to run " in text:
        stage = text.splitlines()[0].rstrip(":").strip()
        return f"{type(cause).__name__}: {cause} ({stage})"
    return f"{type(exc).__name__}: {exc}"


def _is_comm_error(exc: BaseException) -> bool:
    if isinstance(exc, (Terminated, KeyboardInterrupt)):  # stopped from outside, not by itself
        return True
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return isinstance(exc, RuntimeError) and any(h in text for h in _COMM_HINTS)


def _key_prefix() -> str:
    """Unique per job attempt: torchrun's run id and restart count, else the store's port."""
    run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "")
    return f"slapo/watch/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


class PeerWatch:
    """Heartbeats and exit records of every rank, kept in the job's TCP store.

    A daemon thread adds 1 to this rank's counter every `HEARTBEAT_S` and watches its peers':
    one that neither advances nor records an exit for `hang_s` stops this rank (`on_hang`).
    The same thread stops this rank when the launcher is gone (`on_launcher_lost`): its parent
    is no longer the torchrun agent that started it, or the job's store (which the agent keeps)
    fails to answer. `diagnose` names the ranks that died or failed, for the message of a rank
    that stopped on a communication error."""

    def __init__(self, store: Any, rank: int, world: int, hang_s: float = HANG_S):
        self.store, self.rank, self.world, self.hang_s = store, rank, world, hang_s
        self.prefix = _key_prefix()
        self.parent = launcher_pid()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.finishing = False  # set by finish_watch: SIGTERM no longer interrupts
        now = time.monotonic()
        self._seen = {r: (-1, now) for r in self.peers}  # counter, when it last changed
        self._thread = threading.Thread(target=self._loop, name="slapo-peer-watch", daemon=True)

    @classmethod
    def start(cls, rank: int, world: int, hang_s: float = HANG_S) -> PeerWatch | None:
        """Connect a store client of its own and start the thread; None when the job has no
        reachable store (then nothing changes: the collective timeout is the bound)."""
        import torch.distributed as dist

        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world < 2 or not host or not port:
            return None
        try:
            store = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=timedelta(seconds=10), wait_for_workers=False)
        except Exception:  # noqa: BLE001 - no watch is no worse than before
            return None
        watch = cls(store, rank, world, hang_s)
        watch._beat()
        watch._thread.start()
        return watch

    @property
    def peers(self) -> list[int]:
        return [r for r in range(self.world) if r != self.rank]

    # -- store access (one lock: the client is shared by the thread and the main thread)
    def _key(self, what: str, rank: int) -> str:
        return f"{self.prefix}/{what}/{rank}"

    def _beat(self) -> None:
        with self._lock:
            self.store.add(self._key("beat", self.rank), 1)

    def counter(self, rank: int) -> int:
        with self._lock:
            return int(self.store.add(self._key("beat", rank), 0))

    def exit_record(self, rank: int) -> str | None:
        key = self._key("exit", rank)
        with self._lock:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode(errors="replace")

    def record_exit(self, state: str) -> None:
        """`done`, or `error <comm|own>: Type: message`; written before the heartbeats stop."""
        with contextlib.suppress(Exception), self._lock:
            self.store.set(self._key("exit", self.rank), state[:2000])

    # -- the thread
    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            lost = self.launcher_gone()  # before touching a store that may have died with it
            if lost is None:
                try:
                    self._beat()
                    silent = self._silent_peers(time.monotonic())
                except Exception as e:  # noqa: BLE001 - any store failure: its keeper is gone
                    lost = ("the job's store (kept by the launcher at "
                            f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}) "
                            f"stopped answering ({str(e).strip().splitlines()[0][:160]})")
            if self._stop.is_set():
                return  # the run has ended: whatever happens to the launcher now is not ours
            if lost is not None:
                self.on_launcher_lost(lost)
                return
            hung = [r for r, s in silent if s >= self.hang_s]
            if hung:
                self.on_hang(hung)

    def launcher_gone(self) -> str | None:
        """Why the launcher is known to be gone (`launcher_gone`), checked before each store
        call: the agent is seen exiting before its sockets close, so the store is not asked in
        vain (a failed store call prints a C++ stack trace)."""
        return launcher_gone(self.parent)

    def on_launcher_lost(self, why: str) -> None:
        """The launcher is gone: end this process now (`launcher_lost`)."""
        launcher_lost(why)

    def _silent_peers(self, now: float) -> list[tuple[int, float]]:
        """(peer, seconds since its counter last moved) for peers with no exit record."""
        out = []
        for r in self.peers:
            c = self.counter(r)
            last_c, since = self._seen[r]
            if c != last_c:
                self._seen[r] = (c, now)
            elif self.exit_record(r) is None:
                out.append((r, now - since))
        return out

    def on_hang(self, ranks: list[int]) -> None:
        """A peer is gone and this rank is still waiting (NCCL, or outside a collective): say
        who and stop the process now, instead of after the collective timeout."""
        who = ", ".join(str(r) for r in ranks)
        print(f"slapo train: error: rank {self.rank} stopped: rank(s) {who} sent no heartbeat "
              f"for {self.hang_s:.0f} s and recorded no exit (killed, out of memory, or its "
              "machine was lost). Fix: the job stops as a whole; rerun the same command with "
              "--resume to continue from the newest intact checkpoint.", file=sys.stderr,
              flush=True)
        self.record_exit(f"error comm: peer rank(s) {who} silent")
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * HEARTBEAT_S + 1)

    # -- the message of a rank that stopped on a communication error
    def diagnose(self, wait_s: float = DIAGNOSE_S) -> list[tuple[int, str]]:
        """(rank, what happened to it) for every peer that died or failed on its own.

        Polls until each peer has recorded an exit or has been silent for `SILENT_S` (a
        SIGKILLed rank records nothing and stops heartbeating), at most `wait_s` seconds."""
        start = time.monotonic()
        counts = {r: (self.counter(r), start) for r in self.peers}
        while True:
            found, pending = self._verdicts(counts, time.monotonic())
            if not pending or time.monotonic() - start >= wait_s:
                return found
            time.sleep(HEARTBEAT_S / 2)

    def _verdicts(self, counts: dict, now: float) -> tuple[list[tuple[int, str]], list[int]]:
        found, pending = [], []
        for r in self.peers:
            record = self.exit_record(r)
            if record is not None:
                if record.startswith("error own: "):
                    found.append((r, f"rank {r} failed: {record[len('error own: '):]}"))
                continue
            c = self.counter(r)
            if c != counts[r][0]:
                counts[r] = (c, now)
            if now - counts[r][1] >= SILENT_S:
                found.append((r, f"rank {r} died (no heartbeat for {now - counts[r][1]:.1f} s "
                                 "and no exit recorded: killed, e.g. SIGKILL, out of memory, or "
                                 "its machine was lost)"))
            else:
                pending.append(r)
        return found, pending


# ---- a lost launcher ---------------------------------------------------------------------------
_LAUNCHER: dict[str, Any] = {"pid": None, "thread": None}


def launcher_pid() -> int | None:
    """The pid of torchrun's agent, this process's parent, as first seen (None without
    torchrun). Recorded once, so a later re-parenting shows."""
    if _LAUNCHER["pid"] is None and launched_by_torchrun():
        _LAUNCHER["pid"] = os.getppid()
    return _LAUNCHER["pid"]


def launcher_gone(pid: int | None) -> str | None:
    """Why the launcher `pid` is known to be gone, or None: this process was re-parented (the
    agent is dead: under torchrun a worker is its own session, so no signal reaches it), the
    agent has begun to exit, or it was gone before this process looked (parent pid 1)."""
    if pid is None:
        return None
    if pid == 1:
        return "its launcher (torchrun's agent) was gone before it started (killed)"
    if os.getppid() != pid or _exiting(pid):
        return f"its launcher (torchrun's agent, pid {pid}) is gone (killed, or its node was lost)"
    return None


def launcher_lost(why: str) -> None:
    """The launcher is gone: nothing will stop this job's workers, and they would go on training
    and writing checkpoints (racing a `--resume` started meanwhile), or wait at start-up for a
    store that is gone. Say so once per node and end the process now (the main thread may be
    inside a collective or a store call, which no exception would interrupt)."""
    if os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")) == "0":
        hint = stop_hint()
        print(f"slapo train: error: stopped: {why}; every worker of the job stops with it; "
              + (hint or "rerun the command with --resume to continue from the newest intact "
                 "checkpoint."), file=sys.stderr, flush=True)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    os._exit(1)


def watch_launcher() -> None:
    """Under torchrun, a daemon thread that ends this process when the agent that started it is
    gone (`launcher_lost`), from the start of the command: before the process group exists a
    worker whose agent died waits on the dead store until its timeout, and the `PeerWatch`
    (which also notices a store that stops answering) starts only after it. Idempotent."""
    pid = launcher_pid()
    if pid is None or _LAUNCHER["thread"] is not None:
        return

    def loop() -> None:
        while (why := launcher_gone(pid)) is None:
            time.sleep(HEARTBEAT_S)
        launcher_lost(why)

    _LAUNCHER["thread"] = threading.Thread(target=loop, name="slapo-launcher-watch",
                                           daemon=True)
    _LAUNCHER["thread"].start()


_PF_EXITING = 0x4  # Linux task flag: the process has begun to exit (include/linux/sched.h)


def _exiting(pid: int) -> bool:
    """Has process `pid` begun to exit (Linux; False where /proc cannot tell)? Its flags
    field (the 9th of /proc/PID/stat) has PF_EXITING from the start of the kernel's exit, before
    its files (the store's sockets) are closed; a zombie is exiting too."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return False
    return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)


# ---- the two ends of a run ---------------------------------------------------------------------
def start_watch(rank: int, world: int) -> PeerWatch | None:
    """Start heartbeating (and stop on a silent peer or a lost launcher); trap SIGTERM and
    SIGINT so a rank the launcher stops unwinds through `finish_watch` and says why."""
    watch_launcher()
    watch = PeerWatch.start(rank, world)
    if watch is not None:
        trap_for_run()
    return watch


def finish_watch(watch: PeerWatch | None, exc: BaseException | None) -> None:
    """Record how this rank ends; if it stopped on a communication error, raise a `PeerFailure`
    naming the ranks that died or failed (chained to the original error). A rank stopped by a
    signal records `stopped by SIG...` (its peers do not name it); after Ctrl-C nobody is."""
    if watch is None:
        return
    watch.finishing = True  # a stop signal from now on must not cut the diagnosis short
    with finishing():
        culprits = _record_and_diagnose(watch, exc)
    watch.stop()
    if culprits:
        raise PeerFailure(
            f"rank {watch.rank} stopped: " + "; ".join(m for _, m in culprits)
            + f". (This rank saw: {type(exc).__name__}: {str(exc)[:300]}) Fix: the job stops "
            "as a whole; rerun the same command with --resume to continue from the newest "
            "intact checkpoint.") from exc


def _record_and_diagnose(watch: PeerWatch, exc: BaseException | None) -> list[tuple[int, str]]:
    comm = is_comm_failure(exc)
    stop = stopped_by(exc) if exc is not None else None
    if stop is not None:  # not this rank's failure: peers must not blame it
        watch.record_exit(f"stopped by {signal.Signals(stop).name}")
    elif exc is None:
        watch.record_exit("done")
    else:
        kind = "comm" if comm else "own"
        watch.record_exit(f"error {kind}: {describe(exc)}")
    if not comm or stop == signal.SIGINT:  # Ctrl-C stops every rank: nobody to name
        return []
    with contextlib.suppress(Exception):  # the store may be gone with the job
        return watch.diagnose()
    return []
