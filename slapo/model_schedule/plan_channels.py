"""Channel styles for tensor-parallel convolutional networks (ResNet blocks): the plan styles of
`plan.py` for convolutions and their per-channel norms.

Why a file of their own: they split channels, not features, and only the WideResNet family
uses them; `plan.py` keeps the feature styles every transformer family uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule
from .plan import Style, _check_split, _has

# Convolutions split over channels the way Linear layers split over features: a `ConvOut`
# (column) keeps 1/tp of the output channels, the per-channel BatchNorm after it keeps the same
# channels (`NormChannels`: its batch statistics are per channel, so a shard computes exactly its
# channels' share), and a `ConvIn` (row) consumes those channels and all-reduces its partial
# sums. Grouped convolutions are refused: their channel groups do not follow a plain split.


def _check_conv(node: Schedule, style: Style) -> None:
    from ..module_patch import original_class

    mod = node.mod
    if not issubclass(original_class(mod), nn.Conv2d):
        raise SchedulingError(node.path, f"{style} needs an nn.Conv2d, not "
                              f"{type(mod).__name__}.", "point the row at a convolution.")
    if mod.groups != 1:
        raise SchedulingError(node.path, f"{style} cannot split a grouped convolution "
                              f"(groups={mod.groups}): its channel groups do not follow a plain "
                              "split over ranks.", "leave this convolution replicated (remove "
                              "its rows from the plan).")


@dataclass(frozen=True)
class ConvOut(Style):
    """Output-channel (column) parallel `nn.Conv2d`: weight (out, in, kh, kw) split on axis 0
    (and the bias), so each rank computes 1/tp of the channels and needs no collective while a
    `NormChannels`/`ConvIn` pair consumes them. `out_channels` follows the shard."""

    def effects(self, node, tp, sp):
        return [("shard", n) for n in ["weight"] + (["bias"] if _has(node.mod, "bias") else [])]

    def check(self, node, tp, sp):
        _check_conv(node, self)
        _check_split(node, "weight", 0, tp, 1, self)

    def apply(self, node, tp, sp):
        node.shard("weight", axis=0)
        if _has(node.mod, "bias"):
            node.shard("bias", axis=0)
        node.set_attr("out_channels", node.mod.weight.shape[0])


@dataclass(frozen=True)
class ConvIn(Style):
    """Input-channel (row) parallel `nn.Conv2d`: weight split on axis 1, so each rank convolves
    its channels into a partial sum of the full output; `reduce=True` all-reduces it after the
    module (the output is whole on every rank; backward: identity). A bias would be added once
    per rank before the reduction, so a convolution with a bias is refused."""

    reduce: bool = True

    def effects(self, node, tp, sp):
        out = [("shard", "weight")]
        return out + ([("sync", "fwd_post", "all_reduce")] if self.reduce else [])

    def check(self, node, tp, sp):
        _check_conv(node, self)
        if _has(node.mod, "bias"):
            raise SchedulingError(node.path, f"{self} on a convolution with a bias would add the "
                                  "bias once per rank.", "use bias=False (ResNets do: a "
                                  "BatchNorm follows) or leave this convolution replicated.")
        _check_split(node, "weight", 1, tp, 1, self)

    def apply(self, node, tp, sp):
        node.shard("weight", axis=1)
        node.set_attr("in_channels", node.mod.weight.shape[1])
        if self.reduce:
            node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


_NORM_TENSORS = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class NormChannels(Style):
    """A per-channel norm (`nn.BatchNorm2d`) on channel-sharded activations: its affine weight
    and bias and its running mean and variance keep this rank's channels (axis 0), so training
    statistics, running-stat updates and eval-mode normalisation are exactly the full norm's on
    those channels. `num_batches_tracked` (a scalar) stays replicated: every rank counts the
    same batches. `num_features` follows the shard."""

    def _names(self, node) -> list[str]:
        return [n for n in _NORM_TENSORS if _has(node.mod, n)]

    def effects(self, node, tp, sp):
        return [("shard", n) for n in self._names(node)]

    def check(self, node, tp, sp):
        from ..module_patch import original_class

        if not issubclass(original_class(node.mod), nn.modules.batchnorm._BatchNorm):
            raise SchedulingError(node.path, f"{self} needs a BatchNorm, not "
                                  f"{type(node.mod).__name__}.", "point the row at the norm "
                                  "that follows the ConvOut convolution.")
        for name in self._names(node):
            _check_split(node, name, 0, tp, 1, self)

    def apply(self, node, tp, sp):
        names = self._names(node)
        if names:
            node.shard(names, axis=0)
        node.set_attr("num_features", node.mod.running_mean.shape[0]
                      if _has(node.mod, "running_mean") else node.mod.weight.shape[0])


__all__ = ["ConvIn", "ConvOut", "NormChannels"]
