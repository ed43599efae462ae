"""What each pipeline stage is handed from a batch: the first stage's positional inputs, the
padding masks and loss inputs every stage takes, and the batch entries a pipeline refuses."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..errors import SchedulingError
from ..module_patch import original_class
from ..op.context_parallel import KEY_DOC, KEY_VALID
from .batch import Batch
from .runner import LossFn


def first_stage_args(stage: nn.Module, batch: Batch) -> tuple:
    """The first stage's positional inputs: the batch's entries in the stage forward's order.

    Positional, because torch's schedules pass keyword arguments to *every* stage on a rank,
    while positional ones go to the first stage only."""
    if not isinstance(batch, dict):
        return tuple(batch)
    if callable(getattr(stage, "first_args", None)):  # a stage that derives its inputs (T5)
        return tuple(stage.first_args(batch))
    names = list(getattr(stage, "input_names", None) or ())
    if not names:
        params = inspect.signature(stage.forward).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    used = [n for n in names if n in batch]
    if not used and "input_ids" in batch and len(names) == 1:
        return (batch["input_ids"],)  # slapo.pipeline's convention: stage 0 takes input_ids
    if not used:
        raise SchedulingError("", f"none of the batch's keys {sorted(batch)} is an input of "
                              f"the first pipeline stage ({', '.join(names)}).",
                              "name the batch entries after the model's forward arguments.")
    last = names.index(used[-1])
    return tuple(batch.get(n) for n in names[:last + 1])


def contiguous_inputs(inputs):
    """`inputs` with every tensor contiguous. torch 2.11's first stage checks its inputs'
    strides against the contiguous ones it expects (`PipeliningShapeError: ... stride
    mismatch`), so a batch sliced from a longer one (`tokens[:, :seq]`, as the tests' and a
    packed-text loader's batches are) failed there; torch 2.13 does not check strides."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(), inputs)


def stage_outputs(stage: nn.Module, output: Any) -> Any:
    """What `loss_fn` sees: the last stage's output, wrapped like the model's output if the
    stage knows how (e.g. an HF stage gives an object with `.logits`)."""
    wrap = getattr(stage, "pipeline_outputs", None)
    return wrap(output) if callable(wrap) else output


def stage_default_loss(stage: nn.Module, outputs: Any, batch: Batch) -> torch.Tensor:
    fn = getattr(stage, "default_loss", None)
    if fn is None:
        raise SchedulingError("", "the last pipeline stage cannot compute the model's own loss.",
                              "pass build(..., loss_fn=fn) with fn(outputs, batch) -> scalar.")
    return fn(outputs, batch)


MASK_KEYS = ("attention_mask", "decoder_attention_mask")


def check_batch_inputs(stage: nn.Module, batch: Batch) -> None:
    """Refuse batch entries the model's forward would use but the pipeline stages do not
    take (BERT's stages take `token_type_ids`, decoder stages `position_ids`; no stage takes
    `inputs_embeds` or `head_mask`): dropped silently, they would train another model than the one a single
    process runs. Entries the forward does not name (a user `loss_fn`'s own) pass. Any stage
    of the rank can answer: `first_inputs` and `mask_inputs` belong to the stage kind."""
    root = getattr(stage, "_root", (None,))[0]
    if root is None or not isinstance(batch, dict):
        return
    params = _forward_params(original_class(root))  # the model's own, not a patch wrapper's
    taken = {*getattr(stage, "first_inputs", ()), *getattr(stage, "mask_inputs", ()),
             *getattr(stage, "position_inputs", ()),
             *(getattr(stage, "cp_inputs", ()) if KEY_VALID in batch else ()), "labels"}
    unused = sorted(k for k, v in batch.items() if k in params and k not in taken
                    and isinstance(v, torch.Tensor))
    if unused:
        raise SchedulingError("", f"the batch has {', '.join(unused)}, which "
                              f"{type(root).__name__}'s forward uses but its pipeline stages do "
                              "not take (they would be ignored).",
                              f"drop {', '.join(unused)} from the batch (the stages use the "
                              "model's defaults), or train without pipeline stages.")


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    """The argument names of a model class's forward (once per class: this runs every step)."""
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def stage_masks(stage: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """The padding masks every stage takes as keyword arguments (torch's schedules split a
    `step` call's keyword arguments into micro-batches like the inputs and hand them to every
    stage of the rank; each rank passes the same batch's masks): a batch's masks that hide
    some token, by name. A mask of all ones is dropped (the stages then build the model's
    unpadded masks, e.g. SDPA's `is_causal` path). A stage that takes no mask (`mask_inputs`,
    e.g. a ResNet stage) refuses one that hides tokens (every rank sees the same batch, so
    every rank raises)."""
    if not isinstance(batch, dict):
        return {}
    masks = {k: batch[k] for k in MASK_KEYS if isinstance(batch.get(k), torch.Tensor)
             and not bool((batch[k] != 0).all())}
    taken = set(getattr(stage, "mask_inputs", ()))
    refused = sorted(set(masks) - taken)
    if refused:
        key = refused[0]
        raise SchedulingError("", f"the pipeline stages of {type(stage).__name__} take no "
                              f"padding {key}, and this batch's mask hides some tokens.",
                              "pack sequences without padding (or mask padded tokens in the "
                              f"labels with -100 and drop {key}).")
    return masks


def stage_position_inputs(stage: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """A batch's own `position_ids` (packed documents: positions restart at each one), handed
    to every stage that takes them (`position_inputs`): each stage's embeddings, rotary
    embeddings and masks need them as the model's forward would (HF makes a packed batch's
    block-diagonal causal mask from them). Under context parallelism the cp batch's positions
    go through `stage_cp_inputs` instead."""
    if not isinstance(batch, dict) or KEY_VALID in batch:
        return {}
    pos = batch.get("position_ids")
    if not isinstance(pos, torch.Tensor) or "position_ids" not in getattr(
            stage, "position_inputs", ()):
        return {}
    return {"position_ids": pos}


def stage_cp_inputs(stage: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """Under context parallelism, what every stage takes besides the hidden states (the cp
    batch's `position_ids` and key flags, `runtime/context_parallel.py`): each stage's layers
    need them, as they would inside one model's forward. `build` refuses stage kinds without
    `cp_inputs` on a cp mesh."""
    if not isinstance(batch, dict) or KEY_VALID not in batch:
        return {}
    if KEY_DOC in batch and KEY_DOC not in stage.cp_inputs:
        raise SchedulingError("", f"a packed batch (documents in each row) under context "
                              f"parallelism: the pipeline stages of {type(stage).__name__} "
                              "take no document ids, so their attention would cross documents.",
                              "pad one document per row (--sft pad), or drop the pipeline.")
    return {k: batch[k] for k in stage.cp_inputs if k in batch}


def stage_loss_inputs(stage: nn.Module, batch: Batch, loss_fn: LossFn | None
                      ) -> dict[str, torch.Tensor]:
    """The batch entries every stage takes for the model's own loss (`labels` when the fused
    loss is on: `stages_decoder.FusedLossStage`); none with a user `loss_fn`, which gets the
    last stage's logits as before."""
    names = getattr(stage, "loss_inputs", ())
    if loss_fn is not None or not names or not isinstance(batch, dict):
        return {}
    return {k: batch[k] for k in names if isinstance(batch.get(k), torch.Tensor)}



def batch_shapes(batch: Batch) -> tuple:
    """The shape and dtype of every tensor in `batch`, in order: what a stage's inferred send
    and receive buffers depend on (every rank of the pipeline is handed the same batch)."""
    return tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))
