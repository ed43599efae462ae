"""The pipeline's cross-rank failure protocol: a failure on one rank is recorded, stand-ins keep
the schedule running to its end, and one all-reduced flag makes every rank raise.

Errors: what fails on one rank only (preparing the first stage's inputs; a stage's forward; the
loss, e.g. a user `loss_fn` bug or a stage without a loss of its own; a stage's backward, e.g. a
custom autograd Function or a NaN-check hook raising, or out of memory) is recorded, the schedule
runs to its end, and one all-reduced flag makes every rank raise (`raise_on_every_rank`): the
rank of the first failure in pipeline order its own exception, the others a `SchedulingError`
naming that rank, its message and the stage (`(stage 1 backward)`), and no rank takes an
optimizer step. A stage whose forward
raised (or that runs after a failure on its rank) returns zeros shaped like its last good
output, connected to its inputs (`fallback_output`), so its peers receive what they wait for and the
schedule ends promptly instead of at the collective timeout. Downstream stages then compute on
zeros and may fail in turn; those are secondary and reported after the first. If a stage fails
on its very first forward there is no good output yet: the zeros take the shape of its first
input, so the shapes torch infers on that first step are wrong and the model must be rebuilt
(`slapo.build`) before another step; after a later failure the pipeline can step again.

A stage whose backward raised (or that runs a backward after a failure on its rank) skips it
and hands torch zero gradients for its inputs (`zero_input_grads`), which the schedule sends
upstream as it would the real ones, so every rank's schedule ends within the step for every
schedule (GPipe, 1F1B, the interleaved, looped and zero-bubble ones, whose split input/weight
backwards go through the same guarded call, `guard_stage_backward`). Its forwards for the
rest of the step return `fallback_output` zeros, as after a forward failure. A backward failure
leaves no stale state (the next step zeroes the gradients and re-infers nothing), so the same
pipeline can step again, on the first step too.

Not so under FSDP2 over more than one data-parallel rank, nor under tensor parallelism: a
stage's replicas all-gather its parameters in every forward and backward, and a TP-sharded
stage's blocks all-reduce with their tp peers, together, and a stage that skipped the rest of
its step would leave them waiting (a backward failing on one tp rank hung the job until the
collective timeout). There a stage's error is raised at once on its rank
(`PipelineRunner._replicas_in_lockstep`) and the job stops: under torchrun the failing process
exits and the launcher stops the others; `slapo train --resume` continues from the newest
checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import SchedulingError
from .mesh import MeshInfo

# Error order inside one step: preparing < stage 0 forward < ... < last stage < the loss <
# last stage backward < ... < stage 0 backward (`backward_order`).
PREPARE_ORDER = -1


def collective_device(info: MeshInfo) -> torch.device:
    """Where a flag all-reduced over the mesh lives: this rank's device (`MeshInfo.device`)."""
    return info.device



def _error_group(info: MeshInfo):
    """Every rank that runs this train_step: the whole job when the mesh spans it (a failure
    on one data-parallel replica must stop the others before their gradient all-reduce),
    else the pipeline group."""
    if info.mesh is not None and info.mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return info.group("pp")


def raise_on_every_rank(error: BaseException | None, info: MeshInfo, where: str,
                        order: int = 0, phase: str | None = None) -> None:
    """One all-reduced flag: if any rank failed, every rank raises. The first failure in
    pipeline order (`order`, then rank) is the cause: its rank raises its own exception (with
    a note naming the `phase`, e.g. "stage 1 backward"), every other rank a `SchedulingError`
    naming that rank, its message and the phase (then any later failures, e.g. a downstream
    stage that choked on the zeros it was sent)."""
    group = _error_group(info)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=collective_device(info))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}" + \
        (f" ({phase})" if phase else "")
    msgs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(msgs, (order, dist.get_rank(), mine), group=group)
    failed = sorted((o, r, m) for o, r, m in msgs if m is not None)
    first_rank = failed[0][1]
    if error is not None and first_rank == dist.get_rank():
        if phase and hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"slapo: raised in pipeline {phase} on rank {first_rank}; every "
                           "rank stopped this step (no optimizer step was taken).")
        raise error
    detail = "; ".join(f"rank {r}: {m}" for _, r, m in failed)
    raise SchedulingError("", f"the pipeline train_step failed on rank {first_rank} while "
                          f"{where}: {detail}", "fix the error reported by that rank; every "
                          "rank stopped this step (no optimizer step was taken).")



def unwrap_stage_error(error: BaseException) -> BaseException:
    """torch wraps an exception in a stage's full backward in a `RuntimeError("Failed to run
    stage backward: ...")` that lists the stage's tensors; the user's own exception (e.g. the
    ValueError their autograd Function raised) is its cause, and is what every rank reports."""
    while isinstance(error, RuntimeError) and error.__cause__ is not None and \
            "Failed to run stage backward" in str(error):
        error = error.__cause__
    return error


def zero_input_grads(kind: str, bwd_kwargs: dict) -> tuple:
    """What `backward_maybe_with_nosync` returns, as if every input gradient were zero:
    (input grads, param groups) for "full" and "input"; nothing for "weight" (whose result
    torch ignores); for "metadata" (`guard_metadata_backward`), None per input. Zeros (dense, contiguous: gloo sends only those) for each input tensor that
    requires grad, None for the others, as torch's own `stage_backward` gives."""
    if kind == "weight":
        return (), None
    if kind == "metadata":  # `_compute_input_grads`: None per input, shapes derived by torch
        return tuple(None for _ in bwd_kwargs["inputs"])
    grads = tuple(torch.zeros_like(v, memory_format=torch.contiguous_format)
                  if isinstance(v, torch.Tensor) and v.requires_grad else None
                  for v in bwd_kwargs.get("input_values", ()))
    return grads, None



def zero_loss(output: Any) -> torch.Tensor:
    """A zero loss connected to the stage's output, so the schedule's backward still runs (and
    sends zero gradients upstream) after a failed loss."""
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        return torch.zeros((), requires_grad=True)
    return sum(t.sum() for t in tensors) * 0.0



# ------------------------------------------------------------------------------------------------
# a failed stage's stand-in output
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Slot:
    """Shape and dtype of one output tensor (enough to send a stand-in)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def output_template(out: Any) -> Any:
    """The structure of a stage output: tensors as `_Slot`s, tuples/lists kept, others as is."""
    if isinstance(out, torch.Tensor):
        return _Slot(tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return type(out)(output_template(o) for o in out)
    return out


def fallback_output(template: Any, args: tuple) -> Any:
    """Zeros with the template's structure (or, with none yet, shaped like the first tensor
    input, in the default float dtype), on the inputs' device, requiring grad when grad is on
    and connected to every float input that requires grad, so the backward runs and sends zero
    gradients upstream."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if template is None:
        shape = tuple(tensors[0].shape) if tensors else ()
        template = _Slot(shape, torch.get_default_dtype())
    grad = torch.is_grad_enabled()
    links = [a for a in tensors if a.is_floating_point() and a.requires_grad and grad]
    zero = torch.zeros((), device=device, requires_grad=grad and not links)
    # where(False, x, 0) is 0 even when x holds inf or NaN; `mul(0)` makes the gradient sent
    # upstream a dense (contiguous) zero tensor, as gloo's send requires
    anchor = torch.where(torch.zeros((), dtype=torch.bool, device=device),
                         sum(a.mul(0.0).sum() for a in links), zero) if links else zero
    return _zeros_like(template, device, anchor if grad else None)


def _zeros_like(template: Any, device: torch.device, anchor: torch.Tensor | None) -> Any:
    if isinstance(template, _Slot):
        z = torch.zeros(template.shape, dtype=template.dtype, device=device)
        if anchor is not None and template.dtype.is_floating_point:
            z = z + anchor.to(template.dtype)
        return z
    if isinstance(template, (tuple, list)):
        return type(template)(_zeros_like(t, device, anchor) for t in template)
    return template
