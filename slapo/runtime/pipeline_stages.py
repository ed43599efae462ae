"""A pipeline's plan and its stage modules, made once per build: `PipelineStages`.

`slapo train` needs this rank's stages before building (it reads only their pretrained
tensors), and `build` runs them; planning (`plan_pipeline`, the cuts, `partition`, the coverage
and split-backward checks) happens once, here, and the result is handed to `build(pipeline=)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule
from .mesh import MeshInfo
from .partition import check_stage_coverage, partition
from .pipeline_plan import PipelinePlan, check_cuts, plan_pipeline
from .split_backward import check_split_backward


@dataclass(frozen=True)
class PipelineStages:
    """A pipeline's plan (schedule, stages per rank, micro-batches) and the schedule's stage
    modules, checked: what `build(pipeline=...)` runs. Made once per build: a caller that needs
    the stages before building (`slapo train` reads only this rank's stages' pretrained
    tensors) makes it with `plan_stages` and passes it as `build(pipeline=stages)`, so the
    plan and the partition are not made twice."""

    sch: Schedule = field(repr=False)
    info: MeshInfo = field(repr=False)
    plan: PipelinePlan
    stages: list[nn.Module] = field(repr=False)

    def local_ids(self) -> list[int]:
        """The stages this rank runs."""
        return self.plan.stage_ids(self.info.pp_rank)


def plan(sch: Schedule, info: MeshInfo, pipeline: str, num_microbatches,
                 virtual_stages) -> PipelineStages:
    plan = plan_pipeline(pipeline, info, num_microbatches, virtual_stages)
    check_cuts(sch, plan)
    all_stages = partition(sch, plan.num_stages)
    check_stage_coverage(sch.mod, all_stages)  # every parameter trained, by exactly one stage
    check_split_backward(all_stages, plan)
    return PipelineStages(sch, info, plan, all_stages)


def check_planned(sch: Schedule, info: MeshInfo, staged: PipelineStages,
                   num_microbatches, virtual_stages) -> None:
    """A `PipelineStages` passed to `build` must be this schedule's, on this mesh, and the
    plan's own micro-batches and stages per rank (not a second, different copy)."""
    if staged.sch is not sch or staged.info.mesh is not info.mesh:
        raise SchedulingError(sch.path, "build(pipeline=stages): the stages were planned for "
                              "another schedule or mesh.", "plan them with plan_stages(sch, "
                              "mesh=mesh) for the schedule and mesh you build.")
    plan = staged.plan
    for name, given, planned in (("num_microbatches", num_microbatches, plan.num_microbatches),
                                 ("virtual_stages", virtual_stages, plan.virtual_stages)):
        if given is not None and given != planned:
            raise SchedulingError(sch.path, f"build(pipeline=stages, {name}={given}): the stages "
                                  f"were planned with {name}={planned}.",
                                  "pass it to plan_stages, not to build.")


def pipeline_name(pipeline: str | PipelineStages | None) -> str | None:
    """The schedule name of a `build(pipeline=...)` argument."""
    return pipeline.plan.name if isinstance(pipeline, PipelineStages) else pipeline


__all__ = ["PipelineStages", "check_planned", "pipeline_name", "plan"]
