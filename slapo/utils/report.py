"""2023 `slapo.utils.report`: `report_memory`, `profile_perf`, `calc_decoder_tflops`.

`report_memory` reads the process RSS (stdlib `resource`, no psutil) and, on CUDA, the peak
allocated bytes; 2023 reset the peak before reading it, so it printed the current, not the peak
value. For per-module breakdowns use `slapo.profile.memory_breakdown`.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


def _rss_gib() -> float:
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / (1024**3 if sys.platform == "darwin" else 1024**2)


def report_memory(msg: str = "", report_gc: bool = False) -> dict[str, float]:
    """Print and return {"cpu_peak_rss_gib", "gpu_peak_mib"?}. `report_gc` is accepted (2023
    listed every live tensor; use slapo.profile.LiveTensorBytes for that)."""
    out = {"cpu_peak_rss_gib": _rss_gib()}
    line = f"{msg} CPU peak RSS: {out['cpu_peak_rss_gib']:.4f} GiB"
    if torch.cuda.is_available():
        out["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        line += f"; GPU rank {rank} peak: {out['gpu_peak_mib']:.4f} MiB"
    print(line)
    return out


def profile_perf(model: torch.nn.Module, inputs: Sequence[Any],
                 backward: bool = False, loss_fn: Callable | None = None,
                 row_limit: int = 20) -> Any:
    """Run `model(*inputs)` (and backward of `loss_fn(out)`, default the mean of the first
    output) under torch.profiler; print the top ops and return the profiler."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts, record_shapes=True) as prof:
        with record_function("model_fw"):
            out = model(*inputs)
        if backward:
            with record_function("model_bw"):
                (loss_fn(out) if loss_fn else _first(out).float().mean()).backward()
    key = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=row_limit))
    return prof


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) or hasattr(out, "values"):
        return next(v for v in out.values() if isinstance(v, torch.Tensor))
    return next(v for v in out if isinstance(v, torch.Tensor))


def calc_decoder_tflops(sample_sec: float, num_gpus: int, seq_length: int, num_layers: int,
                        hidden_size: int, vocab_size: int, ckpt_all: bool = False) -> float:
    """Model TFLOP/s per GPU of a decoder LM (Megatron's formula, Narayanan et al. 2021):
    F = c * s * L * h^2 * (1 + s / (6h) + V / (16 L h)) per sample, c = 96 when every layer is
    recomputed (one more forward) and 72 otherwise."""
    c = 96 if ckpt_all else 72
    per_sample = c * seq_length * num_layers * hidden_size**2 * (
        1 + seq_length / (6 * hidden_size) + vocab_size / (16 * num_layers * hidden_size))
    return sample_sec * per_sample / num_gpus / 1e12


__all__ = ["calc_decoder_tflops", "profile_perf", "report_memory"]
