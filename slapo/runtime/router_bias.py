"""DeepSeek-V3's auxiliary-loss-free load balancing, as part of the optimizer step.

DeepSeek-V3 routes each token by `sigmoid(scores) + e_score_correction_bias` (the bias only
chooses the experts; the gating weights are the unbiased scores) and trains without an
auxiliary loss: at the end of each step every expert's bias moves by a fixed `rate` towards
balance, down if the expert received more than the mean load of the step, up if fewer
(DeepSeek-V3 report, section 2.1.2: `gamma` = 0.001 for most of its pre-training). HF's model
has the buffer but never updates it, so a DeepSeek-V3 trained through HF's forward alone has
no load balancing at all.

`RouterBiasBalance(model, rate, group)` counts, with forward hooks on every router that holds
the buffer, the top-k assignments of the training forwards (on the device, no host sync; not
the recomputation of activation checkpointing, not evaluation, not a pipeline's first-step
shape inference), and `attach(optimizer)` registers a step post-hook that, after each
optimizer step: sums the counts over `group` (the data-parallel ranks, so every rank applies
the same update to its replicated buffer: one all-reduce of layers x experts numbers),
computes `delta = rate * sign(mean_e(load) - load_e)`, centres it (its mean removed: adding
one constant to every expert changes no choice, so the biases are kept from drifting, as
torchtitan does), adds it to the bias, and resets the counts. Under gradient accumulation the
counts of every micro-step add up to the step's. Pipeline stages each update their own
layers' routers (no sum over pp). Expert parallelism does not change it (the routers are
replicated; the counts are of the router's choices, before dispatch).

Which routers: a module with a float `e_score_correction_bias` buffer of E entries whose
forward returns a tuple holding the (tokens, k) integer top-k indices (DeepSeek-V3, GLM-4-MoE
and the other DeepSeek-style routers of transformers 5.24); none found is an error.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from .pipeline_guards import inferring

BIAS = "e_score_correction_bias"


def _in_backward_or_inference() -> bool:
    return torch._C._current_graph_task_id() != -1 or inferring()


def bias_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, router) of every module holding the correction bias as its own buffer."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m._buffers.get(BIAS), torch.Tensor) and m._buffers[BIAS].dim() == 1]


def _indices(output: Any, experts: int) -> torch.Tensor | None:
    """The (tokens, k) top-k expert indices in a router's output tuple."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for t in reversed(items):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() == 2:
            return t
    return None


class RouterBiasBalance:
    """The counters and the update (module docstring)."""

    def __init__(self, model: nn.Module, rate: float, group=None):
        if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0):
            raise SchedulingError("", f"router bias rate={rate!r} must be a positive number.",
                                  "pass e.g. rate=0.001 (DeepSeek-V3's).")
        routers = bias_routers(model)
        if not routers:
            raise SchedulingError("", f"{type(model).__name__} has no router with an "
                                  f"`{BIAS}` buffer, so there is no bias to balance.",
                                  "use it on DeepSeek-V3-style models (sigmoid routing with a "
                                  "correction bias), or train without it.")
        self.rate, self.group = float(rate), group
        self.paths = [p for p, _ in routers]
        self.routers = [m for _, m in routers]
        experts = {m._buffers[BIAS].numel() for m in self.routers}
        if len(experts) != 1:
            raise SchedulingError(self.paths[0], f"the routers' biases have different sizes "
                                  f"{sorted(experts)}.", "balance one model at a time.")
        self.num_experts = experts.pop()
        device = self.routers[0]._buffers[BIAS].device
        self.counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64,
                                  device=device)
        self._handles = [m.register_forward_hook(self._count(i))
                         for i, m in enumerate(self.routers)]

    def _count(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not module.training or _in_backward_or_inference():
                return
            index = _indices(output, self.num_experts)
            if index is None:
                raise SchedulingError(self.paths[layer], "the router's output holds no "
                                      "(tokens, k) integer top-k indices to count.",
                                      "use a DeepSeek-style router, or train without the bias "
                                      "update.")
            flat = index.reshape(-1).to(self.counts.device)
            self.counts[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        return hook

    def attach(self, optimizer: torch.optim.Optimizer) -> RouterBiasBalance:
        """Update the biases after every step of `optimizer` (a step post-hook)."""
        self._handles.append(optimizer.register_step_post_hook(lambda *a, **k: self.update()))
        return self

    @torch.no_grad()
    def update(self) -> torch.Tensor:
        """One update from the counts since the last (summed over `group`); returns the
        global counts [routers, experts] it used."""
        counts = self.counts.clone()
        if self.group is not None and dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        self.counts.zero_()
        delta = self.rate * torch.sign(counts.mean(dim=1, keepdim=True) - counts)
        delta = delta - delta.mean(dim=1, keepdim=True)
        for router, d in zip(self.routers, delta, strict=True):
            bias = router._buffers[BIAS]
            bias.add_(d.to(device=bias.device, dtype=bias.dtype))
        return counts

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["RouterBiasBalance", "bias_routers"]
