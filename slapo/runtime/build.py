"""`build`: turn a schedule into a model (and optimizer) ready to train."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..errors import SchedulingError
from ..init import has_meta_tensors, materialize
from ..schedule import Schedule


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build(sch: Schedule, *, optimizer: Callable | None = None, init_weights: Callable | None = None,
          seed: int = 0, device: torch.device | str | None = None,
          optimizer_kwargs: dict | None = None) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Return `(model, optimizer)` for a schedule.

    - Meta (delayed-init) tensors are materialised on `device`, shards only, initialised with
      `init_weights(module[, path])` or the model's own init (see `slapo.init`), seeded by `seed`.
      Weights that are already materialised (e.g. loaded from a checkpoint) are never touched.
    - `device`: move the model there (default: leave it, or the current accelerator for meta).
    - `optimizer`: an optimizer class or a callable `params -> optimizer`, called with the
      model's parameters and `optimizer_kwargs`; `None` returns `None` (as Slapo 2023 did).
    """
    if not isinstance(sch, Schedule):
        raise SchedulingError("", f"build expects a Schedule, got {type(sch).__name__}.",
                              "pass the object returned by slapo.create_schedule(model).")
    if optimizer is not None and not callable(optimizer):
        raise SchedulingError(sch.path, f"optimizer must be a class or callable, got "
                              f"{optimizer!r}.", "pass e.g. torch.optim.AdamW.")
    model = sch.mod
    if has_meta_tensors(model):
        materialize(model, device or _default_device(), init_fn=init_weights, seed=seed)
    elif device is not None:
        model.to(device)
    opt = None
    if optimizer is not None:
        opt = optimizer(model.parameters(), **(optimizer_kwargs or {}))
    return model, opt
