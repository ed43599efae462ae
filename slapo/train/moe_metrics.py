"""What a mixture of experts' router did in a `slapo train` step: the tokens each expert
received, the load imbalance they make, and HF's auxiliary load-balancing loss.

Why in the run's log: an MoE run that trains but routes most tokens to a few experts wastes
the others (and, with `--ep`, leaves ranks idle while one works); the aux loss is what is
meant to prevent it, so the two are read together.

How it stays cheap: forward hooks count on the device, with no host sync (`index_add_` into
a [layers, experts] tensor; HF's router output is already there) and add up the aux loss each
forward returns. Once per step `step_stats` sums them over the data-parallel ranks in **one**
small all-reduce ((layers x experts + 2) numbers) and reads them to the host (the step's loss
is read to the host anyway). Counted: training forwards only (not the val loss's, not the
recomputation of activation checkpointing in the backward).

The numbers, per step, over the global batch:
- `tokens_per_expert`: [layer][expert] top-k assignments (a token counts once for each of its
  k experts; a layer's row sums to tokens x k), every rank and micro-batch summed;
- `load_imbalance`: max over experts / mean over experts of those counts, in the most
  imbalanced layer (1.0: perfectly even; E / k: every token on the same k experts);
- `aux_loss`: HF's `load_balancing_loss_func` as the model returned it (before
  `router_aux_loss_coef`), averaged over the step's units (micro-batches on every rank): the
  quantity the loss adds, per unit, times the coefficient (docs/train.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SlapoError
from ..runtime.pipeline_guards import inferring

__all__ = ["ExpertLoad", "watch_experts"]


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts module of every MoE layer, by the model's family's `MoEPlan` (none for a
    dense model or one no family covers)."""
    from ..model_schedule import _registry

    try:
        plan = _registry.detect(model).moe
    except SlapoError:
        return []
    if plan is None:
        return []
    return [m for n, m in model.named_modules() if n.endswith("." + plan.experts)]


def _in_backward() -> bool:
    """A forward run inside the backward (activation checkpointing's recomputation), or
    torch's first-step shape inference of a pipeline stage: not the step's forwards."""
    return torch._C._current_graph_task_id() != -1 or inferring()


class ExpertLoad:
    """The hooks and the step's counters (module docstring); `step_stats` reads and resets."""

    def __init__(self, model: nn.Module, experts: list[nn.Module], num_experts: int,
                 device: torch.device, last_stage: nn.Module | None = None):
        # one column more: HF's "no expert" index (E) some routers use, counted and dropped
        self.counts = torch.zeros(len(experts), num_experts + 1, dtype=torch.float64,
                                  device=device)
        self.aux = torch.zeros(2, dtype=torch.float64, device=device)  # sum, forwards
        self._handles = [m.register_forward_pre_hook(self._count(i), with_kwargs=True)
                         for i, m in enumerate(experts)]
        self._handles.append(model.register_forward_hook(self._add_aux))
        if getattr(last_stage, "router", None) is not None:  # a pipeline's last stage
            self._handles.append(last_stage.register_forward_hook(self._add_stage_aux))

    def _count(self, layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not module.training or _in_backward():
                return
            index = args[1] if len(args) > 1 else kwargs["top_k_index"]
            flat = index.reshape(-1)
            self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        return hook

    def _add_aux(self, module: nn.Module, args: tuple, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if not module.training or _in_backward() or not isinstance(aux, torch.Tensor):
            return
        self.aux[0] += aux.detach().double().to(self.aux.device)
        self.aux[1] += 1

    def _add_stage_aux(self, module: nn.Module, args: tuple, output: Any) -> None:
        """A pipeline's last stage returns (logits, the router's statistics summed over every
        stage): the micro-batch's aux loss is HF's function of them (`stage_router.py`). Not
        counted: torch's shape inference, evaluation, recomputation."""
        if not module.training or _in_backward() or not isinstance(output, tuple):
            return
        self.aux[0] += module.router.loss(output[1].detach()).double().to(self.aux.device)
        self.aux[1] += 1

    def step_stats(self, group=None, pp_group=None) -> dict[str, Any]:
        """The step's numbers (module docstring), summed over `group` (the data-parallel
        ranks; None: this process only) in one all-reduce, and over `pp_group` (a pipeline's
        stages, each counting its own layers, the last the aux loss) in another; then reset."""
        flat = torch.cat([self.aux, self.counts.reshape(-1)])
        if group is not None and dist.is_initialized():
            dist.all_reduce(flat, group=group)
        if pp_group is not None and dist.is_initialized():
            dist.all_reduce(flat, group=pp_group)
        flat = flat.cpu()
        self.counts.zero_()
        self.aux.zero_()
        counts = flat[2:].reshape(self.counts.shape)[:, :-1]
        routed = counts[counts.sum(dim=1) > 0]  # layers that ran here (all, but a stage's)
        imbalance = (routed.max(dim=1).values / routed.mean(dim=1)).max() if len(routed) \
            else torch.tensor(float("nan"))
        return {"aux_loss": float(flat[0] / flat[1]) if flat[1] > 0 else None,
                "load_imbalance": float(imbalance),
                "tokens_per_expert": counts.long().tolist()}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def watch_experts(model: nn.Module, device: torch.device,
                  last_stage: nn.Module | None = None) -> ExpertLoad | None:
    """An `ExpertLoad` on `model`'s MoE layers (the whole model's expert count, also where
    `--ep` holds a share of them), or None for a model without experts; `last_stage`: a
    pipeline's last stage when this rank holds it (its outputs carry the aux loss)."""
    experts = _experts_modules(model)
    if not experts:
        return None
    first = experts[0]  # HF's experts and ExpertParallelExperts both know the whole count
    num = getattr(first, "num_experts", None)
    if not isinstance(num, int):
        return None
    return ExpertLoad(model, experts, num, device, last_stage)
