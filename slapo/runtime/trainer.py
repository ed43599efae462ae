"""`Trainer`: one optimizer step over the built model's parts, the same call for every parallelism.

`slapo.runtime.build.build_trainer(sch, ...)` makes it; `slapo.build` makes the same one and
returns the model with the trainer's `train_step`, `eval_step`, ... attached
(`built_model.attach`). The apps that drive the step (`slapo train`, tune trials, the
progressive demo) hold the Trainer itself, so nothing is dug back out of a module.

The step is the same sequence whatever `build` composed:

    slice this dp rank's samples -> zero grads -> for each accumulation slice: runner.forward_backward
    -> runner.finish_grads (e.g. sum tied weights across pipeline stages) -> unscale (fp16)
    -> clip -> optimizer.step (fp16: skipped on inf/NaN) -> the loss, averaged over samples, as a
    float on every rank

An HF language model's own loss is averaged over the supervised tokens of the whole global
batch, not over slices, ranks or micro-batches (`slapo.runtime.token_mean`), so masked-LM and
padded batches train like one process however the batch is split.

Only the *runner* differs (`slapo.runtime.runner.LocalRunner`, or
`slapo.runtime.pipeline_runner.PipelineRunner`); both get the step's `Precision`, and the
unscale and optimizer step are the trainer's, so precision is decided in one place.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SchedulingError
from .batch import Batch, as_batch, batch_size, check_divisible, slice_batch, split_batch
from .context_parallel import cp_batch
from .precision import Precision
from .runner import Runner
from .token_mean import token_mean
from .train_step import NormWeights, StepConfig, clip_grad_norm, reduce_loss


class Trainer:
    """The model parts this rank trains, their optimizer, the runner, the step's config and
    precision; `train_step(batch) -> float` is one optimizer step.

    A plain object, not a Module: the runner holds the DDP wrapper, whose module is the model,
    so registering the trainer anywhere in the module tree would list every parameter twice.
    `model` is what `slapo.build` returns (the user's module, or with a pipeline a
    `PipelineTrainModule` of this rank's stages); `parts` are the modules this rank holds (the
    model, or its stages)."""

    def __init__(self, model: nn.Module | None, parts: list[nn.Module],
                 optimizer: torch.optim.Optimizer | None, runner: Runner,
                 step_config: StepConfig, norm_weights: NormWeights, precision: Precision):
        self.model = model
        self.parts = parts
        self.optimizer = optimizer
        self.runner = runner
        self.step_config = step_config
        self.norm_weights = norm_weights
        self.precision = precision
        # the last step's global gradient 2-norm before clipping (with `grad_clip`; a 0-dim
        # tensor, read after the step so the step itself waits for no host sync), else None
        self.last_grad_norm: torch.Tensor | None = None

    def __repr__(self) -> str:
        cfg = self.step_config
        return (f"Trainer({type(self.model).__name__}, {len(self.parts)} part(s), "
                f"{type(self.runner).__name__}, grad_accum={cfg.grad_accum})")

    def local_batch(self, batch: Batch) -> Batch:
        """This dp rank's samples when the same global batch is given on every rank; with
        cp > 1, this cp rank's part of each of them (`context_parallel.cp_batch`)."""
        cfg = self.step_config
        info = cfg.info
        factors = {"data-parallel ranks": info.dp if cfg.batch_is_global else 1,
                   "grad_accum": cfg.grad_accum, "num_microbatches": cfg.num_microbatches}
        check_divisible(batch, {k: v for k, v in factors.items() if v > 1})
        if cfg.batch_is_global and info.dp > 1:
            size = batch_size(batch) // info.dp
            batch = slice_batch(batch, info.dp_rank * size, (info.dp_rank + 1) * size)
        if info.cp > 1:  # this cp rank's chunks of every sequence (`runtime/context_parallel`)
            batch = cp_batch(batch, info.cp, info.cp_rank, shift_labels=cfg.loss.preshifted,
                             positions=cfg.cp_positions)
        return batch

    def train_step(self, batch: Batch) -> float:
        """Forward, backward, (unscale, clip), optimizer step; the batch's mean loss on every
        rank. With fp16 the step may be skipped (inf/NaN gradients on some rank): see
        `self.precision.last_step_skipped` / `.skipped_steps`; the loss is returned either way."""
        if self.optimizer is None:
            raise SchedulingError("", "train_step needs an optimizer.",
                                  "pass build(sch, optimizer=torch.optim.AdamW, ...).")
        cfg = self.step_config
        batch = self.local_batch(as_batch(batch))  # any Mapping (HF BatchEncoding) -> dict
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.begin_step()
        k = cfg.grad_accum
        parts = split_batch(batch, k) if k > 1 else [batch]
        tokens = token_mean(cfg.loss, parts, cfg.info, cfg.units())
        loss = None  # stays on the loss's device: no host sync before the optimizer step
        for i, part in enumerate(parts):
            part_loss = self.runner.forward_backward(part, 1.0 / k, sync_grads=i == k - 1,
                                                     tokens=tokens).double()
            loss = part_loss if loss is None else loss + part_loss
        self.runner.finish_grads()
        self.precision.unscale_(self.optimizer)
        self.last_grad_norm = None if cfg.grad_clip is None else \
            clip_grad_norm(self.norm_weights, cfg.grad_clip, cfg.info)
        self.precision.step(self.optimizer)
        return reduce_loss(loss, cfg.info)

    @torch.no_grad()
    def eval_step(self, batch: Batch) -> float:
        """The batch's mean loss, forward only, in eval mode (no dropout), under the training
        precision, on every rank; takes the same batch as `train_step` (global or local) and
        changes nothing. Works with a pipeline too (the schedule's forward-only `eval`): the
        one way `slapo train` computes its val loss. Collective: every rank calls it."""
        cfg = self.step_config
        batch = self.local_batch(as_batch(batch))
        tokens = token_mean(cfg.loss, [batch], cfg.info, cfg.num_microbatches * cfg.info.replicas)
        return reduce_loss(self.runner.evaluate(batch, tokens), cfg.info)
