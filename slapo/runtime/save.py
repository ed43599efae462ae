"""Saving a built model with Hugging Face's `save_pretrained`: whole tensors, never shards.

Why: on a tensor-parallel rank each sharded parameter is a local slice, and under FSDP2 a
DTensor shard; HF's `save_pretrained` would write those shapes as if they were the model's
(the file then fails to load, or worse, loads into a model of another size). So the built
model's `save_pretrained` gathers first — a collective: call it on every rank, as you would
`train_step` — and only rank 0 writes. A pipeline rank holds only its stages: its
`save_pretrained` is an error pointing to `slapo train` checkpoints and `slapo export`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import sharding
from ..consolidate import consolidate
from ..errors import SchedulingError


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "to_local")


def is_sharded(model: nn.Module) -> bool:
    """Some parameter or buffer is a TP shard (ShardSpec over >1 rank) or an FSDP2 DTensor."""
    for t in [*model.parameters(), *model.buffers()]:
        spec = sharding.shard_spec(t)
        if (spec is not None and spec.world_size > 1) or _is_dtensor(t):
            return True
    return False


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective. The model's state dict with every TP shard gathered and every DTensor made
    whole (the unscheduled model's keys and shapes)."""
    state = consolidate(model)
    return {k: v.full_tensor() if _is_dtensor(v) else v for k, v in state.items()}


def save_pretrained_whole(model: nn.Module, save: Callable, save_directory: Any, *args: Any,
                          **kwargs: Any) -> Any:
    """`save(save_directory, ...)` (HF's `save_pretrained`) with whole tensors on rank 0."""
    if not is_sharded(model) or "state_dict" in kwargs:
        return save(save_directory, *args, **kwargs)
    kwargs["state_dict"] = full_state_dict(model)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    kwargs["is_main_process"] = kwargs.get("is_main_process", True) and rank0
    return save(save_directory, *args, **kwargs)


def refuse_pipeline_save(*_: Any, **__: Any) -> None:
    raise SchedulingError("", "a pipeline rank holds only its own stages, so it cannot write "
                          "the whole model with save_pretrained.",
                          "train with `slapo train --out DIR` (checkpoints) and run `slapo "
                          "export DIR --out HF_DIR`, or gather the stages' state_dict()s "
                          "yourself.")
