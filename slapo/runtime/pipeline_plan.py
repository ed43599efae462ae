"""Which pipeline schedule, how many stages, which stages on each rank: the `PipelinePlan`.

`plan_pipeline` validates the pipeline arguments against the mesh (the same checks and errors on
every rank), `check_cuts` the schedule's stage boundaries against the plan, and `make_schedule`
builds torch's schedule over this rank's stages (gradient scaling left to the runner's loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import SchedulingError
from .mesh import PP_SCHEDULES, V_SCHEDULES, MeshInfo, stages_per_rank


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule class and the stage layout, identical on every rank."""

    schedule_cls: type
    name: str
    pp: int
    virtual_stages: int
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def multi(self) -> bool:
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        return issubclass(self.schedule_cls, PipelineScheduleMulti)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages rank `pp_rank` runs, in its local order."""
        if self.name in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.virtual_stages)]

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stage_ids(r))


def plan_pipeline(name: str, info: MeshInfo, num_microbatches: int | None,
                  virtual_stages: int | None) -> PipelinePlan:
    """Validate the pipeline arguments against the mesh (same checks, same errors, every rank)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    try:
        cls = get_schedule_class(name)
    except ValueError as e:
        raise SchedulingError("", f"unknown pipeline schedule {name!r}.",
                              f"{e}".split(". ", 1)[-1]) from None
    canonical = next(k for k in (*PP_SCHEDULES, "PipelineScheduleSingle",
                                 "PipelineScheduleMulti") if k.lower() == name.lower())
    if info.mesh is None or info.pp < 2:
        raise SchedulingError("", f"pipeline={name!r} needs a mesh with pp >= 2 (got pp="
                              f"{info.pp}).", "create the schedule with "
                              "mesh=slapo.init_mesh(pp=2, ...).")
    multi = issubclass(cls, PipelineScheduleMulti)
    if virtual_stages is None:
        # the declared default (`mesh.stages_per_rank`), else by torch's kind of schedule
        virtual_stages = stages_per_rank(canonical) if canonical in PP_SCHEDULES else \
            (2 if multi else 1)
    if not multi and virtual_stages != 1:
        raise SchedulingError("", f"{canonical} runs one stage per rank, but virtual_stages="
                              f"{virtual_stages}.", "use virtual_stages=1, or a multi-stage "
                              "schedule such as 'Interleaved1F1B'.")
    if canonical in V_SCHEDULES and virtual_stages != 2:
        raise SchedulingError("", f"{canonical} needs exactly 2 stages per rank (V shape), got "
                              f"virtual_stages={virtual_stages}.", "use virtual_stages=2.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise SchedulingError("", f"virtual_stages={virtual_stages!r} must be a positive int.")
    if num_microbatches is None:
        num_microbatches = info.pp * virtual_stages
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SchedulingError("", f"num_microbatches={num_microbatches!r} must be a positive int.")
    if not multi and num_microbatches < info.pp:
        raise SchedulingError("", f"{canonical} with pp={info.pp} needs at least {info.pp} "
                              f"micro-batches, got {num_microbatches}.",
                              f"pass num_microbatches >= {info.pp}.")
    return PipelinePlan(cls, canonical, info.pp, virtual_stages, num_microbatches)




def pipeline_cuts(sch) -> list[str]:
    """The ordered stage boundaries recorded by `cut_pipeline_stage`."""
    return list(sch.pipeline_cuts)


def check_cuts(sch, plan: PipelinePlan) -> list[str]:
    cuts = pipeline_cuts(sch)
    if len(cuts) + 1 != plan.num_stages:
        raise SchedulingError(
            sch.path, f"the schedule has {len(cuts)} pipeline cut(s), i.e. {len(cuts) + 1} "
            f"stage(s), but pipeline={plan.name!r} with pp={plan.pp} and virtual_stages="
            f"{plan.virtual_stages} needs {plan.num_stages} stages.",
            f"call cut_pipeline_stage() on exactly {plan.num_stages - 1} module(s) "
            f"(or change pp / virtual_stages).")
    return cuts



def make_schedule(stages: list, plan: PipelinePlan, loss: Callable):
    """The torch schedule over this rank's stages; gradient scaling is left to our loss."""
    arg = stages if plan.multi else stages[0]
    try:
        return plan.schedule_cls(arg, n_microbatches=plan.num_microbatches, loss_fn=loss,
                                 scale_grads=False)
    except ValueError as e:
        raise SchedulingError("", f"pipeline={plan.name!r} rejected num_microbatches="
                              f"{plan.num_microbatches} with pp={plan.pp}: {e}",
                              "choose a number of micro-batches the schedule accepts "
                              "(e.g. a multiple of pp).") from None
