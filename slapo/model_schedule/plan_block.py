"""The cost model's view of a tensor-parallel plan: one rank of one block, built in one process.

Why apart from `plan.py`: the plan tables are what `model_schedule.apply` runs on a real group;
this file finds a block's family plan and applies that same table on a `VirtualGroup`, which only
the tuner's cost model (`slapo.tune.cost`) and its tests use.
"""

from __future__ import annotations

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import create_schedule
from .plan import TPPlan, check_tp_heads


def plan_for(block: nn.Module) -> TPPlan:
    """The registered family plan for a block, found from the HF model type its class comes from
    (`transformers.models.<type>.modeling_<type>`) or a submodule's `config.model_type`."""
    from ..module_patch import original_class
    from . import _registry

    own = _model_types([block], original_class)  # the block's own class decides first
    types = own | _model_types(list(block.modules()), original_class)
    for candidates in (own, types):
        for fam in _registry._FAMILIES.values():
            if candidates & {_norm(t) for t in fam.model_types} and fam.tp_plan is not None:
                return fam.tp_plan
    with_plans = sorted(f.name for f in _registry._FAMILIES.values() if f.tp_plan is not None)
    raise SchedulingError("", f"no tensor-parallel plan for {type(block).__name__} (model types "
                          f"{sorted(types) or 'unknown'}; families with a plan: "
                          f"{', '.join(with_plans)}).", "pass plan=TPPlan(...) for this block.")


def _norm(model_type: str) -> str:
    return model_type.replace("-", "_")


def _model_types(mods: list[nn.Module], original_class) -> set[str]:
    found = set()
    for mod in mods:
        parts = original_class(mod).__module__.split(".")
        if len(parts) > 2 and parts[:2] == ["transformers", "models"]:
            found.add(_norm(parts[2]))
        model_type = getattr(getattr(mod, "config", None), "model_type", None)
        if isinstance(model_type, str):
            found.add(_norm(model_type))
    return found


def shard_block(block: nn.Module, tp: int, rank: int = 0, plan: TPPlan | None = None, *,
                plan_at_tp1: bool = False) -> nn.Module:
    """A copy of `block` as rank `rank` of a `tp`-way tensor-parallel group runs it, built in
    this process by applying the family's plan (the one `model_schedule.apply` uses; `plan=`
    overrides) on a `VirtualGroup(tp, rank)`.

    For the cost model: it captures one rank's compute and saved activations. No data moves on
    a virtual group: all-reduces are the identity and gathers/scatters only reshape (see
    `slapo.distributed.collectives`), so the copy has one real rank's parameter shards, kernels
    (bias after the reduction) and activation sizes, but its outputs are one rank's partial
    values, not the model's. `tp=1` gives an unscheduled copy (the runtime does not shard), or
    with `plan_at_tp1=True` the plan applied on a group of one (same kernels as at tp > 1: a
    row-parallel bias is added after the identity reduction, as its own op)."""
    from ..distributed.group import VirtualGroup
    from ..runtime.mesh import check_degree
    from ..sharding import deepcopy_model

    check_degree("tp", tp)
    plan = plan if plan is not None else plan_for(block)
    out = deepcopy_model(block)
    if tp == 1 and not plan_at_tp1:
        return out
    sch = create_schedule(out, group=VirtualGroup(tp, rank))
    check_tp_heads(sch, tp)  # the model's heads (`apply` checks them in `TPPlan.validate`)
    plan.apply(sch, tp)
    return sch.mod


__all__ = ["plan_for", "shard_block"]
