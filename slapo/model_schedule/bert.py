"""BERT (also the template for RoBERTa): Megatron TP per `BertLayer`."""

from __future__ import annotations

from ._common import column, enter_region, row
from ._registry import Family, register_family
from .sequence_parallel import SequencePlan


def shard_layer(layer, ws: int, sequence_parallel: bool = False) -> None:
    sp = sequence_parallel
    attn = layer["attention.self"]
    for name in ("query", "key", "value"):
        column(attn[name])
    enter_region(attn, sp)  # SP: BertAttention keeps the sharded input for its residual
    row(layer["attention.output.dense"], sp)
    column(layer["intermediate.dense"])
    enter_region(layer["intermediate.dense"], sp)
    row(layer["output.dense"], sp)


FAMILY = register_family(Family(
    name="bert", model_types=("bert",), layer_lists=("encoder.layer",),
    shard_layer=shard_layer, mlp_paths=("intermediate",),
    # BertSelfAttention draws only the probability dropout; `attention.output.dropout` and
    # `output.dropout` act after the row-parallel all-reduce (replicated)
    tp_rng=("attention.self",),
    # post-LN: the norms and dropouts sit inside `attention.output` / `output`. The embeddings
    # (positions, token types, their norm) run on the full sequence before the first layer; the
    # encoder's output is gathered, then the (replicated) MLM transform and pooler run on it.
    sequence_plan=SequencePlan(split="encoder.layer.0", gather="encoder",
                               norms=("attention.output.LayerNorm", "output.LayerNorm"),
                               dropouts=("attention.output.dropout", "output.dropout"),
                               gather_feeds_head=False)))
