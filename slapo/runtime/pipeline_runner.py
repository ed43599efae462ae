"""Pipeline parallelism through `torch.distributed.pipelining`: stages from the schedule's cuts.

The schedule's cuts (`cut_pipeline_stage`) give `pp * virtual_stages` stage modules. Each pp rank
keeps its own stages (placed round-robin, `[r, r+pp, ...]`, or V-shaped, `[r, 2*pp-1-r]`, for the
zero-bubble V schedules), wraps each in a `PipelineStage` over the mesh's pp group, and drives
them with one of torch's schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV).

The loss is computed on the last stage by the schedule. To hand `loss_fn(outputs, batch)` the
micro-batch that belongs to each output, the schedule's `target` is the tensor of sample indices:
the schedule splits it exactly like the inputs, and the loss looks the samples up.

Gradients are averaged by us, not by torch (`scale_grads=False`): each micro-batch loss is
divided by (micro-batches x accumulation steps), so gradient accumulation over several `step`
calls stays exact (torch's rescaling would also rescale gradients accumulated before the call).

Mixed precision (`Precision`): each stage's forward runs under autocast (`wrap_forward`, applied
to the module the PipelineStage calls, so torch's metadata inference, which calls the same
forward on real tensors of the stage's device, infers the activation dtypes the micro-batches
really have: fp32 for HF decoders, whose residual stream stays fp32 under autocast), the loss
runs under autocast, and the loss handed to the schedule's backward is `loss_for_backward`
(fp32, scaled for fp16).

Errors: what fails on one rank only is recorded, the schedule runs to its end, and one
all-reduced flag makes every rank raise (`pipeline_failures.py`: the protocol, the stand-ins a
failed stage sends); torch's stages are routed through this runner by `pipeline_guards.py`.
The plan and torch's schedule: `pipeline_plan.py`; the zero-bubble schedules' split-backward
checks: `split_backward.py`; tied weights: `pipeline_tied.py`; a batch's stage inputs:
`pipeline_inputs.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import faultpoints
from ..errors import SchedulingError
from .batch import Batch, batch_size, index_batch, tensors_in
from .mesh import MeshInfo
from .pipeline_failures import (
    PREPARE_ORDER,
    fallback_output,
    output_template,
    raise_on_every_rank,
    unwrap_stage_error,
    zero_input_grads,
    zero_loss,
)
from .pipeline_guards import ACTIVE, forget_inferred_shapes
from .pipeline_inputs import (
    batch_shapes,
    check_batch_inputs,
    contiguous_inputs,
    first_stage_args,
    stage_cp_inputs,
    stage_default_loss,
    stage_loss_inputs,
    stage_masks,
    stage_outputs,
    stage_position_inputs,
)
from .pipeline_plan import V_SCHEDULES, PipelinePlan
from .pipeline_tied import TiedWeights
from .precision import Precision
from .runner import LossFn, compute_loss
from .split_backward import SPLIT_BACKWARD, split_backward_hazards
from .token_mean import Weights, weighted


class PipelineRunner:
    """One `schedule.step` per accumulation slice; the loss is the mean over micro-batches."""

    def __init__(self, schedule, plan: PipelinePlan, info: MeshInfo, stage_ids: list[int],
                 stage_modules: list[nn.Module], loss_fn: LossFn | None, tied: TiedWeights,
                 precision: Precision | None = None):
        self.schedule = schedule
        self.plan = plan
        self.info = info
        self.holds_first = 0 in stage_ids
        self.holds_last = plan.num_stages - 1 in stage_ids
        self.modules = list(stage_modules)
        self.first = stage_modules[stage_ids.index(0)] if self.holds_first else None
        self.last = stage_modules[stage_ids.index(plan.num_stages - 1)] \
            if self.holds_last else None
        self.loss_fn = loss_fn
        self.tied = tied
        self.precision = precision or Precision()
        self._batch: Batch | None = None
        self._scale = 1.0
        self._tokens: Weights | None = None
        self._losses: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._shapes: tuple | None = None  # the last call's batch shapes (`batch_shapes`)
        self._error_order = 0
        self._error_phase: str | None = None  # e.g. "stage 1 backward"
        self._templates: dict[int, Any] = {}  # stage id -> its last good output's structure
        self._by_stage = dict(zip(stage_ids, stage_modules, strict=True))
        self._split_checked: set[int] = set()  # stages whose split backward was checked
        self._zero_backward = False  # evaluating through `step` (`_evaluate_by_step`)

    def schedule_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's `loss_fn(output, target)`: target holds the micro-batch's indices.

        An exception here (a user `loss_fn` bug, no `labels`, a stage without a loss of its
        own) is recorded instead of raised: the schedule then runs to its end on every rank
        (zero gradients flow back), and `forward_backward` raises it on *every* rank. Raised
        here, it would leave only this rank's peers blocked on a receive until they die on a
        closed connection or a collective timeout."""
        if self._error is not None:
            return zero_loss(output)
        try:
            mb = index_batch(self._batch, index)
            weight = self._scale / self.plan.num_microbatches if self._tokens is None \
                else self._tokens.weight(mb)
            mb = mb if self._tokens is None else self._tokens.guard(mb)
            with self.precision.autocast():
                outputs = stage_outputs(self.last, output)
                if self.loss_fn is None:
                    loss = stage_default_loss(self.last, outputs, mb)
                else:
                    loss = compute_loss(outputs, mb, self.loss_fn)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
            self._fail_in_schedule(e, self.plan.num_stages, "the loss")
            return zero_loss(output)
        self._losses.append(loss.detach().double() * weight)
        grad_loss = weighted(self.precision.loss_for_backward(loss), weight)
        return grad_loss * 0.0 if self._zero_backward else grad_loss

    def _fail(self, error: BaseException, order: int, phase: str | None = None) -> None:
        """Record the first error of this step on this rank (`order`: where in the pipeline;
        `phase`: the same in words, for the message the other ranks raise)."""
        if self._error is None:
            self._error, self._error_order, self._error_phase = error, order, phase

    def _fail_in_schedule(self, error: BaseException, order: int, phase: str) -> None:
        """`_fail` for an error inside the schedule (a stage's forward or backward, the loss):
        from then on this rank's stages skip their work for the step. Under FSDP2 over more
        than one data-parallel rank, or TP, that would leave the peers waiting
        (`_replicas_in_lockstep`), so there the error is raised at once instead."""
        self._fail(error, order, phase)
        if not self._replicas_in_lockstep():
            return
        if hasattr(error, "add_note"):
            why = "With tensor parallelism a failed stage cannot keep its tp peers' " \
                  "collectives in step" if self.info.tp > 1 else "With FSDP2 over more " \
                  "than one data-parallel rank a failed stage cannot keep its replicas' " \
                  "parameter all-gathers and gradient reduce-scatters in step"
            error.add_note(f"slapo: raised in pipeline {phase} on rank {dist.get_rank()}. "
                           f"{why}, so it is raised at once: the job stops "
                           "(the other ranks fail on their next collective when this process "
                           "exits), and resumes from a checkpoint.")
        raise error

    def _replicas_in_lockstep(self) -> bool:
        """Whether this rank's stages run collectives with ranks outside the pipeline group
        inside their forward and backward: FSDP2 over more than one data-parallel rank (every
        forward and backward all-gathers parameters, the step's end reduce-scatters gradients,
        together with the stage's replicas), or tensor parallelism (every sharded block
        all-reduces or gathers with its tp peers, forward and backward).

        A stage that skips the rest of its step after a failure, as the guards do, calls
        fewer of them, and its peers would wait in theirs until the collective timeout (seen:
        dp=2 x pp=2 with FSDP2, and tp=2 x pp=2 with a backward failing on one tp rank, torch
        2.13, gloo: the whole job hung). No stand-in can replay them, so the error is raised
        where it happened: the process exits, and torchrun (or the peers' dead sockets) stops
        the rest. (A failure while preparing the step happens before any stage runs: the
        usual agreement serves it.)"""
        if self.info.tp > 1:
            return True
        if self.info.replicas <= 1:
            return False
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for s in self.modules for m in s.modules())

    def stage_forward(self, stage_id: int, inner: Callable, args: tuple, kwargs: dict) -> Any:
        """A stage's forward inside `schedule.step`: run it; if it raises (or this rank already
        failed this step), record the error and return `fallback_output` zeros instead, so the peers
        waiting on this stage's send are served and the schedule ends on every rank."""
        if self._error is None:
            try:
                out = inner(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
                self._fail_in_schedule(e, stage_id, f"stage {stage_id} forward")
            else:
                self._templates[stage_id] = output_template(out)
                self._check_split_backward(stage_id, (args, kwargs), out)
                return out
        out = fallback_output(self._templates.get(stage_id), args)
        self._templates.setdefault(stage_id, output_template(out))
        return out

    def _check_split_backward(self, stage_id: int, inputs: Any, out: Any) -> None:
        """Once per stage, on a zero-bubble schedule: refuse the step (on every rank, before
        any optimizer step) if torch's split backward would give a weight of this stage a wrong
        gradient (`split_backward_hazards`). The first stage runs a full backward instead."""
        if (self.plan.name not in SPLIT_BACKWARD or stage_id == 0 or
                stage_id in self._split_checked or not torch.is_grad_enabled()):
            return
        if not any(t.requires_grad for t in tensors_in(inputs)):
            return  # not the stage's real input (torch's first-step shape inference)
        self._split_checked.add(stage_id)
        module = self._by_stage[stage_id]
        bad = split_backward_hazards(out, inputs, dict(module.named_parameters()))
        if bad:
            self._fail_in_schedule(SchedulingError(
                "", f"pipeline={self.plan.name!r} splits each stage's backward into input and "
                f"weight passes, and torch's weight pass would give {bad} of stage {stage_id} "
                "a wrong gradient, silently: a tensor made from them without the stage's "
                "inputs is sent on to later stages, and that path meets no input.",
                "use 1F1B, GPipe, Interleaved1F1B or LoopedBFS."), stage_id,
                f"stage {stage_id} forward")

    def stage_backward(self, stage_id: int, inner: Callable[[], Any], kind: str,
                       bwd_kwargs: dict) -> Any:
        """A stage's backward inside `schedule.step` (`kind`: torch's "full", "input" or
        "weight"): run it; if it raises (or this rank already failed this step), record the
        error and return zero input gradients instead, so the stage upstream, waiting on this
        stage's gradient send, is served and the schedule ends on every rank."""
        if self._error is None:
            try:
                faultpoints.reach("pp_backward")  # test hook (SLAPO_FAULT): fails here
                return inner()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
                self._fail_in_schedule(unwrap_stage_error(e), self.backward_order(stage_id),
                           f"stage {stage_id} backward")
        return zero_input_grads(kind, bwd_kwargs)

    def backward_order(self, stage_id: int) -> int:
        """Backward runs after the loss, from the last stage to the first."""
        return 2 * self.plan.num_stages - stage_id

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        """The slice's loss, each micro-batch's weighted by `scale / num_microbatches` or by its
        share of the step's supervised tokens (`tokens`); returns their sum."""
        return self._run(batch, scale, tokens, self.schedule.step,
                         "running the stages and the loss", return_outputs=False)

    def evaluate(self, batch: Batch, tokens: Weights | None = None) -> torch.Tensor:
        """Forward only (the schedule's `eval`), every stage in eval mode: the mean loss over
        the micro-batches on the last stage's rank (zero elsewhere: `reduce_loss` sums over
        the pp group)."""
        if not hasattr(self.schedule, "eval"):
            raise SchedulingError("", "this torch's pipeline schedules have no forward-only "
                                  "eval().", "upgrade torch, or evaluate without a pipeline.")
        modes = [(m, m.training) for m in self.modules]
        for m, _ in modes:
            m.eval()
        try:
            if self.plan.name in V_SCHEDULES:
                return self._evaluate_by_step(batch, tokens)
            return self._run(batch, 1.0, tokens, self.schedule.eval, "evaluating")
        finally:
            for m, training in modes:
                m.train(training)

    def _evaluate_by_step(self, batch: Batch, tokens: Weights | None) -> torch.Tensor:
        """`evaluate` for the V-shaped schedules, whose forward-only `eval()` fails in torch
        (2.13: a stage without backward is asked for its input gradient, after a peer's
        receive timed out; `slapo train` then died at its first val loss): the training
        schedule's `step` instead, the loss's backward weighted by zero and every gradient
        restored afterwards. Same losses, about 3x an eval's compute (a few batches per
        evaluation), no optimizer step, no change to any `.grad`."""
        params = [p for m in self.modules for p in m.parameters()]
        saved = [p.grad for p in params]
        self._zero_backward = True
        try:
            with torch.enable_grad():
                return self._run(batch, 1.0, tokens, self.schedule.step, "evaluating",
                                 return_outputs=False)
        finally:
            self._zero_backward = False
            for p, g in zip(params, saved, strict=True):
                p.grad = g

    def _run(self, batch: Batch, scale: float, tokens: Weights | None, run: Callable,
             where: str, **run_kwargs: Any) -> torch.Tensor:
        self._batch, self._scale, self._tokens, self._losses = batch, scale, tokens, []
        self._error, self._error_phase = None, None
        args, target, masks = (), None, {}
        try:  # what can fail before the step fails on its rank only: agree first
            masks = contiguous_inputs({**stage_masks(self.modules[0], batch),
                                       **stage_cp_inputs(self.modules[0], batch),
                                       **stage_position_inputs(self.modules[0], batch),
                                       **stage_loss_inputs(self.modules[0], batch, self.loss_fn)})
            check_batch_inputs(self.modules[0], batch)
            args = contiguous_inputs(first_stage_args(self.first, batch)) \
                if self.holds_first else ()
            target = torch.arange(batch_size(batch)) if self.holds_last else None
        except Exception as e:  # noqa: BLE001
            self._fail(e, PREPARE_ORDER)
        raise_on_every_rank(self._error, self.info, "preparing the pipeline step")
        shapes = batch_shapes(batch)
        if self._shapes is not None and shapes != self._shapes:
            forget_inferred_shapes(self.schedule)
        self._shapes = shapes
        token = ACTIVE.set(self)
        try:
            run(*args, target=target, **run_kwargs, **masks)
        finally:
            ACTIVE.reset(token)
        self._batch = None
        raise_on_every_rank(self._error, self.info, where, order=self._error_order,
                            phase=self._error_phase)
        if not self.holds_last:
            return torch.zeros(())
        # torch's first step also calls the loss once on uninitialised tensors to infer
        # gradient shapes; the real micro-batches are the last `num_microbatches` calls
        real = self._losses[-self.plan.num_microbatches:]
        return torch.stack(real).sum().cpu()

    def finish_grads(self) -> None:
        self.tied.sync_grads(self.info)
