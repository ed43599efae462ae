"""Time model: roofline compute + alpha-beta collectives, with measured constants.

Mist profiles every op on the target GPU; on a CPU-only CI we cannot, and for *ranking* configs a
roofline (matmul FLOPs at peak, everything else at memory bandwidth) is enough. The constants are
measured by `calibrate` (one GEMM, one large copy) and cached per device, and collective
costs come from a least-squares fit of `t = alpha + beta * bytes * f(op, n)` to a sweep.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# Bytes each rank sends per byte of payload in a ring algorithm with n ranks.
_RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}


@dataclass
class AlphaBeta:
    """Latency `alpha` (s) and inverse bandwidth `beta` (s/byte) of one link class."""

    alpha: float
    beta: float


@dataclass
class DeviceConstants:
    """What the time and memory models need to know about one accelerator and its links."""

    name: str
    peak_flops: float  # achievable dense matmul FLOP/s in the training dtype
    mem_bandwidth: float  # bytes/s
    memory_bytes: float = 0.0
    intra: AlphaBeta = field(default_factory=lambda: AlphaBeta(5e-6, 1 / 300e9))
    inter: AlphaBeta = field(default_factory=lambda: AlphaBeta(2e-5, 1 / 25e9))
    gpus_per_node: int = 8
    kernel_launch_s: float = 0.0  # per launched kernel (launch + dispatch); 0: not modelled
    fp8_peak_flops: float = 0.0  # dense FP8 matmul FLOP/s (torch._scaled_mm); 0: no FP8
    host_bandwidth: float = 0.0  # bytes/s per direction, pinned host <-> device (activation
    # offload's copies; PCIe Gen5 x16: ~50e9); 0: not modelled, offload cannot be timed

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> DeviceConstants:
        d = dict(d)
        d["intra"], d["inter"] = AlphaBeta(**d["intra"]), AlphaBeta(**d["inter"])
        return cls(**d)


def roofline_time(flops: Any, bytes_moved: Any, device: DeviceConstants,
                  fp8_flops: Any = 0) -> Any:
    """Seconds for `flops` of matmul (at `device.peak_flops`) plus `fp8_flops` of FP8 matmul
    (at `device.fp8_peak_flops`) plus `bytes_moved` of memory-bound work.

    Additive rather than max(): a transformer block alternates GEMMs and elementwise kernels that
    run one after the other, not overlapped.
    """
    fp8 = np.asarray(fp8_flops, dtype=float)
    if np.any(fp8 > 0) and not device.fp8_peak_flops > 0:
        raise ValueError(f"device {device.name!r} has no FP8 matmul peak (fp8_peak_flops=0): "
                         "it cannot time FP8 GEMMs. Fix: set DeviceConstants(fp8_peak_flops=...) "
                         "for a GPU with FP8 tensor cores, or search bf16.")
    fp8_s = fp8 / device.fp8_peak_flops if device.fp8_peak_flops > 0 else 0.0
    return (np.asarray(flops) / device.peak_flops + fp8_s
            + np.asarray(bytes_moved) / device.mem_bandwidth)


def _factor(op: str, n: Any) -> Any:
    if op not in _RING_FACTOR:
        raise ValueError(f"collective {op!r} unknown; use one of {sorted(_RING_FACTOR)}.")
    n = np.asarray(n, dtype=float)
    return np.where(n > 1, _RING_FACTOR[op](np.maximum(n, 2)), 0.0)


def collective_time(op: str, nbytes: Any, n: Any, ab: AlphaBeta) -> Any:
    """Alpha-beta time of a ring collective over `n` ranks (0 when n == 1)."""
    n_arr = np.asarray(n)
    return np.where(n_arr > 1, ab.alpha + ab.beta * np.asarray(nbytes) * _factor(op, n_arr), 0.0)


def fit_alpha_beta(samples: list[tuple[str, float, int, float]]) -> AlphaBeta:
    """Least-squares (alpha, beta) ≥ 0 from `(op, nbytes, n, seconds)` samples.

    Rows are weighted by 1/seconds so that small (latency-bound) and large (bandwidth-bound)
    messages count equally: a plain fit would ignore alpha entirely.
    """
    from scipy.optimize import lsq_linear

    rows = [(op, b, n, t) for op, b, n, t in samples if n > 1]
    if len(rows) < 2:
        raise ValueError("need at least two samples with n > 1 to fit alpha and beta.")
    t = np.array([r[3] for r in rows], dtype=float)
    if np.any(t <= 0):
        raise ValueError("sample times must be positive.")
    A = np.array([[1.0, r[1] * float(_factor(r[0], r[2]))] for r in rows])
    w = 1.0 / t
    sol = lsq_linear(A * w[:, None], t * w, bounds=(0, np.inf))
    return AlphaBeta(alpha=float(sol.x[0]), beta=float(sol.x[1]))


def collective_sweep(sizes: list[int], ops: tuple[str, ...] = ("all_reduce",), group: Any = None,
                     iters: int = 5, warmup: int = 2) -> list[tuple[str, float, int, float]]:
    """Time collectives of the given payload sizes (bytes) on an initialised process group.

    Returns samples for `fit_alpha_beta`. Run it on every rank (it is collective); use
    float32 payloads on the group's device.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("collective_sweep needs torch.distributed initialised. Fix: call "
                           "dist.init_process_group(...) first (e.g. under torchrun).")
    n = dist.get_world_size(group)
    backend = dist.get_backend(group)
    from ..runtime.mesh import backend_device_type, local_device

    dev = local_device(backend_device_type(backend))
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = []
    for op in ops:
        for size in sizes:
            numel = max(size // 4, n)
            numel -= numel % n
            x = torch.ones(numel, dtype=torch.float32, device=dev)
            shard = torch.empty(numel // n, dtype=torch.float32, device=dev)

            def run(op: str = op, x: Any = x, shard: Any = shard) -> None:
                if op == "all_reduce":
                    dist.all_reduce(x, group=group)
                elif op == "all_gather":
                    dist.all_gather_into_tensor(x, shard, group=group)
                elif op == "reduce_scatter":
                    dist.reduce_scatter_tensor(shard, x, group=group)
                elif op == "broadcast":
                    dist.broadcast(x, src=0, group=group)
                else:
                    raise ValueError(f"collective_sweep cannot time {op!r}.")

            for _ in range(warmup):
                run()
            sync()
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            sync()
            out.append((op, float(numel * 4), n, (time.perf_counter() - t0) / iters))
    return out


def _device_name(device: Any) -> str:
    import platform

    import torch

    from ..runtime.mesh import local_device

    dev = torch.device(device) if device is not None else local_device()
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"cpu:{platform.processor() or platform.machine()}:{torch.get_num_threads()}t"


class CalibrationCacheError(ValueError):
    """A calibration cache that cannot be read as it is (named, with the reason)."""


def load_cache(path: str | os.PathLike) -> dict[str, Any]:
    """The entries of a calibration cache ({} when the file does not exist), each checked to
    rebuild a `DeviceConstants`. A damaged or hand-edited file raises `CalibrationCacheError`
    naming it (it is JSON, so reading it runs nothing) and is left as it is: `calibrate` would
    otherwise overwrite it, dropping the other devices' entries."""
    path = Path(path)
    if not path.exists():
        return {}
    fix = "delete the file (it is re-measured), or pass another --calibration."
    try:
        cache = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrationCacheError(f"calibration cache {path}: not readable JSON ({e}). "
                                    f"Fix: {fix}") from None
    if not isinstance(cache, dict):
        raise CalibrationCacheError(f"calibration cache {path}: expected a JSON object of "
                                    f"devices, got {type(cache).__name__}. Fix: {fix}")
    for key, entry in cache.items():
        try:
            DeviceConstants.from_json(entry)
        except (TypeError, ValueError, KeyError) as e:
            raise CalibrationCacheError(f"calibration cache {path}: entry {key!r} is not a "
                                        f"device record ({e}). Fix: {fix}") from None
    return cache


def calibrate(device: Any = None, dtype: Any = None, cache_path: str | os.PathLike | None = None,
              gemm_n: int | None = None, copy_mib: int | None = None, refresh: bool = False) -> DeviceConstants:
    """Measure peak matmul FLOP/s and copy bandwidth on `device`; cache them to JSON.

    One square GEMM (best of a few runs) and one large device-to-device copy (read + write
    bytes). The cache key is the device name and dtype, so a cluster with mixed GPUs keeps one
    entry per kind. Links are not measured here (see `collective_sweep`).
    """
    import torch

    from ..runtime.mesh import local_device

    dev = torch.device(device) if device is not None else local_device()
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    key = f"{_device_name(dev)}|{dtype}"
    path = Path(cache_path) if cache_path else None
    cache = load_cache(path) if path is not None else {}
    if key in cache and not refresh:
        return DeviceConstants.from_json(cache[key])
    cuda = dev.type == "cuda"
    n = gemm_n or (8192 if cuda else 512)
    mib = copy_mib or (1024 if cuda else 64)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def best_of(fn: Any, reps: int = 5) -> float:
        fn()
        sync()
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t_mm = best_of(lambda: torch.mm(a, b))
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)
    t_cp = best_of(lambda: dst.copy_(src))
    mem = torch.cuda.get_device_properties(dev).total_memory if cuda else 0
    dc = DeviceConstants(name=key, peak_flops=2 * n**3 / t_mm, mem_bandwidth=2 * src.nbytes / t_cp,
                         memory_bytes=float(mem))
    if path is not None:
        cache[key] = dc.to_json()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1, sort_keys=True))
    return dc
