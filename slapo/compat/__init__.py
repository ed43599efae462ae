"""Slapo 2023 compatibility layer: the 2023 API surface as aliases and adapters, at the edge.

A user's Slapo (awslabs/slapo, 2023) code imports names that today's design spells differently
(`get_cuda_rng_tracker` vs `get_rng_tracker`, `model_schedule.apply_schedule(model, "gpt2", ...)`
vs `model_schedule.apply(model, ...)`, `fuse(compiler="TorchScript")` vs a torch.compile
backend). This package maps each 2023 name onto the modern primitive that does the job; it holds
no second implementation. Where a 2023 name hid a bug (see docs/migrating.md), the adapter gives
the correct behaviour and says so in its docstring.

Modules: `env` (setup/cleanup/execute), `logger` (get_logger with `ranks=`), `tune`
(Space/Database with the 2023 methods), `build` (`slapo.build` with the 2023 spellings,
consolidate_model, init_target_engine, trace, generate_pipeline_partition), `primitives`
(replace_all, find_node, trace_until, get_module, get_top_schedule; `register_primitive` for
2023 primitive classes), `spellings` (the 2023 keywords of trace/fuse/shard and the
`world_size`/`rank` names of a node, and `metadata.param_tags`/`tie_weights`), `find` (2023's
`find`: trace by need, and a layer decomposed before the trace gets its bias add in the graph),
`pipeline` (`analyze_tie_weights`, DeepSpeed's `analyze_tie_ranks`, and the stages of a traced
model of any structure, cut from its graph).

Nothing here changes a core object when imported. `install()`, which `slapo/__init__` calls
explicitly, registers the 2023 primitives and spellings through the core's public seams
(`register_primitive`, `register_method_adapter`, `register_attribute`); no core module imports
this package (tests/test_architecture.py checks both). The one-time notices live below, in
`slapo.notices`, because the runtime has notices of its own. `slapo.pattern`, `slapo.random`,
`slapo.utils`, `slapo.pipeline` and `slapo.op.compat2023` are the 2023 module paths, kept where a
2023 import expects them.
"""

from __future__ import annotations

from ..notices import Slapo2023Notice, notice_once
from ..primitives.base import register_method_adapter
from ..schedule import register_attribute, register_metadata_attribute
from .build import (
    build,
    consolidate_model,
    generate_pipeline_partition,
    init_empty_weights,
    init_target_engine,
    trace,
)
from .env import cleanup, execute, setup
from .logger import get_logger
from .primitives import PRIMITIVES_2023, register_primitive
from .spellings import ATTRIBUTES, METADATA_ATTRIBUTES, SPELLINGS
from .tune import Database, Space, Symbol


def install() -> None:
    """Register the 2023 primitives, keyword spellings and attribute names (of nodes and of
    their metadata) with the core's
    seams (idempotent; `slapo/__init__` calls it once, explicitly: that call is the edge)."""
    for cls in PRIMITIVES_2023:
        register_primitive(cls)
    for name, adapter in SPELLINGS.items():
        register_method_adapter(name, adapter)
    for name, get in ATTRIBUTES.items():
        register_attribute(name, get)
    for name, get in METADATA_ATTRIBUTES.items():
        register_metadata_attribute(name, get)


__all__ = ["Database", "Slapo2023Notice", "Space", "Symbol", "build", "cleanup",
           "consolidate_model", "execute", "generate_pipeline_partition", "get_logger",
           "init_empty_weights", "init_target_engine", "install", "notice_once", "register_primitive", "setup", "trace"]
