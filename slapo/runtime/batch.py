"""Batches as the model's forward takes them: a dict of keyword arguments or a positional tuple.

Every tensor is split along dim 0 (the sample dimension); anything that is not a tensor (a flag,
a config value) is passed unchanged to every slice.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import SchedulingError

Batch = dict[str, Any] | tuple | list


def as_batch(batch: Any) -> Batch:
    """A plain dict for any `Mapping` (HF `BatchEncoding`, a `UserDict`), so every later step
    (slicing, pipelines, `**batch`) sees one type; tuples, lists and dicts pass unchanged."""
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        return dict(batch.items())
    return batch


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested structure of tuples, lists and dicts (torch's pytree leaves)."""
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _values(batch: Batch) -> list:
    if isinstance(batch, Mapping):
        return list(batch.values())
    if isinstance(batch, (tuple, list)):
        return list(batch)
    raise SchedulingError("", f"train_step expects a mapping (keyword arguments: a dict, an HF "
                          f"BatchEncoding) or a tuple "
                          f"(positional arguments), got {type(batch).__name__}.",
                          "pass e.g. {'input_ids': ids, 'labels': ids}.")


def batch_size(batch: Batch) -> int:
    """The common dim-0 size of the batch's tensors (a batch must hold at least one tensor)."""
    sizes = {v.shape[0] for v in _values(batch) if isinstance(v, torch.Tensor) and v.dim() > 0}
    if len(sizes) != 1:
        what = "no tensor" if not sizes else f"tensors of different batch sizes {sorted(sizes)}"
        raise SchedulingError("", f"the batch holds {what}.",
                              "give every tensor of the batch the same dim-0 (sample) size.")
    return sizes.pop()


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    def cut(v):
        return v[start:stop] if isinstance(v, torch.Tensor) and v.dim() > 0 else v

    if isinstance(batch, Mapping):
        return {k: cut(v) for k, v in batch.items()}
    return type(batch)(cut(v) for v in batch)


def index_batch(batch: Batch, index: torch.Tensor) -> Batch:
    """The samples at `index` (a 1-D LongTensor), e.g. the micro-batch a pipeline hands the loss."""
    index = index.to("cpu")
    lo, hi = int(index[0]), int(index[-1]) + 1
    return slice_batch(batch, lo, hi)


def split_batch(batch: Batch, n: int) -> list[Batch]:
    size = batch_size(batch) // n
    return [slice_batch(batch, i * size, (i + 1) * size) for i in range(n)]


def check_divisible(batch: Batch, factors: dict[str, int]) -> int:
    """Raise unless the batch splits evenly into every factor (data-parallel ranks, accumulation
    steps, micro-batches); checked before any communication, so every rank raises, none hangs."""
    size = batch_size(batch)
    total = 1
    for v in factors.values():
        total *= v
    if size % total:
        parts = " x ".join(f"{k}={v}" for k, v in factors.items())
        raise SchedulingError("", f"a batch of {size} samples cannot be split evenly into "
                              f"{parts} = {total} parts.",
                              f"use a batch size that is a multiple of {total}, or change "
                              f"{', '.join(factors)}.")
    return size


def call(module, batch: Batch, *, loss_fn_given: bool = False):
    """Run `module` on a batch: mappings as keyword arguments, tuples positionally.

    With a user `loss_fn` (`loss_fn_given`), mapping entries the model's forward does not name
    are that loss function's own (`{"x": images, "labels": y}` for a torchvision net) and are
    not passed to the forward, as the pipeline stages do (`pipeline_inputs.check_batch_inputs`).
    Without one every entry goes to the forward, so a misspelt key still fails there; a forward
    that takes `**kwargs` also gets every entry."""
    if isinstance(batch, Mapping):
        if loss_fn_given:
            takes = forward_params(module)
            if takes is not None:
                batch = {k: v for k, v in batch.items() if k in takes}
        return module(**batch)
    return module(*batch)


def forward_params(module) -> frozenset[str] | None:
    """The keyword names the model's own forward takes, or None when it takes any (`**kwargs`,
    or no readable signature). Looks through DDP / DeepSpeed wrappers (`.module`) and Slapo's
    patch classes to the user's class."""
    from torch.nn.parallel import DistributedDataParallel

    from ..module_patch import original_class

    inner = getattr(module, "module", None)
    if isinstance(module, DistributedDataParallel) or type(module).__name__ == "DeepSpeedEngine":
        module = inner
    return _class_forward_params(original_class(module))


@functools.cache
def _class_forward_params(cls: type) -> frozenset[str] | None:
    try:
        params = inspect.signature(cls.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)
