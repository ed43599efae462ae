"""The peak-memory meter of a training run: the one definition `slapo train`, tune trials and the
progressive demo report.

CUDA: `torch.cuda.max_memory_allocated` (what torch's allocator handed out; the number a memory
cap is compared with). CPU: the process's peak resident set (`VmHWM`), which `/proc/self/
clear_refs` restarts from the current RSS, so the memory of a parent process or an earlier
phase (model build, an earlier trial in a forkserver) is not counted.
"""

from __future__ import annotations

import resource

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak(device: torch.device | str = "cpu") -> bool:
    """Start peak accounting now; False where the platform cannot (the peak then counts from
    the process start)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:  # Linux >= 4.0: writing 5 restarts VmHWM from the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_bytes(device: torch.device | str = "cpu") -> int:
    """Peak memory since `reset_peak` (see the module docstring for what each device counts)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def peak_kind(device: torch.device | str = "cpu") -> str:
    """What `peak_bytes` measures on `device`, for reports."""
    return "cuda max_memory_allocated" if torch.device(device).type == "cuda" \
        else "process peak RSS (VmHWM)"


def rss_bytes() -> int:
    """Current resident set of this process (0 where /proc is missing)."""
    return (_status_kib("VmRSS") or 0) * 1024
