"""Plan styles at the edges of a sharded projection: gather a column output back whole, split
a replicated input before a row projection, sum the gradient of a replicated output's part
that feeds every rank's heads (multi-head latent attention's shared rotary key).

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

import torch

from ..distributed import collectives as C
from ..errors import SchedulingError
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


@dataclass(frozen=True)
class ReduceTailGrad(Style):
    """A replicated projection whose output's last `features` go straight to this rank's heads
    (MLA's `kv_a_proj_with_mqa`: [compressed kv | shared rotary key], the key shared by every
    head): all-reduce that part's gradient in backward (identity forward), since each rank's
    heads give only their share of it. The rest of the output feeds a column projection whose
    `EnterRegion` already sums its gradient."""

    features: int

    def effects(self, node, tp, sp):
        return [("sync", "fwd_post", "tail_grad")]

    def check(self, node, tp, sp):
        out = getattr(node.mod, "out_features", None)
        if not isinstance(out, int) or not 0 < self.features < out:
            raise SchedulingError(node.path, f"{self} needs a Linear with more than "
                                  f"{self.features} output features, not "
                                  f"{type(node.mod).__name__} ({out}).",
                                  "point the row at the kv_a projection.")
        if sp:
            raise SchedulingError(node.path, f"{self} has no sequence-parallel form.",
                                  "use sequence_parallel=False.")

    def apply(self, node, tp, sp):
        group, n = node.group, self.features

        def tail_grad(mod, args, out):
            head, tail = out.split([out.shape[-1] - n, n], dim=-1)
            return torch.cat([head, C.reduce_backward(tail, group)], dim=-1)

        node.sync(mode="fwd_post", sync_op_or_fn=tail_grad)


@dataclass(frozen=True)
class Replicated(Style):
    """Nothing to change: a module that runs before a layer's column projections, so each rank
    computes it whole and, after those projections' `EnterRegion` input reductions, gets its
    whole gradient (MLA's `q_a_proj`, `q_a_layernorm`, `kv_a_layernorm`). The row says so, for
    the check that every parameter of a split region has a row."""

    def effects(self, node, tp, sp):
        return []

    def apply(self, node, tp, sp):
        return None


__all__ = ["GatherOutput", "ReduceTailGrad", "Replicated", "ScatterInput"]
