"""Expert tensor parallelism: every rank keeps 1/tp of *each* expert's FFN (a plan style).

Mixture-of-experts layers in transformers 5.x keep their experts as stacked 3-D tensors on one
module (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]; transposed [E, H, 2I] / [E, I, H]
where the class says `is_transposed`), decorated by `use_experts_implementation`, whose flags
say how the forward reads them. HF declares their TP as `moe_tp_experts` on the module plus
`packed_colwise`/`rowwise` on the tensors. `Experts` is that split, proven here instead of
assumed:

- `gate_up_proj` (or `up_proj` without a gate) keeps this rank's 1/tp of the intermediate
  features of every expert; a concatenated [gate; up] is split per block (each rank keeps its
  gate rows and the matching up rows), an interleaved [g0, u0, g1, u1, ...] contiguously (each
  chunk holds whole (g, u) pairs); `down_proj` keeps the same features on its input axis. Each
  rank computes a partial sum of every token's expert output, already weighted by the router
  (linear, so the weighted partials sum to the weighted whole), and the module's output is
  all-reduced: the block's one forward collective, as a `Row`.
- Backward: the gradients of both inputs the experts read are partial per rank, the hidden
  states' (Megatron f) and the routing weights' (each rank saw its features' share of each
  expert's output), so both are all-reduced (`sync("bwd_post", arg=...)`: `top_k_weights`, or
  GPT-OSS's `routing_weights`). The router then gets whole gradients on every rank, and with
  them the auxiliary load-balancing loss stays exact (reducing the router's parameter gradients
  instead would multiply that loss's part by tp).
- Biased experts (`has_bias`: GPT-OSS): the first projection's bias (`gate_up_proj_bias`
  [E, 2I], or `up_proj_bias`) is split exactly like the features it belongs to (same axis,
  same blocks: an interleaved one keeps its (gate, up) pairs together), and `down_proj_bias`
  [E, H] stays replicated but is added once in the all-reduced sum (`AddedOnce`: tp rank 0
  adds it, the others add zeros, and its gradient is summed over the group). HF's forward is
  left as it is, so the routing weights multiply the bias as HF applies them.

Refused, with the reason: a biased experts module without the bias tensors its flags promise,
a norm after each expert (it would normalise partial sums), an experts
module without the decorator's flags (its forward is not known to read the tensors as above;
`KNOWN_LAYOUTS` names the classes whose forward was read instead: Llama 4's) or without a
routing-weights input (but for a known layout whose router scaled its input), and sequence
parallelism.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from .. import module_patch
from ..distributed import collectives
from ..errors import SchedulingError
from ..primitives.reduce_param_grads import _reduced_names
from ..schedule import Schedule
from .plan import Style, _check_split

_FLAGS = ("is_transposed", "is_concatenated", "has_gate", "has_bias")
WEIGHTS = "top_k_weights"  # the routing weights' argument of an HF experts forward
# its names, in the order looked for: HF's interface name, and GPT-OSS's eager forward's
WEIGHTS_ARGS = (WEIGHTS, "routing_weights")
DOWN_BIAS = "down_proj_bias"
# Experts classes without the decorator whose forward was read (transformers 5.24), by class
# and module: their layout as the decorator's flags, and `scales_input` for a forward that takes
# no routing weights because the router scaled the tokens before it (its input's reduced
# gradient then carries the router's too). Llama 4's experts run every expert on every token
# row (`bmm` over [E, H, 2I] = [gate | up]).
KNOWN_LAYOUTS = {("transformers.models.llama4.modeling_llama4", "Llama4TextExperts"): dict(
    is_transposed=True, is_concatenated=True, has_gate=True, has_bias=False, scales_input=True)}


def _known_layout(mod) -> dict | None:
    return KNOWN_LAYOUTS.get((type(mod).__module__, type(mod).__name__))


def _takes_weights(mod) -> bool:
    """The forward takes the routing weights (whose gradient is then summed over the ranks)."""
    return not (_known_layout(mod) or {}).get("scales_input", False)


def _forward_args(mod) -> list[str]:
    try:
        return list(inspect.signature(mod.forward).parameters)
    except (TypeError, ValueError):
        return []


def weights_arg(mod) -> str | None:
    """The name of the routing weights' argument of the experts' forward, or None."""
    args = _forward_args(mod)
    return next((a for a in WEIGHTS_ARGS if a in args), None)


class _OnFirstRank(torch.autograd.Function):
    """Its input on the first rank of the group, zeros on the others; backward likewise (the
    others' gradient is zero: they did not add the tensor)."""

    @staticmethod
    def forward(ctx, x, first: bool):
        ctx.first = first
        return x.view_as(x) if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad if ctx.first else torch.zeros_like(grad)), None


class AddedOnce(module_patch.ForwardWrapper):
    """For the duration of the experts' forward, `down_proj_bias` is seen as itself on tp rank 0
    and as zeros on the other ranks, through `collectives.reduce_backward` (its gradient summed
    over the group). Each rank's output is then this rank's partial sum of every token's
    weighted expert output, rank 0's with the bias, so the all-reduced output holds the bias
    once, multiplied by the routing weight as HF's forward multiplies it.

    Why rank 0 and not the bias scaled by 1/tp on every rank: both need the gradient summed
    (the output's gradient is whole on every rank, so rank 0 alone, or each rank's 1/tp share,
    holds the bias's gradient), but only rank 0's is exact: its gradient is the one process's,
    summed with zeros, so every rank gets it bit for bit and the replicas never drift, while
    tp shares g/tp sum to g, and tp copies of b/tp to b in the forward, only up to roundoff in
    general. The parameter object and its state-dict key never change; recomputation under
    `checkpoint` re-enters the wrapper."""

    name = "expert_bias_once"

    def __init__(self, first: bool, group):
        self.first, self.group = first, group

    def __call__(self, module, fn, args: tuple, kwargs: dict):
        params = module._parameters
        saved = params[DOWN_BIAS]
        try:
            params[DOWN_BIAS] = _OnFirstRank.apply(collectives.reduce_backward(saved, self.group),
                                                   self.first)
            return fn(*args, **kwargs)
        finally:
            params[DOWN_BIAS] = saved


def expert_flags(mod) -> dict | None:
    """The `use_experts_implementation` flags of an experts module (or its known layout), or
    None without them."""
    if not all(isinstance(getattr(mod, f, None), bool) for f in _FLAGS):
        return _known_layout(mod)
    return {f: getattr(mod, f) for f in _FLAGS + ("has_post_expert_norm",)
            if isinstance(getattr(mod, f, None), bool)}


def _layout(flags: dict) -> tuple[str, int, int, int]:
    """(first projection's name, its intermediate axis, its blocks, down_proj's axis)."""
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    inter = 2 if flags["is_transposed"] else 1
    blocks = 2 if flags["has_gate"] and flags["is_concatenated"] else 1
    return first, inter, blocks, 1 if flags["is_transposed"] else 2


@dataclass(frozen=True)
class Experts(Style):
    """Each expert's FFN split over its intermediate features (see the module docstring)."""

    def effects(self, node, tp, sp):
        flags = expert_flags(node.mod) or {"has_gate": True, "is_transposed": False,
                                           "is_concatenated": True}
        first = _layout(flags)[0]
        weights = [("sync", "bwd_post", "all_reduce", weights_arg(node.mod) or WEIGHTS)] \
            if _takes_weights(node.mod) else []
        biases = [("shard", f"{first}_bias"), ("grads",)] \
            if flags.get("has_bias") else []
        return [("shard", first), ("shard", "down_proj"), *biases,
                ("sync", "bwd_post", "all_reduce"), *weights, ("sync", "fwd_post", "all_reduce")]

    def check(self, node: Schedule, tp: int, sp: bool) -> None:
        name = type(node.mod).__name__
        flags = expert_flags(node.mod)
        if flags is None:
            raise SchedulingError(node.path, f"{self}: {name} has no `use_experts_implementation` "
                                  "flags (is_transposed, is_concatenated, has_gate, has_bias), "
                                  "so how its forward reads the expert tensors is not known.",
                                  "use tp=1 for this model, or expert parallelism where its "
                                  "family has it (docs/model_schedule.md, Mixture of experts).")
        if flags.get("has_post_expert_norm"):
            raise SchedulingError(node.path, f"{self}: {name} normalises each expert's output, "
                                  "which would normalise this rank's partial sums.",
                                  "use tp=1 for this model.")
        if sp:
            raise SchedulingError(node.path, f"{self} has no sequence-parallel form.",
                                  "use sequence_parallel=False.")
        if weights_arg(node.mod) is None and _takes_weights(node.mod):
            raise SchedulingError(node.path, f"{self}: {name}.forward takes no routing weights "
                                  f"(none of {list(WEIGHTS_ARGS)}; it takes "
                                  f"{_forward_args(node.mod)}), so the routing weights' "
                                  "gradient cannot be summed over the ranks.",
                                  "use tp=1 for this model.")
        first, inter, blocks, down = _layout(flags)
        if flags["has_bias"]:
            self._check_biases(node, first, tp, blocks)
        _check_split(node, first, inter, tp, blocks, self)
        _check_split(node, "down_proj", down, tp, 1, self)
        shape = getattr(node.mod, first).shape
        if blocks == 1 and flags["has_gate"] and (shape[inter] // tp) % 2:
            raise SchedulingError(node.path, f"{self}: the interleaved {first} of shape "
                                  f"{tuple(shape)} splits into chunks of {shape[inter] // tp} "
                                  "rows, which would cut a (gate, up) pair.",
                                  "choose a tp that divides the intermediate size.")
        for t in (first, "down_proj"):
            if getattr(node.mod, t).dim() != 3:
                raise SchedulingError(node.path, f"{self}: {t} is not a stacked [experts, ., .] "
                                      "tensor.", "point the row at an HF experts module.")

    def _check_biases(self, node: Schedule, first: str, tp: int, blocks: int) -> None:
        """The biases the flags promise: the first projection's, [E, features] (split with its
        features), and `down_proj_bias`, [E, H], replicated, its gradient not summed yet."""
        name = type(node.mod).__name__
        bias = f"{first}_bias"
        missing = [b for b in (bias, DOWN_BIAS)
                   if not isinstance(node.mod._parameters.get(b), torch.nn.Parameter)]
        if missing:
            raise SchedulingError(node.path, f"{self}: {name} declares expert biases "
                                  f"(has_bias) but has no parameter {missing}: expert TP splits "
                                  f"{bias} with its features and adds {DOWN_BIAS} once, not "
                                  "once per rank, and needs both.",
                                  "use tp=1 for this model.")
        for b in (bias, DOWN_BIAS):
            if getattr(node.mod, b).dim() != 2:
                raise SchedulingError(node.path, f"{self}: {b} of shape "
                                      f"{tuple(getattr(node.mod, b).shape)} is not a stacked "
                                      "[experts, features] bias.", "use tp=1 for this model.")
        _check_split(node, bias, 1, tp, blocks, self)
        down = getattr(node.mod, DOWN_BIAS)
        if getattr(down, "_slapo_shard", None) is not None or \
                DOWN_BIAS in _reduced_names(node.mod) or \
                any(isinstance(w, AddedOnce) for w in module_patch.wrappers(node.mod)):
            raise SchedulingError(node.path, f"{self}: {DOWN_BIAS} is already sharded or its "
                                  "gradient already summed over the group.",
                                  "apply the experts' row once, on an unsharded module.")

    def apply(self, node: Schedule, tp: int, sp: bool) -> None:
        flags = expert_flags(node.mod)
        first, inter, blocks, down = _layout(flags)
        node.shard(first, axis=inter, blocks=blocks)
        node.shard("down_proj", axis=down)
        if flags["has_bias"]:  # split with its features; down_proj_bias: added once
            node.shard(f"{first}_bias", axis=1, blocks=blocks)
            module_patch.add_wrapper(node.mod, AddedOnce(node.tp_rank == 0, node.group))
            module_patch.module_meta(node.mod, create=True).setdefault(
                "reduced_grad_params", []).append(DOWN_BIAS)  # seen by reduce_param_grads
        if isinstance(node.mod.__dict__.get("intermediate_dim"), int):  # an eager forward's
            node.set_attr("intermediate_dim", node.mod.intermediate_dim // tp)
        node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        if _takes_weights(node.mod):  # else the router scaled the input: summed above
            node.sync(mode="bwd_post", sync_op_or_fn="all_reduce", arg=weights_arg(node.mod))
        node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


__all__ = ["AddedOnce", "Experts", "expert_flags", "weights_arg"]
