"""2023 build-side names: `consolidate_model`, `init_target_engine`, `trace`,
`generate_pipeline_partition`, as calls into today's runtime.

Fixed 2023 bugs: `consolidate_model` re-initialised every weight, loaded ones included, and only
on CUDA; here it materialises meta (delayed-init) tensors only, shards only, on any device, with
the same per-module seeding as `slapo.build` (so the result does not depend on the TP degree).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..init import has_meta_tensors, materialize
from ..schedule import Schedule, create_schedule


def consolidate_model(sch: Schedule, target: str | None = None,
                      param_init_fn: Callable | None = None, topology: Any = None,
                      device: torch.device | str | None = None, seed: int = 0) -> Schedule:
    """Materialise `sch`'s meta tensors in place (this rank's shards), initialised with
    `param_init_fn(mod[, path])` or the model's own init; materialised weights are kept.
    `target` and `topology` (DeepSpeed's) are accepted for the 2023 signature and unused: the
    schedule's group already says which slice each rank keeps."""
    model = sch.mod
    if has_meta_tensors(model):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        materialize(model, device, init_fn=param_init_fn, seed=seed)
    return sch


def init_target_engine(model: nn.Module, target: str | None = None,
                       **kwargs: Any) -> tuple[Any, Any]:
    """`(model, None)` for the native target; for "deepspeed", `deepspeed.initialize(model=...,
    model_parameters=<trainable params>, **kwargs)` -> (engine, optimizer), as in 2023."""
    if target is None:
        return model, None
    if target != "deepspeed":
        from ..errors import SchedulingError

        raise SchedulingError("", f"unknown target {target!r}.", "use None or 'deepspeed'.")
    from ..runtime.deepspeed import import_deepspeed

    ds = import_deepspeed()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, *_ = ds.initialize(model=model, model_parameters=params, **kwargs)
    return engine, optimizer


def trace(model: nn.Module, **kwargs: Any) -> nn.Module:
    """2023 `slapo.trace(model, tracer=, recursive=, flatten=, leaf_modules=, concrete_args=)`:
    the GraphModule of `model` (through the `trace` primitive, 2023 spellings accepted)."""
    sch = create_schedule(model)
    return sch.trace(**kwargs)


def generate_pipeline_partition(sch: Schedule, num_stages: int | None = None) -> list[nn.Module]:
    """2023's partition step: the stage modules at the schedule's `cut_pipeline_stage` cuts.

    2023 split one traced GraphModule into `submod_i` children; today a stage is a module that
    shares the model's layers (slapo.pipeline.partition), so this returns the list of stages."""
    from ..runtime.partition import partition

    return partition(sch, num_stages)
