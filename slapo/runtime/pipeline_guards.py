"""Patches of torch's `PipelineStage` internals: each stage's forward and backward routed
through the running `PipelineRunner` (which records a failure instead of raising), state kept
through torch's first-step shape inference, and inferred shapes forgotten when the batch's change.

Every patch names the torch method it wraps and the torch versions it was tested on; a torch
without the method keeps its unguarded behaviour.
"""

from __future__ import annotations

import contextvars
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..distributed import rng
from .mesh import MeshInfo
from .pipeline_plan import PipelinePlan

if TYPE_CHECKING:
    from .pipeline_runner import PipelineRunner

# The runner whose `schedule.step` is running in this thread: stage forwards report to it.
ACTIVE: contextvars.ContextVar[PipelineRunner | None] = contextvars.ContextVar(
    "slapo_pipeline_runner", default=None)
# Set while torch's first-step shape inference runs a stage's forward: counters of what the
# step computed (`train/moe_metrics.py`) skip it, as it is not one of the step's micro-batches.
INFERRING: contextvars.ContextVar[bool] = contextvars.ContextVar("slapo_pipeline_inferring",
                                                                 default=False)


def inferring() -> bool:
    """Whether the forward running now is torch's shape inference (`INFERRING`)."""
    return INFERRING.get()


def forget_inferred_shapes(schedule) -> None:
    """Make the next step infer its stages' shapes again. torch infers a stage's micro-batch
    shapes at the first step and keeps them (2.13 re-infers only on a train/eval switch): a
    later training step with another sequence length or batch size failed ("Expected input
    batch_size (32) to match target batch_size (16)"; torch 2.11's first stage: "shape
    mismatch: expected [2, 16] actual [4, 16]"), and on torch 2.11 `eval_step` on the whole
    batch after training in `grad_accum` slices too, so `slapo train --pp-stages 2 --grad-accum
    2` died at its first val loss on the GPU image's torch. Every rank of the pipeline sees
    the same batch shapes, so every rank clears at the same step: the flags torch sets after
    inferring, and torch < 2.13's stage metadata (which it never overwrites)."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for st in stages:
        if hasattr(st, "_shape_inference"):  # torch < 2.13
            st.inputs_meta = None
            st._outputs_meta = None
    for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                 "_stages_forward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def make_stages(modules: list[nn.Module], stage_ids: list[int], plan: PipelinePlan,
                info: MeshInfo, device: torch.device) -> list:
    """torch `PipelineStage`s over this rank's stage modules, each forward and backward guarded
    (`guard_stage_forward`, `guard_stage_backward`) so that an exception in either reaches
    every rank promptly."""
    from torch.distributed.pipelining import PipelineStage

    for m, s in zip(modules, stage_ids, strict=True):
        guard_stage_forward(m, s)
    stages = [PipelineStage(m, s, plan.num_stages, device, group=info.group("pp"))
              for m, s in zip(modules, stage_ids, strict=True)]
    for stage, s in zip(stages, stage_ids, strict=True):
        keep_state_through_shape_inference(stage)
        guard_stage_backward(stage, s)
        send_zeros_for_missing_input_grads(stage)
    return stages


def send_zeros_for_missing_input_grads(stage) -> None:
    """A received input that got no gradient (None: nothing after it in this stage reached the
    loss) sends zeros upstream, as torch 2.13 does (`get_bwd_send_ops` makes a zero gradient
    from the slot's metadata). torch 2.11 raised "has gradients None and is expecting to send
    gradients to stage N" on that rank only, leaving the stage before it waiting for the
    gradient until the collective timeout (seen: tests/test_pipeline_router.py's stage that
    drops the carried router statistics). Patched on torch < 2.13 only, whose stage lacks
    `_get_grad_send_meta`: the gradients a stage hands over, sent (`get_bwd_send_ops`) or
    passed to a stage on the same rank (`get_local_bwd_output`), get zeros shaped like the
    received input where they are None."""
    if hasattr(stage, "_get_grad_send_meta") or not hasattr(stage, "bwd_cache"):
        return
    from torch.distributed.pipelining.stage import _RecvInfo

    def fill(chunk: int) -> None:
        grads = stage.bwd_cache.get(chunk)
        infos = stage.args_recv_info.get(chunk, ())
        if grads is None or all(g is not None for g in grads):
            return
        stage.bwd_cache[chunk] = type(grads)(
            torch.zeros_like(info.buffer) if g is None and isinstance(info, _RecvInfo) else g
            for g, info in zip(grads, infos, strict=False))

    for name in ("get_bwd_send_ops", "get_local_bwd_output"):
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        @functools.wraps(inner)
        def handed_over(chunk, *args, _inner=inner, **kwargs):
            fill(chunk)
            return _inner(chunk, *args, **kwargs)

        setattr(stage, name, handed_over)


def keep_state_through_shape_inference(stage) -> None:
    """torch infers a stage's output shapes on the first step by running its forward once
    (later stages on uninitialised inputs), in training mode: BatchNorm's running statistics
    would take that garbage in (seen: 7e32 after one step). Restore every buffer after it,
    and every random stream: torch 2.11's inference runs the forward on real zeros, so its
    dropouts drew numbers the next step's masks then missed, and a run resumed from a
    checkpoint (which infers again at its first step) trained on other masks than the
    uninterrupted run (tests/test_train_families.py, on torch 2.11).
    The method is `_forward_metadata_inference` in torch 2.13, `_shape_inference` earlier."""
    for name in ("_forward_metadata_inference", "_shape_inference"):
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        @functools.wraps(inner)
        def run(*args, _inner=inner, **kwargs):
            saved = [(b, b.detach().clone()) for b in stage.submod.buffers()]
            token = INFERRING.set(True)
            try:
                with rng.states_kept():
                    return _inner(*args, **kwargs)
            finally:
                INFERRING.reset(token)
                for b, value in saved:  # via .data: the inference's own backward pass (shapes
                    b.data.copy_(value)  # only) must not see a version bump of saved inputs

        setattr(stage, name, run)


def guard_stage_forward(module: nn.Module, stage_id: int) -> None:
    """Route `module.forward` through the running `PipelineRunner.stage_forward` (outside a
    pipeline step, e.g. a user's own eval call, it runs unguarded), and mark the module with
    `slapo_pipeline_stage = stage_id` (the `SLAPO_FAULT` test hook's `pp` point looks for it)."""
    if getattr(module, "slapo_pipeline_stage", None) is not None:
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        runner = ACTIVE.get()
        if runner is None:
            return inner(*args, **kwargs)
        return runner.stage_forward(stage_id, inner, args, kwargs)

    module.forward = forward
    module.slapo_pipeline_stage = stage_id


def guard_stage_backward(stage, stage_id: int) -> None:
    """Route the `PipelineStage`'s backward through the running
    `PipelineRunner.stage_backward` (outside a pipeline step it runs unguarded).

    The hook point is `backward_maybe_with_nosync(backward_type, bwd_kwargs, ...)`: the one
    method every torch schedule's backward goes through (full backward, and the input and
    weight halves of the zero-bubble schedules); tested on torch 2.13. (Under FSDP2 over more
    than one data-parallel rank the error is raised at once instead: see
    `PipelineRunner._fail_in_schedule`.) A torch without the method keeps the unguarded
    backward (then a backward error reaches the other ranks only at the collective timeout,
    as before). torch 2.13's first step also runs each stage's backward
    once on real tensors to infer the gradient shapes (`_compute_input_grads`): guarded too
    (`guard_metadata_backward`)."""
    guard_metadata_backward(stage, stage_id)
    inner = getattr(stage, "backward_maybe_with_nosync", None)
    if inner is None or getattr(stage, "slapo_backward_guarded", False):
        return

    @functools.wraps(inner)
    def backward(backward_type, bwd_kwargs, *args, **kwargs):
        runner = ACTIVE.get()
        call = functools.partial(inner, backward_type, bwd_kwargs, *args, **kwargs)
        if runner is None:
            return call()
        return runner.stage_backward(stage_id, call, backward_type, bwd_kwargs)

    stage.backward_maybe_with_nosync = backward
    stage.slapo_backward_guarded = True


def guard_metadata_backward(stage, stage_id: int) -> None:
    """torch 2.13 infers a stage's input-gradient shapes on the first step by a real backward
    (`_compute_input_grads(outputs, inputs, grad_outputs)`, which returns one gradient or None
    per input). If it raises, record the error and return Nones: torch then derives each
    gradient's shape from its input's (as it does for any input without a gradient) and still
    sends the shapes upstream, so the stage before it does not wait for them."""
    inner = getattr(stage, "_compute_input_grads", None)
    if inner is None:
        return

    @functools.wraps(inner)
    def compute(outputs, all_fwd_inputs, *args, **kwargs):
        runner = ACTIVE.get()
        call = functools.partial(inner, outputs, all_fwd_inputs, *args, **kwargs)
        if runner is None:
            return call()
        return runner.stage_backward(stage_id, call, "metadata", {"inputs": all_fwd_inputs})

    stage._compute_input_grads = compute
