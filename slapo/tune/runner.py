"""Measured evaluation: every trial in its own process, with a timeout and a memory cap.

A trial that crashes, hangs, segfaults or runs out of memory must not take the tuner down with it,
and must not leave a poisoned CUDA context or allocator behind for the next trial. So each trial
runs in a fresh process (`multiprocessing` spawn for a Python callable, `subprocess` for a
command line) and the parent only reads back a small metrics dict.

Trials fork from a forkserver that has imported this module once (and with it slapo and torch),
so a trial starts in tens of milliseconds, without inheriting the tuner's CUDA or allocator state.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import resource
import shlex
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .space import Config

METRICS_PREFIX = "SLAPO_METRICS "
_OOM_MARKERS = ("out of memory", "memoryerror", "outofmemoryerror", "cannot allocate memory")


@dataclass
class TrialResult:
    """What one trial produced. `status` is one of ok / failed / oom / timeout."""

    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    elapsed_s: float = 0.0


def _looks_like_oom(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in _OOM_MARKERS)


def _cap_memory(mem_cap_bytes: int | None) -> None:
    """Limit the address space of the current (child) process; allocations beyond it fail."""
    if mem_cap_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (int(mem_cap_bytes), int(mem_cap_bytes)))


def _check_peak(result: TrialResult, peak_key: str, mem_cap_bytes: int | None) -> TrialResult:
    """A trial that reports a peak above the cap counts as OOM even if it survived.

    On CPU RLIMIT_AS is coarse (it caps virtual memory, not the device), so a trial may instead
    report its own measured peak, e.g. `torch.cuda.max_memory_allocated()`.
    """
    peak = result.metrics.get(peak_key)
    if result.status == "ok" and mem_cap_bytes and peak is not None and peak > mem_cap_bytes:
        return TrialResult("oom", result.metrics, f"{peak_key}={peak} > cap {mem_cap_bytes}",
                           result.elapsed_s)
    return result


def _child(fn: Callable[[Config], dict], config: Config, mem_cap: int | None, conn: Any) -> None:
    try:
        os.setsid()  # own process group: a timeout kills the trial's children too
        conn.send(("started",))
        _cap_memory(mem_cap)
        metrics = fn(config)
        if not isinstance(metrics, dict):
            raise TypeError(f"trial function returned {type(metrics).__name__}, expected a dict")
        conn.send(("ok", metrics, ""))
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        tb = traceback.format_exc(limit=20)
        status = "oom" if isinstance(e, MemoryError) or _looks_like_oom(f"{type(e).__name__} {e}") else "failed"
        try:
            conn.send((status, {}, tb))
        except Exception:  # noqa: BLE001
            pass
    finally:
        conn.close()


class CallableEvaluator:
    """Run `fn(config) -> metrics` in a fresh process per trial (forkserver or spawn).

    `fn` must be importable by the child (a module-level function). The trial's clock starts
    when the child has booted (`startup_timeout_s` bounds the boot itself, which on a loaded
    machine can take seconds); a trial running past `timeout_s` is killed with everything it
    started. `mem_cap_bytes` is applied with RLIMIT_AS in the child (it caps the whole address
    space, which already includes a few GB of mappings once torch is imported), and a reported
    `metrics[peak_key]` above it also marks the trial `oom`. `preload` names more modules
    for the forkserver to import once (e.g. the trial function's module with its model code),
    so each trial skips those imports too; it only has an effect before the server has started.
    """

    def __init__(
        self,
        fn: Callable[[Config], dict],
        timeout_s: float,
        mem_cap_bytes: int | None = None,
        peak_key: str = "peak_memory_bytes",
        startup_timeout_s: float = 120.0,
        start_method: str | None = None,
        preload: Sequence[str] = (),
    ):
        if not callable(fn):
            raise ValueError(f"fn must be callable, got {fn!r}.")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.fn, self.timeout_s, self.mem_cap_bytes, self.peak_key = fn, timeout_s, mem_cap_bytes, peak_key
        self.startup_timeout_s = startup_timeout_s
        # forkserver: each trial is forked from a small clean server (no torch, no CUDA state),
        # so it is isolated like spawn but skips the interpreter start-up per trial.
        if start_method is None:
            start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
        if start_method == "fork":
            raise ValueError("start_method='fork' would inherit the tuner's CUDA/allocator state. "
                             "Fix: use 'forkserver' or 'spawn'.")
        self.start_method = start_method
        if start_method == "forkserver":
            # The server imports this module (hence slapo and torch) once; trials fork from it
            # instead of re-importing torch. No effect if the server is already running.
            mp.get_context("forkserver").set_forkserver_preload([__name__, *preload])

    def __call__(self, config: Config) -> TrialResult:
        ctx = mp.get_context(self.start_method)
        parent, child = ctx.Pipe(duplex=False)
        # not a daemon: trials may start their own workers (data loaders, ranks)
        proc = ctx.Process(target=_child, args=(self.fn, config, self.mem_cap_bytes, child))
        proc.start()
        child.close()
        t0 = time.perf_counter()
        try:
            msg = self._recv(parent, self.startup_timeout_s)
            t0 = time.perf_counter()
            if msg == ("started",):
                msg = self._recv(parent, self.timeout_s)
                limit = f"no result after {self.timeout_s:.1f} s"
            else:
                limit = f"trial process did not start within {self.startup_timeout_s:.0f} s"
        except BaseException:  # Ctrl-C in the tuner: the trial (own session) would outlive it
            self._kill(proc)
            parent.close()
            raise
        elapsed = time.perf_counter() - t0
        parent.close()
        if msg == "timeout":
            self._kill(proc)
            return TrialResult("timeout", {}, limit, elapsed)
        proc.join(timeout=10)
        if proc.is_alive():
            self._kill(proc)
        if msg is None or msg == ("started",):
            code = proc.exitcode
            why = f"child exited with code {code}"
            if code is not None and code < 0:
                why += f" ({signal.Signals(-code).name})"
            # SIGKILL without a message is what the kernel OOM killer does.
            status = "oom" if code == -signal.SIGKILL else "failed"
            return TrialResult(status, {}, why, elapsed)
        status, metrics, err = msg
        return _check_peak(TrialResult(status, metrics, err, elapsed), self.peak_key, self.mem_cap_bytes)

    @staticmethod
    def _recv(conn: Any, timeout: float) -> Any:
        """The next message, None if the child died, or "timeout"."""
        if not conn.poll(timeout):
            return "timeout"
        try:
            return conn.recv()
        except EOFError:
            return None

    @staticmethod
    def _kill(proc: Any) -> None:
        """Kill the trial and everything it started (its own process group, see `_child`)."""
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.join()


class CommandEvaluator:
    """Run a command line per trial; `{name}` placeholders are filled from the config.

    `{metrics_file}` is replaced by a temporary JSON path the command may write its metrics to;
    otherwise the last stdout line starting with `SLAPO_METRICS ` is parsed as JSON. Every
    config value is also exported as `SLAPO_TUNE_<NAME>` (Slapo's original tuner passed knobs
    through the environment). The command runs in its own session so a timeout kills its whole
    process tree (e.g. torchrun and its ranks).
    """

    def __init__(
        self,
        command: str | Sequence[str],
        timeout_s: float,
        mem_cap_bytes: int | None = None,
        peak_key: str = "peak_memory_bytes",
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ):
        self.argv = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.argv:
            raise ValueError("command is empty. Fix: pass e.g. ['python', 'train.py', '--bs', '{batch_size}'].")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}.")
        self.timeout_s, self.mem_cap_bytes, self.peak_key = timeout_s, mem_cap_bytes, peak_key
        self.env, self.cwd = env, cwd

    def _format(self, config: Config, metrics_file: str) -> list[str]:
        fields = {**{k: v for k, v in config.items()}, "metrics_file": metrics_file}
        try:
            return [a.format(**fields) for a in self.argv]
        except KeyError as e:
            raise ValueError(
                f"command placeholder {e} is not a symbol of config {config!r}. "
                "Fix: use only declared symbol names (or {metrics_file}) in the command."
            ) from None

    def __call__(self, config: Config) -> TrialResult:
        with tempfile.TemporaryDirectory(prefix="slapo-trial-") as tmp:
            mfile = os.path.join(tmp, "metrics.json")
            argv = self._format(config, mfile)
            env = {**os.environ, **(self.env or {})}
            env.update({f"SLAPO_TUNE_{k.upper()}": json.dumps(v) if not isinstance(v, str) else v
                        for k, v in config.items()})
            cap = self.mem_cap_bytes
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=self.cwd,
                start_new_session=True, text=True, preexec_fn=(lambda: _cap_memory(cap)) if cap else None,
            )
            try:
                out, err = proc.communicate(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
                return TrialResult("timeout", {}, f"killed after {self.timeout_s:.1f} s",
                                   time.perf_counter() - t0)
            elapsed = time.perf_counter() - t0
            if proc.returncode != 0:
                tail = (err or "")[-2000:]
                status = "oom" if _looks_like_oom(tail) or proc.returncode == -signal.SIGKILL else "failed"
                return TrialResult(status, {}, f"exit code {proc.returncode}: {tail}", elapsed)
            metrics = self._read_metrics(mfile, out or "")
            if metrics is None:
                return TrialResult("failed", {}, "command succeeded but reported no metrics "
                                   f"(write JSON to {{metrics_file}} or print '{METRICS_PREFIX}{{...}}')",
                                   elapsed)
            return _check_peak(TrialResult("ok", metrics, "", elapsed), self.peak_key, cap)

    @staticmethod
    def _read_metrics(mfile: str, stdout: str) -> dict | None:
        if os.path.exists(mfile):
            with open(mfile) as f:
                return json.load(f)
        for line in reversed(stdout.splitlines()):
            if line.startswith(METRICS_PREFIX):
                return json.loads(line[len(METRICS_PREFIX):])
        return None


class InProcessEvaluator:
    """Call `fn(config)` in this process (for cheap, trusted objectives such as predictions).

    Exceptions become failed trials; a MemoryError or an "out of memory" message becomes `oom`.
    """

    def __init__(self, fn: Callable[[Config], dict], mem_cap_bytes: int | None = None,
                 peak_key: str = "peak_memory_bytes"):
        self.fn, self.mem_cap_bytes, self.peak_key = fn, mem_cap_bytes, peak_key

    def __call__(self, config: Config) -> TrialResult:
        t0 = time.perf_counter()
        try:
            metrics = self.fn(config)
        except Exception as e:  # noqa: BLE001 - a failing trial is data, not a tuner error
            status = "oom" if isinstance(e, MemoryError) or _looks_like_oom(f"{type(e).__name__} {e}") else "failed"
            return TrialResult(status, {}, f"{type(e).__name__}: {e}", time.perf_counter() - t0)
        if isinstance(metrics, TrialResult):
            return metrics
        if not isinstance(metrics, dict):
            return TrialResult("failed", {}, f"trial returned {type(metrics).__name__}, not a dict",
                               time.perf_counter() - t0)
        res = TrialResult("ok", dict(metrics), "", time.perf_counter() - t0)
        return _check_peak(res, self.peak_key, self.mem_cap_bytes)
