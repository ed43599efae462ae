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
  expert's output), so both are all-reduced (`sync("bwd_post", arg=...)`). The router then gets
  whole gradients on every rank, and with them the auxiliary load-balancing loss stays exact
  (reducing the router's parameter gradients instead would multiply that loss's part by tp).

Refused, with the reason: experts with biases (`down_proj_bias` would be added once per rank
before the all-reduce), a norm after each expert (it would normalise partial sums), an experts
module without the decorator's flags (its forward is not known to read the tensors as above;
`KNOWN_LAYOUTS` names the classes whose forward was read instead: Llama 4's) or without a
`top_k_weights` input (but for a known layout whose router scaled its input), and sequence
parallelism.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..errors import SchedulingError
from ..schedule import Schedule
from .plan import Style, _check_split

_FLAGS = ("is_transposed", "is_concatenated", "has_gate", "has_bias")
WEIGHTS = "top_k_weights"  # the routing weights' argument of an HF experts forward
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
        weights = [("sync", "bwd_post", "all_reduce", WEIGHTS)] if _takes_weights(node.mod) else []
        return [("shard", first), ("shard", "down_proj"), ("sync", "bwd_post", "all_reduce"),
                *weights, ("sync", "fwd_post", "all_reduce")]

    def check(self, node: Schedule, tp: int, sp: bool) -> None:
        name = type(node.mod).__name__
        flags = expert_flags(node.mod)
        if flags is None:
            raise SchedulingError(node.path, f"{self}: {name} has no `use_experts_implementation` "
                                  "flags (is_transposed, is_concatenated, has_gate, has_bias), "
                                  "so how its forward reads the expert tensors is not known.",
                                  "use tp=1 for this model, or expert parallelism where its "
                                  "family has it (docs/model_schedule.md, Mixture of experts).")
        if flags["has_bias"]:
            raise SchedulingError(node.path, f"{self}: {name} has expert biases; down_proj_bias "
                                  "would be added once per rank before the all-reduce.",
                                  "use tp=1 for this model (expert TP of biased experts is not "
                                  "implemented).")
        if flags.get("has_post_expert_norm"):
            raise SchedulingError(node.path, f"{self}: {name} normalises each expert's output, "
                                  "which would normalise this rank's partial sums.",
                                  "use tp=1 for this model.")
        if sp:
            raise SchedulingError(node.path, f"{self} has no sequence-parallel form.",
                                  "use sequence_parallel=False.")
        try:
            args = list(inspect.signature(node.mod.forward).parameters)
        except (TypeError, ValueError):
            args = []
        if WEIGHTS not in args and _takes_weights(node.mod):
            raise SchedulingError(node.path, f"{self}: {name}.forward takes no {WEIGHTS!r} "
                                  f"(it takes {args}), so the routing weights' gradient cannot "
                                  "be summed over the ranks.", "use tp=1 for this model.")
        first, inter, blocks, down = _layout(flags)
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

    def apply(self, node: Schedule, tp: int, sp: bool) -> None:
        first, inter, blocks, down = _layout(expert_flags(node.mod))
        node.shard(first, axis=inter, blocks=blocks)
        node.shard("down_proj", axis=down)
        if isinstance(node.mod.__dict__.get("intermediate_dim"), int):  # an eager forward's
            node.set_attr("intermediate_dim", node.mod.intermediate_dim // tp)
        node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        if _takes_weights(node.mod):  # else the router scaled the input: summed above
            node.sync(mode="bwd_post", sync_op_or_fn="all_reduce", arg=WEIGHTS)
        node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


__all__ = ["Experts", "expert_flags"]
