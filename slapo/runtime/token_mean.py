"""The step's loss as one mean over every supervised token of the global batch.

An HF model's own loss is a mean over the tokens of *its* input whose label is not -100. A
step that averages such means over accumulation slices, data-parallel ranks or pipeline
micro-batches weights every unit equally, whatever its number of supervised tokens: with
masked-LM labels (15% of tokens, a different count in each unit) or padded causal-LM labels,
the gradient then depends on how the batch was split, and the run no longer trains like one
process on the same batch (measured: 4e-4 relative loss difference after 3 steps of BERT on 2
ranks). HF Trainer fixed the same bug for gradient accumulation in 2024 (`num_items_in_batch`);
torchtitan divides by the global token count.

So the step counts each unit's supervised tokens `n_u`, sums them over the data-parallel
group (`N`, one small all-reduce), and gives unit `u`'s mean loss the weight
`n_u * dp / N`: data parallelism averages gradients over `dp` ranks, so the step's gradient is
`sum_u n_u L_u / N`, the token mean one process computes. Units with equal counts (causal LM
without padding) get weight 1/(units per rank) exactly, as before.

It applies only to the model's own loss of the HF heads whose denominator is known
(`*ForCausalLM` / `*LMHeadModel`: labels shifted by one; `*ForMaskedLM`, encoder-decoder
`*ForConditionalGeneration`: not shifted). A user `loss_fn`, or any other model, keeps the
mean over units: its reduction is the user's to define. The DeepSpeed target weights its
micro-steps the same way (`runtime/deepspeed.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .batch import Batch
from .mesh import MeshInfo

IGNORE_INDEX = -100


def label_shift(model: nn.Module | None) -> int | None:
    """How many positions the model's own loss shifts labels by (1 causal, 0 masked or
    encoder-decoder), or None when the model's loss denominator is not known."""
    if model is None:
        return None
    cfg = getattr(model, "config", None)
    for cls in type(model).__mro__:  # a trainable subclass made by `build` keeps its base's
        name = cls.__name__
        if name.endswith(("ForCausalLM", "LMHeadModel")):
            return 1
        if name.endswith("ForMaskedLM"):
            return 0
        if name.endswith("ForConditionalGeneration") and getattr(cfg, "is_encoder_decoder",
                                                                 False):
            return 0
    return None


def supervised_tokens(batch: Batch, shift: int) -> torch.Tensor | None:
    """The number of labels the model's own loss averages over, or None without labels."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        return None
    if shift:
        labels = labels[..., shift:]
    return (labels != IGNORE_INDEX).sum()


@dataclass
class TokenMean:
    """The step's global supervised-token count and the data-parallel degree."""

    total: torch.Tensor  # N, summed over the step's units and the dp group
    dp: int
    shift: int

    def weight(self, unit: Batch) -> torch.Tensor:
        """`n_u * dp / N` for one unit (an accumulation slice or a micro-batch)."""
        n = supervised_tokens(unit, self.shift)
        return (n.double() * self.dp / self.total).float()

    def guard(self, unit: Batch) -> Batch:
        """The unit, or, when none of its labels is supervised, a copy with one label made a
        real target. HF's mean over no token is 0/0 = NaN, and its NaN gradient would poison
        the step even at weight 0; the copy's loss is finite, and its weight stays 0 (`weight`
        counts the original labels), so the unit adds exactly nothing, as in one process."""
        labels = unit.get("labels") if isinstance(unit, dict) else None
        if not isinstance(labels, torch.Tensor) or labels.numel() == 0 or \
                labels.shape[-1] <= self.shift:
            return unit
        # decided on the device (no host sync per micro-batch inside a pipeline schedule)
        empty = supervised_tokens(unit, self.shift) == 0
        fixed = labels.clone()
        at = (0,) * (fixed.dim() - 1) + (self.shift,)
        fixed[at] = torch.where(empty, torch.zeros_like(fixed[at]), fixed[at])
        return {**unit, "labels": fixed}


def token_mean(shift: int | None, parts: list[Batch], info: MeshInfo) -> TokenMean | None:
    """The step's `TokenMean` for these accumulation slices of this rank's batch, or None
    (unknown loss, no labels, or no supervised token anywhere: the unit mean is kept)."""
    device = torch.device("cuda", torch.cuda.current_device()) \
        if info.device_type == "cuda" else torch.device("cpu")
    return token_mean_over(shift, parts, info.dp, info.group("dp") if info.dp > 1 else None,
                           device)


def token_mean_over(shift: int | None, parts: list[Batch], dp: int, group,
                    device: torch.device) -> TokenMean | None:
    """`token_mean` over an explicit data-parallel group (`group` None: the default group;
    DeepSpeed's data parallelism spans the world)."""
    if shift is None:
        return None
    counts = [supervised_tokens(p, shift) for p in parts]
    if any(c is None for c in counts):
        return None
    total = torch.stack(counts).sum().double()
    if dp > 1:
        total = total.to(device)
        dist.all_reduce(total, group=group)
        total = total.cpu()
    if total.item() == 0:
        return None
    return TokenMean(total, dp, shift)
