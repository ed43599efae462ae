"""Context parallelism in the step: this cp rank's part of every sequence (`cp_batch`), and
what `build` checks before a cp step can be exact (`check_context_parallel`).

**The split (zig-zag, load-balanced).** Each sequence is cut into `2 * cp` equal chunks and cp
rank `i` holds chunks `i` and `2cp - 1 - i` (torch's `context_parallel` and Megatron's CP do
the same): under a causal mask the late chunks see more keys than the early ones, and pairing
an early chunk with a late one gives every rank the same attention work. A sequence whose
length is not a multiple of `2 * cp` is padded at its end (token 0, label -100, never a
key: the key flags below mark it): a padded query's label is ignored, so loss and gradients are
exactly those of the unpadded sequence, causal or bidirectional.

**What the model gets** (a dict of keyword arguments, `Trainer.local_batch`):

- `input_ids` (and `token_type_ids`, BERT's): the rank's tokens, `position_ids`: their
  indices in the whole sequence (RoPE per chunk from the global position; learned absolute
  positions, GPT-2's and BERT's, look them up), or, for a model whose positions count only
  unpadded tokens (OPT, RoBERTa: `position_rule`), its own numbering computed over the whole
  sequence before the split;
- causal LMs: `labels` and `shift_labels`, HF's causal shift done **before** the split (label
  `t` is the token at `t + 1` of the whole sequence; a chunk's last token predicts the first
  token of the next chunk, which another rank holds). HF's causal-LM loss takes
  `shift_labels` as given, and the step counts the supervised tokens of `labels` unshifted
  (`ModelLoss` shift 0). Masked LMs: `labels` split as they are (no shift);
- `num_items_in_batch` (causal LMs, added by the step, `token_mean.GlobalSum`): the
  supervised tokens of the whole global batch, over every dp and cp rank, so each rank's loss
  is its tokens' sum over that count;
- `cp_key_valid` (`op.context_parallel.KEY_VALID`), always: the real-key flags of every cp
  rank's chunks, (batch, cp, local length): the batch's `attention_mask` (all ones without
  one) and the split's padding, so no attention layer gathers them; the mask itself is not
  passed (HF would build it for the local length);
- packed documents (a batch with `position_ids` that restart at each document, `--sft pack`):
  the positions are split as they are (RoPE counts within each document), and
  `cp_key_doc` (`KEY_DOC`) gives every cp rank's tokens their document (numbered as HF's
  `find_packed_sequence_indices` does: a new one wherever a position is not the previous plus
  one), so a query sees only its own document's keys, HF's block-diagonal causal mask.

A causal LM's loss is then the sum of every rank's token losses over the global token count,
what one process computes (DDP's mean over `dp x cp` ranks is undone by the units' weight
`dp x cp`). A masked LM's own loss (BERT's `CrossEntropyLoss()`) is its rank's mean, which the
step's token weights (`token_mean.TokenMean` over the dp x cp ranks) turn into the global
token mean. Batches with `inputs_embeds` or other per-token inputs are refused (their split is
not defined here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import SchedulingError
from ..op.context_parallel import KEY_DOC, KEY_VALID, zigzag_index
from .batch import Batch
from .token_mean import IGNORE_INDEX, ModelLoss

# the keys split along the sequence
SPLIT = ("input_ids", "labels", "attention_mask", "token_type_ids", "position_ids")
PAD_TOKEN = 0  # the id padded sequences get at their end (never a real key, never a target)


def padded_length(seq: int, cp: int) -> int:
    """`seq` rounded up to a multiple of `2 * cp` (the split needs equal chunks)."""
    return -(-seq // (2 * cp)) * (2 * cp)


def check_cp_batch(batch: Batch) -> None:
    """A batch the split is defined for: a dict with `input_ids` and `labels` of one shape
    (batch, sequence); any other per-token input refused by name (nothing is changed)."""
    if not isinstance(batch, dict):
        raise SchedulingError("", "context parallelism (cp > 1) takes a dict batch "
                              f"(input_ids, labels, ...), got {type(batch).__name__}.",
                              "pass the batch as keyword arguments.")
    ids, labels = batch.get("input_ids"), batch.get("labels")
    if not isinstance(ids, torch.Tensor) or not isinstance(labels, torch.Tensor) or \
            ids.dim() != 2 or labels.shape != ids.shape:
        raise SchedulingError("", "context parallelism (cp > 1) needs `input_ids` and "
                              "`labels` of one shape (batch, sequence) in the batch.",
                              "pass input_ids and labels (-100 where nothing is predicted).")
    for key, value in batch.items():
        if key in SPLIT or not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        raise SchedulingError("", f"the batch's {key!r} under context parallelism: only "
                              f"{', '.join(SPLIT)} are split over the cp ranks.",
                              f"drop {key!r} from the batch.")
    for key in ("attention_mask", "token_type_ids", "position_ids"):
        value = batch.get(key)
        if value is not None and (not isinstance(value, torch.Tensor) or
                                  value.shape != ids.shape):
            raise SchedulingError("", f"{key} under context parallelism must be a (batch, "
                                  "sequence) tensor like input_ids.",
                                  f"pass a 2-D {key}, or none.")


Positions = Callable[[dict], tuple[torch.Tensor, int]]


def unpadded_count_positions(batch: dict) -> tuple[torch.Tensor, int]:
    """OPT's learned positions (`OPTDecoder.forward` without `position_ids`): each token's
    count of unpadded tokens up to it, minus one (padding: -1); the split's padding gets 0."""
    mask = batch.get("attention_mask")
    mask = torch.ones_like(batch["input_ids"]) if mask is None else mask.long()
    return torch.cumsum(mask, dim=1) * mask - 1, 0


def padding_id_positions(padding_idx: int) -> Positions:
    """RoBERTa's (`create_position_ids_from_input_ids`): the count of tokens that are not
    `padding_idx` up to each token, plus `padding_idx`; a padding token (and the split's
    padding) gets `padding_idx`. Counted from the token ids, as HF does, not the mask."""
    def positions(batch: dict) -> tuple[torch.Tensor, int]:
        real = batch["input_ids"].ne(padding_idx).long()
        return torch.cumsum(real, dim=1) * real + padding_idx, padding_idx
    return positions


def position_rule(model) -> Positions | None:
    """How the model numbers its learned positions when not given `position_ids`, when that is
    not the token's index in the sequence (the split then passes these, computed over the whole
    sequence before it): OPT's and RoBERTa's count unpadded tokens only. None: the index."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind == "opt":
        return unpadded_count_positions
    if kind in ("roberta", "xlm-roberta", "camembert"):
        return padding_id_positions(cfg.pad_token_id)
    return None


def cp_batch(batch: Batch, cp: int, rank: int, shift_labels: bool = True,
             positions: Positions | None = None) -> dict:
    """Cp rank `rank`'s part of every sequence of `batch` (module docstring); `shift_labels`:
    HF's causal shift before the split (causal LMs; a masked LM's labels are not shifted);
    `positions`: the model's position rule over the whole sequence (`position_rule`), None
    for the token's index."""
    check_cp_batch(batch)
    ids = batch["input_ids"]
    seq = ids.shape[-1]
    pad = padded_length(seq, cp) - seq
    labels = batch["labels"]
    if shift_labels:  # label t is the token at t + 1 of the whole sequence
        labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    index = zigzag_index(seq + pad, cp, rank).to(ids.device)
    labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)[:, index]
    given = batch.get("position_ids")
    if given is not None:  # packed documents: their own positions
        pos = F.pad(given, (0, pad), value=0)[:, index]
    elif positions is None:
        pos = index.expand(ids.shape[0], -1)
    else:
        full, fill = positions(batch)
        pos = F.pad(full, (0, pad), value=fill)[:, index]
    out = {k: v for k, v in batch.items() if k not in SPLIT}
    out.update(input_ids=F.pad(ids, (0, pad), value=PAD_TOKEN)[:, index],
               position_ids=pos, labels=labels)
    if shift_labels:
        out["shift_labels"] = labels
    if batch.get("token_type_ids") is not None:
        out["token_type_ids"] = F.pad(batch["token_type_ids"], (0, pad), value=0)[:, index]
    # every cp rank's key flags (the attention needs no collective for them): the batch's
    # attention mask, and the split's padding, never a key (a bidirectional layer would see it)
    mask = batch.get("attention_mask")
    mask = torch.ones_like(ids) if mask is None else mask
    every = torch.stack([zigzag_index(seq + pad, cp, r) for r in range(cp)]).to(ids.device)
    out[KEY_VALID] = F.pad(mask, (0, pad), value=0)[:, every].bool()  # (b, cp, s_local)
    if given is not None:
        out[KEY_DOC] = F.pad(documents(given), (0, pad), value=0)[:, every]  # (b, cp, s_local)
    return out


def documents(position_ids: torch.Tensor) -> torch.Tensor:
    """Each token's document in a packed row, from 0: a new one wherever a position is not the
    previous one plus one (HF's `masking_utils.find_packed_sequence_indices` rule, so the cp
    mask is the block-diagonal one HF builds for the same row in one process)."""
    before = torch.cat([position_ids[:, :1] - 1, position_ids[:, :-1]], dim=1)
    return (position_ids != before + 1).long().cumsum(dim=1)


def check_context_parallel(sch_path: str, cp: int, loss: ModelLoss, data_parallel: str | None,
                           target: str | None) -> ModelLoss:
    """`build`'s checks of a cp mesh (before anything changes); returns the step's
    `ModelLoss`: a causal LM's labels arrive shifted (shift 0), each unit's loss is its sum
    over the global token count (`token_mean.GlobalSum`); a masked LM's are weighted means."""
    if target is not None:
        raise SchedulingError(sch_path, f"cp={cp} with target={target!r} is not supported "
                              "yet.", "build without it (context parallelism runs with DDP or "
                              "FSDP2).")
    if data_parallel not in ("ddp", "fsdp"):
        raise SchedulingError(sch_path, f"cp={cp}: the cp ranks hold the same parameters and "
                              "compute different tokens, so their gradients must be averaged "
                              f"(over dp x cp), and data_parallel={data_parallel!r} does not.",
                              "build with data_parallel='ddp' or 'fsdp'.")
    if not loss.user_loss_fn and loss.shift == 1 and loss.num_items:
        return ModelLoss(shift=0, num_items=loss.num_items, global_sum=True, preshifted=True)
    if not loss.user_loss_fn and loss.shift == 0:  # a masked LM: each rank's mean, re-weighted
        return ModelLoss(shift=0, num_items=loss.num_items)
    raise SchedulingError(sch_path, f"cp={cp} needs the model's own language-modelling loss "
                          "(a *ForCausalLM head whose loss takes `shift_labels`, or a "
                          "*ForMaskedLM head): each cp rank holds part of every sequence, and "
                          "Slapo normalises that loss over the whole sequence's tokens; a "
                          "loss_fn or another head's loss is not.", "train a *ForCausalLM or "
                          "*ForMaskedLM model without loss_fn.")


CP_META = "context_parallel"  # `module_meta(model)[CP_META]`: the cp degree `apply` scheduled


def check_scheduled_for_cp(sch_path: str, model, cp: int) -> None:
    """A model built on a cp mesh must run the context-parallel attention (installed by
    `model_schedule.apply` on that mesh): its own attention would attend within each rank's
    chunks only, a wrong model that trains without an error."""
    from ..module_patch import module_meta

    meta = module_meta(model) or {}
    if meta.get(CP_META) != cp:
        raise SchedulingError(sch_path, f"the mesh has cp={cp}, but the model's attention was "
                              "not made context-parallel for it (each rank would attend within "
                              "its own chunks only).", "schedule it with slapo.model_schedule."
                              "apply(sch) on the same mesh before build.")
