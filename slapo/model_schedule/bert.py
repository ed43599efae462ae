"""BERT (also the template for RoBERTa): Megatron TP per `BertLayer`."""

from __future__ import annotations

from ._common import column, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["attention.self"]
    for name in ("query", "key", "value"):
        column(attn[name])
    reduce_input_grad(attn)
    row(layer["attention.output.dense"])
    column(layer["intermediate.dense"])
    reduce_input_grad(layer["intermediate.dense"])
    row(layer["output.dense"])


FAMILY = register_family(Family(
    name="bert", model_types=("bert",), layer_lists=("encoder.layer",),
    shard_layer=shard_layer, mlp_paths=("intermediate",)))
