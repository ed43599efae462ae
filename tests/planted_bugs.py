"""Planted schedule bugs: the catch set of issue 15 item 3 (`tests/test_verify_localise.py`).

`BUGS` maps a name to a `Planted`: `make(planted)` returns (model, schedule function, batch) on a
tiny real HF model built from its config. With `planted=False` the same function writes the
correct schedule (the control: Verify must pass it), with `planted=True` the one mistake. Each
entry says which module the report must name and which primitive text it must contain.

The mistakes, as a user writes them by hand (the ready schedules make none of them):

| name              | model | the mistake                                                      |
|-------------------|-------|------------------------------------------------------------------|
| missing_fwd_sync  | GPT-2 | row-parallel `attn.c_proj` without `sync('fwd_post', 'all_reduce')` |
| missing_bwd_sync  | GPT-2 | column-parallel `attn.c_attn` without `sync('bwd_post', 'all_reduce')` |
| wrong_shard_axis  | BERT  | column-parallel `intermediate.dense` sharded on its input axis (axis=1) |
| unsharded_bias    | GPT-2 | column-parallel `mlp.c_fc`: weight sharded, bias left whole        |
| missing_fork_rng  | BERT  | attention dropout 0.1 with heads sharded and no `fork_rng`         |
| wrong_rng         | GPT-2 | `fork_rng` on `attn.resid_dropout` (a replicated region)           |
| pipeline_cut_drops_module | BERT classifier | a cut whose stages hold no `classifier` |
| double_bias_add   | BERT  | row-parallel `attention.output.dense` all-reduced by a hook after its bias |

"Unsharded bias": a *row*-parallel layer's bias must stay whole (Slapo's sync kernel adds it
once, after the all-reduce), so the whole-bias mistake is on a column-parallel layer (a shape
error); on a row-parallel layer the mistake is adding the whole bias on every rank, which is
`double_bias_add`. Verify cannot run pipeline schedules, so the pipeline entry is a cut that
leaves a module in no stage (checked from the cuts, as `build` does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import models
import torch

ROW_HOOK_NAME = "allreduce_after_bias"


@dataclass(frozen=True)
class Planted:
    make: Callable  # make(planted: bool) -> (model, schedule_fn(sch), batch kwargs)
    module: str     # the module the report must name (the named path starts with it)
    primitive: str  # text the report must contain (the primitive, applied or missing)
    kind: str       # "verify" (VerificationError) or "shape" (ScheduledShapeError)


def _gpt2(**over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 64,
           "bos_token_id": 0, "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
           "attn_pdrop": 0.0, **over}
    return GPT2LMHeadModel(GPT2Config(**cfg))


def gpt2_tp(sch, bug: str | None = None) -> None:
    """Megatron TP of every GPT-2 block (no vocab parallelism), with one planted `bug`."""
    ws = sch.tp_size
    for i, _ in enumerate(sch["transformer.h"].child):
        attn, mlp = sch[f"transformer.h.{i}.attn"], sch[f"transformer.h.{i}.mlp"]
        first = i == 0
        attn["c_attn"].shard("weight", axis=1, blocks=3)
        attn["c_attn"].shard("bias", axis=0, blocks=3)
        if not (first and bug == "missing_bwd_sync"):
            attn["c_attn"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        attn.set_attr("split_size", attn.mod.split_size // ws)
        attn["c_proj"].shard("weight", axis=0)
        if not (first and bug == "missing_fwd_sync"):
            attn["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if first and bug == "wrong_rng":
            attn["resid_dropout"].fork_rng()
        mlp["c_fc"].shard("weight", axis=1)
        if not (first and bug == "unsharded_bias"):
            mlp["c_fc"].shard("bias", axis=0)
        mlp["c_fc"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        mlp["c_proj"].shard("weight", axis=0)
        mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def allreduce_after_bias(module, inputs, output):
    """A user's fwd_post hook: all-reduce the output *after* the Linear added its bias."""
    from slapo.distributed import collectives

    return collectives.reduce_forward(output, None)


def bert_tp(sch, bug: str | None = None, prefix: str = "") -> None:
    """Megatron TP of every BERT layer, with one planted `bug`; `fork_rng` on the attention
    core (the sharded heads) unless the bug is its absence."""
    layers = sch[f"{prefix}encoder.layer"]
    for i, _ in enumerate(layers.child):
        layer = sch[f"{prefix}encoder.layer.{i}"]
        first = i == 0
        attn = layer["attention.self"]
        for name in ("query", "key", "value"):
            attn[name].shard(["weight", "bias"], axis=0)
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        if not (first and bug == "missing_fork_rng"):
            attn.fork_rng()
        out = layer["attention.output.dense"]
        out.shard("weight", axis=1)
        if first and bug == "double_bias_add":
            out.sync(mode="fwd_post", sync_op_or_fn=allreduce_after_bias)
        else:
            out.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        inter = layer["intermediate.dense"]
        inter.shard("weight", axis=1 if first and bug == "wrong_shard_axis" else 0)
        inter.shard("bias", axis=0)
        inter.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        layer["output.dense"].shard("weight", axis=1)
        layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def _lm_batch() -> dict:
    ids = models.ids(batch=2, seq=16)
    return {"input_ids": ids, "labels": ids}


def _gpt2_case(bug: str, **over) -> Callable:
    def make(planted: bool):
        return _gpt2(**over), lambda sch: gpt2_tp(sch, bug if planted else None), _lm_batch()
    return make


def _bert_case(bug: str, dropout: float = 0.0) -> Callable:
    def make(planted: bool):
        model = models.bert_mlm(seed=0)
        if dropout:
            model = _bert_mlm_dropout(dropout)
        _nonzero_biases(model)
        return model, lambda sch: bert_tp(sch, bug if planted else None, "bert."), _lm_batch()
    return make


def _nonzero_biases(model) -> None:
    """HF initialises biases to zero, which would hide a bias added twice."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def _bert_mlm_dropout(p: float):
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=p))


def _pipeline_case(planted: bool):
    """BERT with a classification head: a cut gives stages without `classifier` (planted);
    the control is the masked-LM model, whose head the last stage holds."""
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = models.ids(batch=2, seq=16)
    if planted:
        model = BertForSequenceClassification(cfg)
        batch = {"input_ids": ids, "labels": torch.tensor([0, 1])}
    else:
        model = BertForMaskedLM(cfg)
        batch = {"input_ids": ids, "labels": ids}

    def schedule(sch):
        sch["bert.encoder.layer.0"].cut_pipeline_stage()
    return model, schedule, batch


BUGS: dict[str, Planted] = {
    "missing_fwd_sync": Planted(_gpt2_case("missing_fwd_sync"), "transformer.h.0.attn.c_proj",
                                "sync('fwd_post', 'all_reduce')", "verify"),
    "missing_bwd_sync": Planted(_gpt2_case("missing_bwd_sync"), "transformer.h.0.attn.c_attn",
                                "sync('bwd_post', 'all_reduce')", "verify"),
    "wrong_shard_axis": Planted(_bert_case("wrong_shard_axis"),
                                "bert.encoder.layer.0.intermediate.dense", "axis=1", "shape"),
    "unsharded_bias": Planted(_gpt2_case("unsharded_bias"), "transformer.h.0.mlp.c_fc",
                              "shard(name_or_names='weight', axis=1)", "shape"),
    "missing_fork_rng": Planted(_bert_case("missing_fork_rng", dropout=0.1),
                                "bert.encoder.layer.0.attention.self", "fork_rng()", "verify"),
    "wrong_rng": Planted(_gpt2_case("wrong_rng", resid_pdrop=0.1),
                         "transformer.h.0.attn.resid_dropout", "fork_rng()", "verify"),
    "pipeline_cut_drops_module": Planted(_pipeline_case, "classifier",
                                         "cut_pipeline_stage()", "verify"),
    "double_bias_add": Planted(_bert_case("double_bias_add"),
                               "bert.encoder.layer.0.attention.output.dense", ROW_HOOK_NAME,
                               "verify"),
}
