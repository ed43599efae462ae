"""torch.profiler's categorised memory timeline (TBD's breakdown, built into PyTorch).

Why: `memory_breakdown` counts what is *held* (weights, grads, optimizer state, saved
activations); the profiler's timeline also sees temporaries and autograd internals over time and
gives the category mix at the real peak. It works on CPU and CUDA (it needs `profile_memory`,
`record_shapes` and `with_stack`, so it is slow: use small steps). The export API is deprecated
upstream but still the only categorised one; the deprecation warning is silenced here.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .breakdown import _call, default_loss

# Column order of `export_memory_timeline` JSON rows (column 0 is unused).
CATEGORIES = (
    "parameter",
    "optimizer_state",
    "input",
    "temporary",
    "activation",
    "gradient",
    "autograd_detail",
    "unknown",
)


def memory_timeline(
    model: nn.Module,
    inputs: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    device: str | None = None,
    path: str | Path | None = None,
) -> dict[str, Any]:
    """Profile one training step; return the category bytes at the peak and at the end.

    Result: {"peak_total", "at_peak": {category: bytes}, "final": {...}, "times_us", "rows"}.
    `path` also keeps the raw JSON ([times, rows]) there.
    """
    from torch.profiler import ProfilerActivity, profile

    params = list(model.parameters())
    dev = device or (str(params[0].device) if params else "cpu")
    if dev == "cuda":
        from ..runtime.mesh import local_device

        dev = str(local_device("cuda"))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.startswith("cuda") else [])
    with profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        loss = (loss_fn or default_loss)(_call(model, inputs))
        loss.backward()
        if optimizer is not None:
            optimizer.step()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(path) if path is not None else Path(tmp) / "timeline.json"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(str(out), device=dev)
        times, rows = json.loads(out.read_text())
    totals = [sum(r[1:]) for r in rows]
    peak = max(range(len(totals)), key=totals.__getitem__) if totals else 0

    def named(row: list[int]) -> dict[str, int]:
        return dict(zip(CATEGORIES, row[1:])) if row else {}

    return {
        "device": dev,
        "peak_total": totals[peak] if totals else 0,
        "at_peak": named(rows[peak] if rows else []),
        "final": named(rows[-1] if rows else []),
        "times_us": times,
        "rows": rows,
    }
