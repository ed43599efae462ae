"""Weights shared by pipeline stages on different pp ranks (e.g. GPT-2's tied embedding and LM
head): found once from the partition (`find_tied`), their gradients summed over pp each step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from .mesh import MeshInfo
from .pipeline_failures import collective_device
from .pipeline_plan import PipelinePlan


@dataclass
class TiedWeights:
    """Parameters used by stages on several pp ranks; their gradients are summed over pp.

    Weights are named by their owner (module, parameter name), not by the parameter object,
    because delayed init and FSDP2 replace parameter objects but keep the modules."""

    # (name, this rank's owner or None, shape, dtype) of each trainable tied weight
    entries: list[tuple[str, tuple[nn.Module, str] | None, torch.Size, torch.dtype]] = field(
        default_factory=list)
    holders: dict[tuple[int, str], int] = field(default_factory=dict)  # owner -> pp ranks

    def sync_grads(self, info: MeshInfo) -> None:
        """Every pp rank walks the same list; ranks without the weight add zeros."""
        for _, owner, shape, dtype in self.entries:
            p = owner[0]._parameters[owner[1]] if owner is not None else None
            local = _grad_local(p) if p is not None else None
            buf = local if local is not None else torch.zeros(shape, dtype=dtype,
                                                              device=collective_device(info))
            dist.all_reduce(buf, group=info.group("pp"))
            if p is not None and local is None:
                p.grad = buf


def _grad_local(p: nn.Parameter) -> torch.Tensor | None:
    if p.grad is None:
        return None
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad



def find_tied(all_stages: list[nn.Module], plan: PipelinePlan, pp_rank: int) -> TiedWeights:
    """Parameters that appear in stages of more than one pp rank, found by identity before any
    parameter is replaced; every rank computes the same list from the same cheap partition."""
    owners: dict[int, list[tuple[int, str, nn.Module, str]]] = {}
    params: dict[int, nn.Parameter] = {}
    for s, stage in enumerate(all_stages):
        for mpath, mod in stage.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((s, f"{mpath}.{pname}", mod, pname))
                    params[id(p)] = p
    tied = TiedWeights()
    mine = set(plan.stage_ids(pp_rank))
    for pid, own in owners.items():
        ranks = {plan.rank_of(s) for s, *_ in own}
        if len(ranks) < 2:
            continue
        for _, _, mod, pname in own:
            tied.holders[(id(mod), pname)] = len(ranks)
        p = params[pid]
        if not p.requires_grad:  # frozen (a LoRA base): no gradient to sum
            continue
        local = next(((mod, pname) for s, _, mod, pname in own if s in mine), None)
        name = min(f"stage{s}.{path}" for s, path, *_ in own)
        tied.entries.append((name, local, p.shape, p.dtype))
    tied.entries.sort(key=lambda e: e[0])
    return tied
