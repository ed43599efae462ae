"""A persistent pool of real gloo ranks for distributed tests.

Spawning ranks costs ~10-30 s here (each imports torch and transformers), so a test session
starts one pool per world size and sends it many jobs. A job is a picklable top-level function;
every rank runs it and its return value comes back per rank. A job that raises on any rank, or
exceeds its timeout (a hung collective), fails the test and the pool is restarted so later tests
start clean.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

GLOO_TIMEOUT_S = 60
# Threads per rank above which the pool is restarted after a job. Every gloo group a job makes
# (each `init_mesh`) starts threads that live as long as the group object, and groups that
# meshes, FSDP2 or DeviceMesh's caches still reference are never freed: a rank of a session's
# pool reached 1,478 threads, and the suite's load average 163 on 2 cores (21 min instead of
# 9). A restart costs a few seconds.
THREAD_LIMIT = 300


def _threads() -> int:
    """This process's threads (Python's and C++'s: gloo's are invisible to `threading`)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, inq, outq) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,
                          timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=GLOO_TIMEOUT_S))
    outq.put((rank, True, "ready", _threads()))
    while True:
        job = inq.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            result = fn(*args, **kwargs)
            outq.put((rank, True, result, _threads()))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            outq.put((rank, False, traceback.format_exc(), 0))
    dist.destroy_process_group()


class DistError(AssertionError):
    pass


class DistPool:
    def __init__(self, world_size: int, start_timeout: float = 180):
        self.world_size = world_size
        self.start_timeout = start_timeout
        self._procs: list = []
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = mp.get_context("spawn")
        # The parent serves the ranks' rendezvous store on a port the OS picks and it keeps
        # bound: a port chosen free and released before the ranks (10-30 s of imports later)
        # bind it was taken in CI by another process's connection (EADDRINUSE at a restart).
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=GLOO_TIMEOUT_S))
        port = self._store.port
        self._inq = [ctx.Queue() for _ in range(self.world_size)]
        self._outq = ctx.Queue()
        self._threads = 0
        self._procs = [ctx.Process(target=_worker, args=(r, self.world_size, port, self._inq[r],
                                                         self._outq), daemon=True)
                       for r in range(self.world_size)]
        t0 = time.monotonic()
        for p in self._procs:
            p.start()
        self._collect(self.start_timeout, "start")
        if os.environ.get("SLAPO_POOL_LOG"):  # where a test session's time goes (tuning aid)
            with open(os.environ["SLAPO_POOL_LOG"], "a") as f:
                f.write(f"{os.getpid()} start world={self.world_size} threads={self._threads} "
                        f"{time.monotonic() - t0:.1f}s\n")

    def _collect(self, timeout: float, what: str) -> list:
        results: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        first_failure = None
        while len(results) < self.world_size:
            remaining = deadline - time.monotonic()
            if first_failure is not None:  # peers of a failed rank usually hang: short grace
                remaining = min(remaining, first_failure + 5 - time.monotonic())
            try:
                rank, ok, payload, threads = self._outq.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            results[rank] = (ok, payload)
            self._threads = max(self._threads, threads)
            if not ok and first_failure is None:
                first_failure = time.monotonic()
        failed = {r: p for r, (ok, p) in results.items() if not ok}
        if failed or len(results) < self.world_size:
            self.restart()
            msg = [f"distributed job {what!r} failed on {self.world_size} ranks"]
            for r, tb in sorted(failed.items()):
                msg.append(f"--- rank {r} ---\n{tb}")
            missing = sorted(set(range(self.world_size)) - set(results))
            if missing:
                msg.append(f"ranks {missing} gave no result within the timeout "
                           f"({timeout:.0f} s; hung collective?)")
            raise DistError("\n".join(msg))
        return [results[r][1] for r in range(self.world_size)]

    def run(self, fn, *args, timeout: float = 240, **kwargs) -> list:
        """Run `fn(*args, **kwargs)` on every rank; return the per-rank results."""
        for q in self._inq:
            q.put((fn, args, kwargs))
        results = self._collect(timeout, getattr(fn, "__name__", str(fn)))
        if self._threads > THREAD_LIMIT:  # leaked gloo groups: start clean (see THREAD_LIMIT)
            self.restarts += 1
            self.restart()
        return results

    def close(self) -> None:
        for q in getattr(self, "_inq", []):
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
        self._store = None

    def restart(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        self._procs = []
        self._start()
