"""Slapo: a schedule language for progressive optimization of deep-learning model training.

The model definition stays untouched; a schedule (`create_schedule`) describes how it runs.
"""

# Sub-packages, importable as attributes (`slapo.op.SDPAttention`, `slapo.model_schedule.apply`).
from . import graph, model_schedule, op, pipeline, profile, progressive, tune  # noqa: E402,I001
from .consolidate import consolidate
from .distributed.rng import get_rng_tracker
from .errors import SchedulingError, SlapoError, TraceError, VerificationError
from .primitives import Primitive, list_primitives
from .runtime import ParallelDims, TrainModule, init_mesh
from .schedule import Schedule, create_schedule
from .verify import Verify

# The edge: Slapo 2023 names (docs/migrating.md), aliases and adapters onto the modern API
# above. `build` and `register_primitive` are the public names of the core's functions with the
# 2023 spellings translated first (slapo.compat.build, slapo.compat.primitives); `install()`
# registers the 2023 primitives and keyword spellings through the core's seams. Nothing in the
# core imports slapo.compat (tests/test_architecture.py).
# `set_random_seed` is the 2023 signature, a superset of today's keyword form.
from . import compat, pattern, random, utils  # noqa: E402,I001
from .compat import (Database, Space, Symbol, build, cleanup, consolidate_model, execute,
                     get_logger, init_empty_weights, init_target_engine, register_primitive,
                     setup, trace)
from .pattern import ModulePattern, Pattern
from .random import checkpoint, get_cuda_rng_tracker, is_random_seed_set, set_random_seed

compat.install()

__version__ = "0.1.0"

__all__ = [
    "Primitive",
    "TrainModule",
    "Verify",
    "build",
    "consolidate",
    "init_empty_weights",
    "init_mesh",
    "ParallelDims",
    "Schedule",
    "SchedulingError",
    "SlapoError",
    "TraceError",
    "VerificationError",
    "__version__",
    "create_schedule",
    "graph",
    "model_schedule",
    "op",
    "pipeline",
    "profile",
    "progressive",
    "tune",
    "get_rng_tracker",
    "list_primitives",
    "register_primitive",
    "set_random_seed",
    # Slapo 2023 compatibility
    "Database",
    "ModulePattern",
    "Pattern",
    "Space",
    "Symbol",
    "checkpoint",
    "cleanup",
    "compat",
    "consolidate_model",
    "execute",
    "get_cuda_rng_tracker",
    "get_logger",
    "init_target_engine",
    "is_random_seed_set",
    "pattern",
    "random",
    "setup",
    "trace",
    "utils",
]
