"""Gather a sharded model back into the original model's full state dict."""

from __future__ import annotations

import torch
import torch.nn as nn

from . import sharding
from .schedule import Schedule


def consolidate(model_or_sch: nn.Module | Schedule) -> dict[str, torch.Tensor]:
    """Full state dict (same keys as the unscheduled model) with every shard gathered.

    A collective on each shard's group (FSDP2's data-parallel group too): call it on every
    rank. The result can be loaded into the original, unscheduled model with `load_state_dict`.
    """
    model = model_or_sch.mod if isinstance(model_or_sch, Schedule) else model_or_sch
    specs = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        spec = sharding.shard_spec(t)
        if spec is not None:
            specs[name] = spec
    out = {}
    for key, value in model.state_dict().items():
        if hasattr(value, "full_tensor"):  # an FSDP2 shard: whole over dp first (of a TP shard)
            value = value.full_tensor()
        spec = specs.get(key)
        out[key] = sharding.gather_full(value, spec).clone() if spec else value.detach().clone()
    return out
