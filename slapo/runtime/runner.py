"""The runners: forward and backward of one slice of the batch, for the `Trainer`'s step.

`LocalRunner` runs the whole model on every rank of a dp group (plain, DDP or FSDP2);
`slapo.runtime.pipeline_runner.PipelineRunner` runs a torch.distributed.pipelining schedule over
this rank's stages. Both take the step's `Precision` (forward and loss under its `autocast()`,
backward on its `loss_for_backward(loss)`) and the loss's token weights (`token_mean`), so the
`Trainer` is the same whatever runs the slices. `compute_loss` is the one place a model's
output becomes the scalar loss (`loss_fn`, or the HF model's `outputs.loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..errors import SchedulingError
from .batch import Batch, call
from .data_parallel import set_expert_sync
from .precision import Precision
from .token_mean import Weights, weighted

LossFn = Callable[[Any, Batch], torch.Tensor]


def compute_loss(outputs: Any, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """`loss_fn(outputs, batch)`, or the model's own `outputs.loss` (HF models given labels)."""
    if loss_fn is not None:
        loss = loss_fn(outputs, batch)
    else:
        loss = getattr(outputs, "loss", None)
        if loss is None:
            raise SchedulingError("", "the model's output has no `.loss` (an HF model computes "
                                  "it only when the batch holds `labels`).",
                                  "put `labels` in the batch, or pass build(..., loss_fn=fn) "
                                  "with fn(outputs, batch) -> scalar.")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SchedulingError("", f"the loss must be a scalar tensor, got {type(loss).__name__}"
                              f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.",
                              "return e.g. loss.mean() from loss_fn.")
    return loss.reshape(())


def forward_loss(module: nn.Module, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """The module's forward on the batch, then `compute_loss` (with a `loss_fn`, batch entries
    the forward does not name go to the loss function only: `batch.call`)."""
    return compute_loss(call(module, batch, loss_fn_given=loss_fn is not None), batch, loss_fn)


class Runner(Protocol):
    """Forward and backward of one slice of the batch; gradients accumulate in `.grad`."""

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        """Backward of the slice's loss x its weight (`scale`, or each unit's `tokens.weight`);
        return that weighted loss, detached (zero on ranks that do not compute it)."""

    def finish_grads(self) -> None:
        """Complete gradients after the last slice (before clipping)."""

    def evaluate(self, batch: Batch, tokens: Weights | None = None) -> torch.Tensor:
        """The slice's loss (x its token weight), forward only, in eval mode."""


class LocalRunner:
    """The whole model on every rank of a dp group: plain, DistributedDataParallel or FSDP2.

    The forward is `model(...)`, the user's module itself (its hooks run once); under DDP its
    forward goes through `ddp` (see `built_model.attach`), whose `no_sync` skips the
    all-reduce of all but the last accumulation slice."""

    def __init__(self, model: nn.Module, loss_fn: LossFn | None,
                 precision: Precision | None = None,
                 ddp: DistributedDataParallel | None = None):
        self.model = model
        self.ddp = ddp
        self.loss_fn = loss_fn
        self.precision = precision or Precision()

    @property
    def module(self) -> nn.Module:
        """What data parallelism made of the model: the DDP wrapper (for its comm hooks), or
        the model itself (plain, or FSDP2's class swapped in place)."""
        return self.ddp if self.ddp is not None else self.model

    def _no_sync(self, sync: bool):
        if not sync and self.ddp is not None:
            return self.ddp.no_sync()  # skip the all-reduce of this slice's gradients
        return nullcontext()

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        if isinstance(self.model, FSDPModule):  # reduce-scatter only on the last slice
            self.model.set_requires_gradient_sync(sync_grads)
            set_expert_sync(self.model, sync_grads)  # and the experts' mean with it
        weight = scale if tokens is None else tokens.weight(batch)
        batch = batch if tokens is None else tokens.guard(batch)
        with self._no_sync(sync_grads):
            with self.precision.autocast():  # forward and loss; backward outside autocast
                loss = forward_loss(self.model, batch, self.loss_fn)
            grad_loss = self.precision.loss_for_backward(loss)  # fp32 (x the fp16 scale)
            (weighted(grad_loss, weight) if tokens is not None or scale != 1
             else grad_loss).backward()
        return loss.detach().double() * weight

    def finish_grads(self) -> None:
        """Nothing to complete: DDP and FSDP2 reduced the gradients in the last backward."""

    def evaluate(self, batch: Batch, tokens: Weights | None = None) -> torch.Tensor:
        """Forward and loss only, in eval mode, under the training precision (x the batch's
        token weight when given)."""
        model = self.model
        was_training = model.training
        model.eval()
        weight = None if tokens is None else tokens.weight(batch)
        batch = batch if tokens is None else tokens.guard(batch)
        try:
            with self.precision.autocast():
                loss = forward_loss(model, batch, self.loss_fn).detach()
        finally:
            model.train(was_training)
        return loss if weight is None else loss.double() * weight
