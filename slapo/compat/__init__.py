"""Slapo 2023 compatibility layer: the 2023 API surface as aliases and adapters.

A user's Slapo (awslabs/slapo, 2023) code imports names that today's design spells differently
(`get_cuda_rng_tracker` vs `get_rng_tracker`, `model_schedule.apply_schedule(model, "gpt2", ...)`
vs `model_schedule.apply(model, ...)`, `fuse(compiler="TorchScript")` vs a torch.compile
backend). This package maps each 2023 name onto the modern primitive that does the job; it holds
no second implementation. Where a 2023 name hid a bug (see docs/migrating.md), the adapter gives
the correct behaviour and says so in its docstring.

Modules: `env` (setup/cleanup/execute), `logger` (get_logger with `ranks=`), `tune`
(Space/Database with the 2023 methods), `build` (consolidate_model, init_target_engine, trace),
`primitives` (replace_all). Two pieces live below this layer because the core uses them (the
compat layer sits on top and nothing under it imports it): the one-time notices in
`slapo.notices`, and the 2023 keyword spellings of trace/fuse in `slapo.primitives._spellings`
(the primitives accept them). `slapo.pattern`, `slapo.random`, `slapo.utils` and `slapo.op.compat2023` are the
2023 module paths, kept where a 2023 import expects them.
"""

from __future__ import annotations

from ..notices import Slapo2023Notice, notice_once
from . import primitives as _primitives  # noqa: F401  (registers replace_all)
from .build import consolidate_model, generate_pipeline_partition, init_target_engine, trace
from .env import cleanup, execute, setup
from .logger import get_logger
from .tune import Database, Space, Symbol


def _install_pipeline_alias() -> None:
    """`from slapo.pipeline import generate_pipeline_partition` (the 2023 path) resolves to the
    adapter here. slapo/pipeline.py is another concern's file, so the name is attached to the
    module object instead of being defined in it."""
    from .. import pipeline

    if not hasattr(pipeline, "generate_pipeline_partition"):
        pipeline.generate_pipeline_partition = generate_pipeline_partition


_install_pipeline_alias()

__all__ = ["Database", "Slapo2023Notice", "Space", "Symbol", "cleanup", "consolidate_model",
           "execute", "generate_pipeline_partition", "get_logger", "init_target_engine",
           "notice_once", "setup", "trace"]
