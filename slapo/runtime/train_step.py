"""The arithmetic of one training step, shared by every `Trainer`: what `build` decided about
the step (`StepConfig`), the clipped gradient norm of the whole mesh (`clip_grad_norm` with
`NormWeights`, which `norm_weight_table` / `norm_weights` compute for what a rank holds), and
the step's loss on every rank (`reduce_loss`).

Why apart from `trainer.py`: `build` decides the `StepConfig` before any trainer exists and
the DeepSpeed target steps with it too; the norm and the loss reduction are functions of the
mesh and the gradients only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import sharding
from .mesh import MeshInfo
from .token_mean import ModelLoss

if TYPE_CHECKING:  # annotation only
    from .pipeline_tied import TiedWeights


@dataclass
class NormWeights:
    """How often each parameter's squared gradient norm is counted across the mesh, so that the
    clipped norm is the single-process one: `weights[i]` = 1 / (number of tp and pp ranks holding
    the same values of `params[i]`); `dp_sharded` when local values are disjoint over dp (FSDP2)."""

    params: list[nn.Parameter]
    weights: list[float]
    dp_sharded: bool = False
    # expert-parallel parameters (ids; `op.moe`): each ep rank holds other experts, so their
    # squared norms are summed over the ep group (`expert_group`) before the rest of the mesh
    experts: frozenset = frozenset()
    expert_group: object = None


def norm_weight_table(units: list[nn.Module], info: MeshInfo,
                      tied: TiedWeights | None = None) -> dict[tuple[int, str], float]:
    """(id(owning module), parameter name) -> weight of its squared norm (see NormWeights).

    Keyed by module and name, because FSDP2 replaces parameter objects but keeps modules."""
    table = {}
    for unit in units:
        for mod in unit.modules():
            for name, p in mod._parameters.items():
                if p is None:
                    continue
                spec = sharding.shard_spec(p)
                w = 1.0 if spec is not None and spec.world_size > 1 else 1.0 / info.tp
                if tied is not None:
                    w /= tied.holders.get((id(mod), name), 1)
                table[(id(mod), name)] = w
    return table


def norm_weights(root: nn.Module, table: dict, dp_sharded: bool) -> NormWeights:
    """The weights in the order of `root`'s unique parameters (after wrapping)."""
    from ..op.moe import expert_shard

    params, weights, seen, experts, group = [], [], set(), set(), None
    for mod in root.modules():
        for name, p in mod._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            params.append(p)
            weights.append(table.get((id(mod), name), 1.0))
            shard = expert_shard(p)
            if shard is not None and shard.ep > 1:
                experts.add(id(p))
                group = shard.group
    return NormWeights(params, weights, dp_sharded, frozenset(experts), group)


def clip_grad_norm(nw: NormWeights, max_norm: float, info: MeshInfo) -> torch.Tensor:
    """Scale gradients so that their global 2-norm is at most `max_norm`; return that norm.

    Weighted local squared norms are summed over tp, pp and (FSDP2) dp, so every rank computes
    the norm of the full single-process gradient and applies the same factor. Expert-parallel
    parameters (`nw.experts`) are first summed over their ep group (each rank holds other
    experts, their gradients already the data-parallel mean: `data_parallel.ExpertGradMean`):
    one more small all-reduce per step.
    """
    total = torch.zeros((), dtype=torch.float64, device=info.device)
    experts = torch.zeros((), dtype=torch.float64, device=info.device)
    grads = []
    for p, w in zip(nw.params, nw.weights, strict=True):
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads.append(g)
        sq = w * g.detach().double().pow(2).sum().to(total.device)
        if id(p) in nw.experts:
            experts += sq
        else:
            total += sq
    if nw.experts:  # every rank holds experts (the same model), so every rank joins
        dist.all_reduce(experts, group=nw.expert_group)
    # every expert once on each rank now; under FSDP2 the sum over dp below would count them
    # on each of its dp ranks
    total += experts / info.replicas if nw.dp_sharded else experts
    for dim in ("tp", "pp"):
        if getattr(info, dim) > 1:
            dist.all_reduce(total, group=info.group(dim))
    if nw.dp_sharded and info.replicas > 1:  # FSDP2 shards over dp (x cp)
        dist.all_reduce(total, group=info.replica_group())
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm.float()


def reduce_loss(loss: torch.Tensor, info: MeshInfo) -> float:
    """The step's loss on every rank: summed over pp (only the rank with the last stage has a
    non-zero value), averaged over dp (x cp: each cp rank's value is its tokens' share)."""
    value = loss.detach().double().reshape(1).to(info.device)
    if info.pp > 1:
        dist.all_reduce(value, group=info.group("pp"))
    if info.replicas > 1:
        dist.all_reduce(value, group=info.replica_group())
        value /= info.replicas
    return float(value.item())


@dataclass
class StepConfig:
    """What `build` decided about the step (see its docstring)."""

    info: MeshInfo
    grad_accum: int = 1
    grad_clip: float | None = None
    num_microbatches: int = 1
    batch_is_global: bool = True
    # what the step knows of the loss (label shift, `num_items_in_batch`, a user loss_fn):
    # `token_mean.ModelLoss`; the default, nothing known, keeps the mean over units
    loss: ModelLoss = ModelLoss()
    # context parallelism: the model's position rule (`context_parallel.position_rule`), when
    # its positions are not the tokens' indices
    cp_positions: Callable | None = None

    def units(self) -> int:
        """How many units (accumulation slices x micro-batches, on every dp x cp rank) one
        step's loss is made of."""
        return self.grad_accum * self.num_microbatches * self.info.replicas
