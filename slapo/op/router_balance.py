"""An MoE model's load-balancing loss under context parallelism: HF's statistics, summed over
the cp ranks.

HF's Mixtral and Qwen3-MoE add `router_aux_loss_coef * load_balancing_loss_func(router
logits, ...)` to their loss (`output_router_logits=True`): `E * sum_e f_e * P_e`, with `f_e` the
share of the (token, top-k slot) pairs routed to expert `e` and `P_e` the mean router
probability of `e`, both over the forward's (unpadded) tokens. On a cp rank that forward sees
its chunks of each sequence only, so its statistics are not the sequence's. Here the numerators
and the token count of every layer are summed over the cp ranks (one all-reduce of 2E + 1
numbers per forward) before the ratio, so every cp rank holds the aux loss one process computes
on the same samples. The all-reduce's backward is an all-reduce too (each rank's loss uses the
sum), so the router of every rank gets its share of the one-process gradient.

Which rows count: the cp batch's own-token flags (`op.context_parallel.KEY_VALID`, this rank's
row of every rank's flags: the batch's attention mask and the split's padding), as HF's
function counts the attention mask's tokens. Float32 statistics, as HF's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..distributed.collectives import reduce_backward, reduce_forward
from ..module_patch import ForwardWrapper
from .context_parallel import KEY_VALID


def router_stats(router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
                 num_experts: int, top_k: int, valid: torch.Tensor | None) -> torch.Tensor:
    """The sums HF's `load_balancing_loss_func` divides, as one (2E + 1,) float32 tensor:
    per expert the (token, top-k slot) pairs routed to it, per expert the summed router
    probability (the differentiable part), and the number of rows counted, over every layer
    of `router_logits` (one (rows, E) tensor per layer). `valid`: (rows,) flags of the rows
    that count (HF's attention mask), None for all. Sums, so the statistics of disjoint
    layer sets (pipeline stages) or token sets (cp ranks) add up to the whole's."""
    device = router_logits[0].device
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        mask = torch.ones(logits.shape[0], dtype=torch.float32, device=device) if valid is None \
            else valid.reshape(-1).to(device=device, dtype=torch.float32)
        weights = F.softmax(logits.to(device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        tokens = tokens + torch.zeros_like(tokens).scatter_add_(
            0, chosen, mask.repeat_interleave(top_k))
        probs = probs + (weights.float() * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    return torch.cat([tokens, probs, rows[None]])


def stats_loss(stats: torch.Tensor, num_experts: int) -> torch.Tensor:
    """HF's load-balancing loss from `router_stats` sums: `E * sum_e f_e * P_e`."""
    tokens, probs, rows = stats[:num_experts], stats[num_experts:-1], stats[-1]
    return (tokens / rows * (probs / rows)).sum() * num_experts


def balance_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                 valid: torch.Tensor, group) -> torch.Tensor:
    """HF's `load_balancing_loss_func` over the rows of every rank of `group`: `router_logits`
    one (rows, E) tensor per layer, `valid` (rows,) this rank's flags of the rows that count."""
    stats = router_stats(router_logits, num_experts, top_k, valid)
    stats = reduce_forward(reduce_backward(stats, group), group)  # sum; backward: sum too
    return stats_loss(stats, num_experts)


def router_counts(config) -> tuple[int, int] | None:
    """(experts, top-k) of an HF MoE config whose loss adds the load-balancing loss."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    return (experts, top_k) if experts and top_k else None


class ContextParallelBalance(ForwardWrapper):
    """The root model's forward with its load-balancing loss taken over the cp ranks (module
    docstring): HF's own (this rank's statistics) is taken out of the loss and `coef * aux /
    replicas` put in, `aux` the cp ranks' loss. Divided by `replicas` (the dp x cp ranks),
    because the step sums the units of all of them (`token_mean.GlobalSum`): the cp ranks of
    one sample add up to one `coef * aux`, as one process has, and the dp ranks average their
    samples' losses, as without cp (docs/model_schedule.md: per-micro-batch statistics)."""

    name = "cp_router_balance"

    def __init__(self, group, replicas: int, num_experts: int, top_k: int, coef: float):
        self.group, self.replicas = group, replicas
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef

    def __call__(self, module, fn, args: tuple, kwargs: dict) -> Any:
        flags = kwargs.get(KEY_VALID)
        if flags is None or kwargs.get("labels") is None:
            return fn(*args, **kwargs)  # no cp batch or no loss: nothing to correct
        out = fn(*args, **{**kwargs, "output_router_logits": True})
        own = flags[:, dist.get_rank(self.group), :]
        aux = balance_loss(out.router_logits, self.num_experts, self.top_k, own, self.group)
        local = out.aux_loss.to(out.loss.device)
        out.loss = out.loss - self.coef * local + self.coef * aux.to(out.loss) / self.replicas
        out.aux_loss = aux
        return out


__all__ = ["ContextParallelBalance", "balance_loss", "router_counts", "router_stats", "stats_loss"]
