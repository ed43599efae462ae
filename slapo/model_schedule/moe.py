"""The expert-parallel plan of a mixture-of-experts family: which module of a layer holds the
experts, and the one swap (`replace`) that spreads them over the mesh's "ep" ranks.

`apply` reads ep from the mesh (`init_mesh(dims=ParallelDims(..., ep=N))`: ep borrows
data-parallel ranks, docs/runtime.md), as it reads tp from the schedule's group, and never
takes it as a knob. With ep > 1 every layer's experts module (`MoEPlan.experts`, relative to
the layer; a layer without one, Qwen3-MoE's dense `mlp_only_layers`, is left alone) is
replaced by `op.moe.ExpertParallelExperts` holding this rank's E/ep experts. The router stays
HF's module, so routing and the auxiliary loss are HF's (docs/model_schedule.md).

Every check runs before the first swap (`check_expert_parallel`): a model without an MoE plan,
ep not dividing a layer's experts, an experts module in a layout this plan does not know (HF's
`use_experts_implementation` flags: concatenated gate/up, not transposed, no bias, no post-norm).
With tp > 1 the family's tensor-parallel plan leaves the experts to ep (`without_experts`).
With pipeline stages the experts are swapped before the cuts: a stage keeps the swapped
module, and its ep group is the dp ranks running the same stage, whose schedule (the same on
each) keeps their all-to-alls in step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule

# HF's experts-layout flags (`transformers.integrations.use_experts_implementation`) and the
# values `ExpertParallelExperts` computes with.
_LAYOUT = {"has_gate": True, "has_bias": False, "is_transposed": False,
           "is_concatenated": True, "has_post_expert_norm": False}


@dataclass(frozen=True)
class MoEPlan:
    """Where a family's experts live: `experts`, the path of the experts module relative to a
    layer (HF: "mlp.experts")."""

    experts: str = "mlp.experts"

    def modules(self, layers: list[Schedule]) -> list[Schedule]:
        """The experts modules of the layers that have one."""
        return [layer[self.experts] for layer in layers if self.experts in layer]


def check_expert_parallel(sch: Schedule, family, layers: list[Schedule]):
    """Every check of the mesh's ep against the model, before anything changes (module
    docstring). Returns the mesh's view (`runtime.mesh.MeshInfo`: `ep`, `ep_rank`, the "ep"
    group) when ep > 1, else None (no mesh, or ep=1: nothing to do)."""
    from ..runtime.mesh import MeshInfo

    info = MeshInfo.of(sch.mesh) if sch.mesh is not None else None
    if info is None or info.ep == 1:
        return None
    ep = info.ep
    plan = getattr(family, "moe", None)
    if plan is None:
        from ._registry import _FAMILIES

        with_plan = sorted(f.name for f in _FAMILIES.values() if getattr(f, "moe", None))
        raise SchedulingError(sch.path, f"the mesh has ep={ep}, but family {family.name!r} has "
                              "no mixture-of-experts plan (no experts to spread); expert "
                              f"parallelism is built for the families {with_plan}.",
                              "use a mesh with ep=1 (slapo train: drop --ep; --tp splits a "
                              "declared model's experts), or give the Family a "
                              "moe=MoEPlan(...).")
    found = plan.modules(layers)
    if not found:
        raise SchedulingError(sch.path, f"ep={ep}: no layer of this model has experts at "
                              f"'{plan.experts}'.", "check the model, or use ep=1.")
    for node in found:
        _check_experts(node, ep)
    return info


def _check_experts(node: Schedule, ep: int) -> None:
    mod = node.mod
    params = dict(mod.named_parameters(recurse=False))
    if set(params) != {"gate_up_proj", "down_proj"} or any(p.dim() != 3
                                                           for p in params.values()):
        raise SchedulingError(node.path, f"expert parallelism expects HF's fused experts "
                              f"(3-D gate_up_proj and down_proj), found {sorted(params)}.",
                              "schedule this experts layout by hand, or use ep=1.")
    wrong = {k: getattr(mod, k) for k, v in _LAYOUT.items() if getattr(mod, k, v) != v}
    if wrong:
        raise SchedulingError(node.path, f"expert parallelism computes HF's concatenated "
                              f"gate/up experts without bias; this module has {wrong}.",
                              "use ep=1 for this experts layout.")
    num = params["gate_up_proj"].shape[0]
    if num % ep:
        raise SchedulingError(node.path, f"ep={ep} does not divide the {num} experts of this "
                              "layer.", f"use an ep that divides {num}.")


def without_experts(family):
    """`family` whose tensor-parallel plan leaves the experts to expert parallelism: the rows
    at or under its experts module dropped (expert TP, `plan_experts.Experts`, would split
    each expert's FFN over tp, which the experts ep then holds are not). Under ep x tp every
    tp rank of an ep group runs its experts whole on the same tokens (the attention's row
    projection already all-reduced them), the all-to-all runs among the ranks of one tp index
    (`MeshInfo.group("ep")`), so the experts' input gradient is whole on every tp rank, as the
    router's, and the shared experts keep their rows (each projection reduces its own input
    gradient)."""
    import dataclasses

    plan = family.tp_plan
    if plan is None or not hasattr(plan, "entries"):
        return family
    at = family.moe.experts
    rows = tuple(r for r in plan.entries
                 if not (r[0].rstrip("?") == at or r[0].rstrip("?").startswith(at + ".")))
    return dataclasses.replace(family, tp_plan=dataclasses.replace(plan, entries=rows))


def expert_parallel(family, layers: list[Schedule], info, root: nn.Module | None = None) -> None:
    """Replace every layer's experts by this rank's share of them (`info`: what
    `check_expert_parallel` returned), and keep `root`'s `generate` in step over the ranks
    (`generate_in_step`)."""
    from ..op.moe import ExpertParallelExperts

    for node in family.moe.modules(layers):
        node.replace(ExpertParallelExperts(node.mod, info.group("ep"), info.ep, info.ep_rank))
    if root is not None:
        generate_in_step(root)


def generate_in_step(root: nn.Module) -> None:
    """Every forward of an ep model is an all-to-all among the ep ranks, each with its own
    prompts: `generate` on a rank whose sequences all hit EOS first would return while the
    others wait in their next all-to-all (a hang, then gloo's timeout). HF's `generate` keeps
    ranks in step (`synced_gpus`: a finished rank runs dummy forwards until every rank is done)
    by itself for a module that FSDP manages, which it reads from `_is_fsdp_managed_module`;
    an ep model needs the same, so the flag is set on the model. transformers 5.24 reads it
    in `generate` (and `Seq2SeqTrainer`'s generation) and, beyond that, only in its Trainer for
    a model it loaded sharded itself; a call passing `synced_gpus=False` still decides."""
    root._is_fsdp_managed_module = True
