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
(`*ForCausalLM` / `*LMHeadModel`: labels shifted by one; `*ForMaskedLM`,
`*ForTokenClassification`, encoder-decoder `*ForConditionalGeneration`: not shifted). A user
`loss_fn`, or any other model, keeps the mean over units: its reduction is the user's to
define; when such a loss is given per-token labels with ignored (-100) positions and the step
has more than one unit, a one-time notice says the result is not the one-process token mean.
The DeepSpeed target weights its micro-steps the same way (`runtime/deepspeed.py`).

`num_items_in_batch` (what HF's Trainer passes under gradient accumulation) in a batch means:
the batch's loss is the *sum* over its supervised tokens divided by that number, where the
model's loss honours it (`loss_divides_by_num_items`: its forward computes the loss through
`self.loss_function`). Handed unchanged to every unit, each unit's loss would be its own sum
over that global count, and the step's weights would divide it again (issue 29: 11.6% off with
`grad_accum=2`, 55.8% with DDP and accumulation). So the step removes it from every unit, lets
the unit compute its mean, and uses the number as `N` (the same weights `n_u * dp / N` give
`sum / num_items_in_batch`, what one process computes on the whole batch). It is read as the
count over the *global* batch (HF Trainer's `average_tokens_across_devices=True`), so it must
be the same on every data-parallel rank (checked in the same all-reduce). A model that ignores
it (BERT's heads, T5) computes the token mean in one process, and so does the step. For a head
whose denominator Slapo does not know but whose loss honours the number, each unit's loss is
its share of the global sum, and units are summed (weight `dp`, `UnitSum`). With a user
`loss_fn`, a step of more than one unit is refused: whether that loss divides by the number is
the user's code.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from ..notices import notice_once, was_shown
from .batch import Batch
from .mesh import MeshInfo

IGNORE_INDEX = -100
NUM_ITEMS = "num_items_in_batch"


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
        if name.endswith(("ForMaskedLM", "ForTokenClassification")):
            return 0
        if name.endswith("ForConditionalGeneration") and getattr(cfg, "is_encoder_decoder",
                                                                 False):
            return 0
    return None


def loss_divides_by_num_items(model: nn.Module | None) -> bool | None:
    """Whether the model's own loss divides a sum by `num_items_in_batch` when given one: it
    does when its class's forward hands it to `self.loss_function` (HF's causal LMs, question
    answering; `forward_divides_by_num_items`); BERT's, RoBERTa's, ALBERT's heads and T5 call
    `CrossEntropyLoss()`, and the generic classification heads call the loss without it. Read from the installed source (classes differ
    and releases change them); None when the source cannot be read."""
    if model is None:
        return False
    from ..module_patch import original_class

    return forward_divides_by_num_items(getattr(original_class(model), "forward", None))


def forward_divides_by_num_items(forward) -> bool | None:
    """`loss_divides_by_num_items` of one HF head class's `forward` (None: no source): whether
    it hands `num_items_in_batch` to `self.loss_function`, i.e. calls it with `**kwargs` (where
    the Trainer's keyword arrives) or with the keyword named. Calling `self.loss_function` is
    not enough: HF's generic sequence- and token-classification heads call it without the
    keyword (a plain mean), the causal LMs and question answering with `**kwargs`."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "loss_function"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"
                and any(k.arg in (None, NUM_ITEMS) for k in node.keywords)):
            return True
    return False


@dataclass(frozen=True)
class ModelLoss:
    """How the step may weight the units of a batch: what `build` learnt of the loss."""

    shift: int | None = None  # `label_shift`; None: the denominator is not known
    num_items: bool | None = False  # `loss_divides_by_num_items` (None: unknown)
    user_loss_fn: bool = False  # a `loss_fn` was given: its reduction is the user's
    global_sum: bool = False  # context parallelism: units are sums over the global count
    preshifted: bool = False  # context parallelism: labels shifted by the step, before the split

    @classmethod
    def of(cls, model: nn.Module | None, loss_fn_given: bool) -> ModelLoss:
        if loss_fn_given:
            return cls(user_loss_fn=True)
        return cls(label_shift(model), loss_divides_by_num_items(model))


def supervised_tokens(batch: Batch, shift: int) -> torch.Tensor | None:
    """The number of labels the model's own loss averages over, or None without labels."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if not isinstance(labels, torch.Tensor):
        return None
    if shift:
        labels = labels[..., shift:]
    return (labels != IGNORE_INDEX).sum()


def num_items_of(batch: Batch) -> float | None:
    """The batch's `num_items_in_batch` as a number, or None when it has none."""
    value = batch.get(NUM_ITEMS) if isinstance(batch, dict) else None
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise SchedulingError("", f"{NUM_ITEMS} must be one number (the batch's count of "
                                  f"supervised tokens), got a tensor of shape "
                                  f"{tuple(value.shape)}.", f"pass {NUM_ITEMS} as an int or "
                                  "a 0-d tensor.")
        return float(value.reshape(()).item())
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise SchedulingError("", f"{NUM_ITEMS} must be a number, got "
                              f"{type(value).__name__}.", f"pass {NUM_ITEMS} as an int or a "
                              "0-d tensor.") from e


def _without_num_items(unit: Batch) -> Batch:
    if isinstance(unit, dict) and NUM_ITEMS in unit:
        return {k: v for k, v in unit.items() if k != NUM_ITEMS}
    return unit


@dataclass
class TokenMean:
    """The step's global supervised-token count and the data-parallel degree."""

    total: torch.Tensor  # N, summed over the step's units and the dp group
    dp: int
    shift: int

    def weight(self, unit: Batch) -> torch.Tensor:
        """`n_u * dp / N` for one unit (an accumulation slice or a micro-batch), in float64:
        the step multiplies a loss by it in that loss's dtype (`weighted`), so a float64 model
        is not weighted by a float32-rounded number."""
        n = supervised_tokens(unit, self.shift)
        return n.double() * self.dp / self.total.double()

    def guard(self, unit: Batch) -> Batch:
        """The unit as the model must see it: without `num_items_in_batch` (its loss is then
        the unit's mean, which `weight` scales), and, when none of its labels is supervised,
        with one label made a real target. HF's mean over no token is 0/0 = NaN, and its NaN
        gradient would poison the step even at weight 0; the copy's loss is finite, and its
        weight stays 0 (`weight` counts the original labels), so the unit adds exactly
        nothing, as in one process."""
        unit = _without_num_items(unit)
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


@dataclass
class UnitSum:
    """Units whose losses are already shares of one global sum (a head Slapo does not know,
    whose loss divides by the batch's `num_items_in_batch`): they add up, so each weighs `dp`
    (data parallelism averages gradients over the dp ranks)."""

    dp: int

    def weight(self, unit: Batch) -> torch.Tensor:
        return torch.tensor(float(self.dp))

    def guard(self, unit: Batch) -> Batch:
        return unit


@dataclass
class GlobalSum:
    """Context parallelism's units: each cp rank holds part of every sequence, so each unit's
    loss is its tokens' *sum* over the global count `N` (the model's own loss given
    `num_items_in_batch = N`), and units add up (weight: the `dp x cp` ranks DDP averages
    over). Sum over N rather than the unit's mean re-weighted by `n_u * replicas / N`: the
    same value, with the one rounding of `1 / N` one process makes, so the cp step and one
    process differ only by summation order."""

    total: torch.Tensor  # N, summed over the step's units and the dp x cp group
    replicas: int

    def weight(self, unit: Batch) -> torch.Tensor:
        return torch.tensor(float(self.replicas))

    def guard(self, unit: Batch) -> Batch:
        """The unit with `num_items_in_batch = N` (a unit without supervised tokens then has
        the loss 0, no NaN to guard against)."""
        return {**_without_num_items(unit), NUM_ITEMS: self.total}


Weights = TokenMean | UnitSum | GlobalSum


def weighted(loss: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
    """`loss` x a unit's `weight`, in the loss's dtype (a float64 weight would promote a 0-d
    float32 loss, and a float32 one would round a float64 model's weight)."""
    if isinstance(weight, torch.Tensor):
        weight = weight.to(device=loss.device, dtype=loss.dtype)
    return loss * weight


def token_mean(loss: ModelLoss | int | None, parts: list[Batch], info: MeshInfo,
               units: int | None = None) -> Weights | None:
    """The step's unit weights for these accumulation slices of this rank's batch, or None
    (unknown loss, no labels, or no supervised token anywhere: the unit mean is kept).
    `units`: how many units the step's loss averages over on all ranks (accumulation slices x
    micro-batches x dp), for the checks that only matter when there is more than one."""
    return token_mean_over(loss, parts, info.replicas,
                           info.replica_group() if info.replicas > 1 else None,
                           info.device, units)


def token_mean_over(loss: ModelLoss | int | None, parts: list[Batch], dp: int, group,
                    device: torch.device, units: int | None = None) -> Weights | None:
    """`token_mean` over an explicit data-parallel group (`group` None: the default group;
    DeepSpeed's data parallelism spans the world)."""
    if not isinstance(loss, ModelLoss):  # a bare label shift (the pre-num_items callers)
        loss = ModelLoss(shift=loss)
    units = len(parts) * dp if units is None else units
    given = num_items_of(parts[0]) if parts else None
    if loss.shift is None:
        return _unknown_denominator(loss, parts, dp, given, units)
    counts = [supervised_tokens(p, loss.shift) for p in parts]
    if any(c is None for c in counts):
        return None
    honoured = given is not None and _honours(loss)
    sums = [torch.stack(counts).sum().double()]
    if honoured:
        sums += [torch.tensor(given, dtype=torch.float64),
                 torch.tensor(given * given, dtype=torch.float64)]
    totals = torch.stack(sums)
    if dp > 1:
        totals = totals.to(device)
        dist.all_reduce(totals, group=group)
        totals = totals.cpu()
    if honoured:
        _check_same_on_every_rank(totals[1].item(), totals[2].item(), dp)
        total = torch.tensor(given, dtype=torch.float64)
    else:
        total = totals[0]
    if total.item() == 0:
        return None
    return GlobalSum(total, dp) if loss.global_sum else TokenMean(total, dp, loss.shift)


def _honours(loss: ModelLoss) -> bool:
    if loss.num_items is None:
        raise SchedulingError("", f"the batch carries {NUM_ITEMS}, and Slapo cannot read the "
                              "model's source to tell whether its loss divides by it.",
                              f"drop {NUM_ITEMS} from the batch (the step already averages "
                              "the model's loss over the global batch's supervised tokens).")
    return loss.num_items


def _check_same_on_every_rank(total: float, squares: float, dp: int) -> None:
    """Every rank sees the same sums, so every rank takes the same decision: the values are
    equal exactly when their variance is 0."""
    mean = total / dp
    if abs(squares / dp - mean * mean) > 1e-6 * max(1.0, mean * mean):
        raise SchedulingError("", f"{NUM_ITEMS} differs between the data-parallel ranks (mean "
                              f"{mean:g}). Slapo reads it as the count of supervised tokens of "
                              "the global batch (HF Trainer's average_tokens_across_devices), "
                              "the same on every rank.",
                              f"pass the global count on every rank, or drop {NUM_ITEMS} (the "
                              "step then averages over the global batch's supervised tokens "
                              "itself).")


def _unknown_denominator(loss: ModelLoss, parts: list[Batch], dp: int, given: float | None,
                         units: int) -> Weights | None:
    """Weights for a loss whose denominator Slapo does not know: the units' mean (None), the
    sum of their shares when the model divides by `num_items_in_batch` (`UnitSum`)."""
    if units <= 1:
        return None
    if given is not None:
        if loss.user_loss_fn:
            raise SchedulingError("", f"the batch carries {NUM_ITEMS} and this step averages "
                                  f"a user loss_fn over {units} units (accumulation slices, "
                                  "micro-batches, data-parallel ranks); whether that loss is "
                                  "a share of a global sum is the loss_fn's code, so the "
                                  "step cannot weight it.",
                                  f"drop {NUM_ITEMS} and return the unit's mean loss (the "
                                  "step averages units), or train without a loss_fn (the "
                                  "model's own loss is weighted by its tokens).")
        if _honours(loss):
            return UnitSum(dp)
    _notice_unit_mean(parts)
    return None


_UNIT_MEAN = "unit-mean-loss"


class UnitMeanNotice(UserWarning):
    """A per-token loss is averaged over units, which is not the one-process token mean."""


def _notice_unit_mean(parts: list[Batch]) -> None:
    if was_shown(_UNIT_MEAN):  # decided once: no host sync in every later step
        return
    labels = parts[0].get("labels") if parts and isinstance(parts[0], dict) else None
    if not isinstance(labels, torch.Tensor) or labels.dim() < 2:
        return  # one label per sample: equal units, the unit mean is the batch mean
    if not any(bool((p["labels"] == IGNORE_INDEX).any()) for p in parts):
        return
    notice_once(_UNIT_MEAN, "slapo: the batch's labels mark ignored tokens (-100) per "
                "position, and this loss is averaged over the step's units (accumulation "
                "slices, micro-batches, data-parallel ranks) with equal weights: when units "
                "hold different numbers of supervised tokens that is not the mean one process "
                "computes on the whole batch. Slapo weights by tokens the losses whose "
                "denominator it knows (the model's own loss of *ForCausalLM, *LMHeadModel, "
                "*ForMaskedLM, *ForTokenClassification, encoder-decoder "
                "*ForConditionalGeneration heads): to train on the token mean, use one of those "
                "heads' own loss, or equal numbers of supervised tokens per unit.",
                category=UnitMeanNotice)
