"""Plan styles at the edges of a sharded projection: gather a column output back whole, split
a replicated input before a row projection.

Hugging Face's declared plans use them where a projection's output is not head-local
(`colwise_gather_output`: Phi-3's packed q|k|v of unequal GQA parts, a linear attention's
input projections) and where the next projection's input is whole again
(`rowwise_split_input`). The projection keeps 1/tp of the weight; what runs between the two
edges runs replicated on every rank, so it computes exactly what one process does (at the
price of replicated compute there). Kept out of `plan.py`, whose styles are the
Megatron-shaped ones the hand-written families use.
"""

from __future__ import annotations

from dataclasses import dataclass

from .plan import Style, _check_split, _is_conv1d


@dataclass(frozen=True)
class GatherOutput(Style):
    """All-gather a column-parallel module's output along the features (forward), so the
    output is whole on every rank; backward keeps this rank's slice of the (replicated)
    gradient. Put it after a `Column` row of the same module."""

    def effects(self, node, tp, sp):
        return [("sync", "fwd_post", "all_gather")]

    def apply(self, node, tp, sp):
        node.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)


@dataclass(frozen=True)
class ScatterInput(Style):
    """Keep this rank's slice of a replicated input along the features (forward; backward
    all-gathers the gradient), so a `Row` row of the same module sees the features its weight
    shard multiplies."""

    def effects(self, node, tp, sp):
        return [("sync", "fwd_pre", "scatter")]

    def check(self, node, tp, sp):
        _check_split(node, "weight", 0 if _is_conv1d(node.mod) else 1, tp, 1, self)

    def apply(self, node, tp, sp):
        node.sync(mode="fwd_pre", sync_op_or_fn="scatter", axis=-1)


__all__ = ["GatherOutput", "ScatterInput"]
