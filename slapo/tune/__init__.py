"""Auto-tuning: search spaces, measured trials, search algorithms, a symbolic cost model and a
MILP pipeline planner (after Slapo's tuner and Mist's analyzer).

Submodules are imported lazily so that a spawned trial process (which imports
`slapo.tune.runner`) does not pay for torch, scipy or sympy.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Space": "space",
    "Symbol": "space",
    "config_key": "space",
    "Database": "database",
    "Record": "database",
    "TrialResult": "runner",
    "CallableEvaluator": "runner",
    "CommandEvaluator": "runner",
    "InProcessEvaluator": "runner",
    "SearchResult": "search",
    "exhaustive": "search",
    "coordinate_descent": "search",
    "guided_search": "search",
}

__all__ = sorted(_EXPORTS) + ["cost", "planner"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    if name in ("cost", "planner", "simulate", "memory", "timing", "capture", "op_costs",
                "partition_plan", "model_spaces", "evaluators", "predict_cpu", "predict_gpu", "cli", "driver", "report"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'slapo.tune' has no attribute {name!r}")
