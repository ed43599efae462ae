"""A mixture of experts' load-balancing loss through pipeline stages.

HF's MoE causal LMs (Mixtral, Qwen3-MoE, GPT-OSS, ...) add `router_aux_loss_coef *
load_balancing_loss_func(router logits of every layer, ...)` to their loss when
`config.output_router_logits` is set. That function concatenates the layers: it is
`E * sum_e f_e * P_e` with `f_e` and `P_e` means over *every* layer's (token, slot) pairs, not a
sum of per-layer terms, so no stage can compute its share alone.

What travels instead: the sums the function divides (`op.router_balance.router_stats`, 2E + 1
numbers per micro-batch: the pairs routed to each expert, each expert's summed probability,
the rows counted). Each stage records its layers' router logits (forward hooks on the router
class HF itself records, `_can_record_outputs["router_logits"]`), adds its sums to the ones it
received, and sends them on beside the hidden states; the last stage computes the loss from
the whole model's sums and the runner adds `coef * aux` to the micro-batch's loss, as HF's
forward does. The probabilities' sum carries the gradient: the next stage's gradient of the
sums flows back into each stage's router, exactly as through HF's concatenation. Per
micro-batch statistics, as HF computes them for each micro-batch of gradient accumulation
(docs/model_schedule.md).

Which model types: those whose `Between` row says `router=True` (their causal LM calls the
shared `load_balancing_loss_func` with `num_experts`, `num_experts_per_tok` and the attention
mask), each proven by `tests/test_pipeline_router.py` against one process. Others keep the
refusal (`stages_declared._ROUTER`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import SchedulingError
from ..op.router_balance import router_stats, stats_loss


@dataclass(frozen=True)
class RouterAux:
    """What a stage needs to carry a model's load-balancing statistics."""

    num_experts: int
    top_k: int
    coef: float
    target: type  # the router class HF records (`OutputRecorder.target_class`)
    index: int  # which of its outputs are the logits
    layer_name: str | None = None  # HF's optional name filter for the recorded modules

    def loss(self, stats: torch.Tensor) -> torch.Tensor:
        """HF's load-balancing loss (before the coefficient) from the summed statistics."""
        return stats_loss(stats, self.num_experts)


def router_aux(root: nn.Module, router: bool) -> RouterAux | None:
    """The model's `RouterAux` when its loss adds the load-balancing loss
    (`config.output_router_logits`) and its stages may compute it (`router`: its `Between`
    row); None when the flag is off."""
    if not router or not getattr(root.config, "output_router_logits", False):
        return None
    rec = getattr(root, "_can_record_outputs", None) or {}
    rec = rec.get("router_logits")
    experts = getattr(root, "num_experts", None)
    top_k = getattr(root, "num_experts_per_tok", None)
    coef = getattr(root, "router_aux_loss_coef", None)
    if rec is None or not isinstance(experts, int) or not isinstance(top_k, int) or coef is None:
        raise SchedulingError("", f"{type(root).__name__} sets output_router_logits, but it "
                              "does not record router logits, or lacks num_experts, "
                              "num_experts_per_tok or router_aux_loss_coef, which the pipeline "
                              "stages read to compute its load-balancing loss.",
                              "set config.output_router_logits = False, or train without "
                              "pp_stages.")
    return RouterAux(experts, top_k, float(coef), rec.target_class, rec.index, rec.layer_name)


def _in_backward() -> bool:
    """A forward inside the backward: activation checkpointing's recomputation, whose router
    outputs the forward already recorded."""
    return torch._C._current_graph_task_id() != -1


def router_modules(modules: list[nn.Module], aux: RouterAux) -> list[nn.Module]:
    """The routers HF records below `modules` (found once, when the stage is built)."""
    return [m for top in modules for name, m in top.named_modules()
            if isinstance(m, aux.target) and (aux.layer_name is None or
                                               name.endswith(aux.layer_name))]


@contextmanager
def record_router(routers: list[nn.Module], aux: RouterAux) -> Iterator[list[torch.Tensor]]:
    """The router logits of `routers`' forwards inside the block, in call order."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple, output) -> None:
        if _in_backward():
            return
        seen.append(output[aux.index] if isinstance(output, (tuple, list)) else output)

    handles = [m.register_forward_hook(hook) for m in routers]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def stage_stats(aux: RouterAux, logits: list[torch.Tensor], attention_mask: torch.Tensor | None,
                carried: tuple, device: torch.device) -> torch.Tensor:
    """This stage's sums added to those received from the stage before (`carried`)."""
    if logits:
        own = router_stats(logits, aux.num_experts, aux.top_k, attention_mask)
    else:  # a stage of dense layers only (DeepSeek's first layers): nothing to add
        own = torch.zeros(2 * aux.num_experts + 1, dtype=torch.float32, device=device)
    if carried:
        own = own + carried[0].to(own.device)
    return own


__all__ = ["RouterAux", "record_router", "router_aux", "router_modules", "stage_stats"]
