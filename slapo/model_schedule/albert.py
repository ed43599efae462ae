"""ALBERT: one layer's weights shared by every layer, so sharding it once shards them all."""

from __future__ import annotations

from ._common import column, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["attention"]
    # AlbertAttention adds its input back (residual + LayerNorm inside the module), so its input
    # gradient is not all partial: reduce only what flows through each sharded projection.
    for name in ("query", "key", "value"):
        column(attn[name])
        reduce_input_grad(attn[name])
    row(attn["dense"])
    column(layer["ffn"])
    reduce_input_grad(layer["ffn"])
    row(layer["ffn_output"])


FAMILY = register_family(Family(
    name="albert", model_types=("albert",), layer_lists=("albert_layer_groups.0.albert_layers",),
    shard_layer=shard_layer,
    tp_rng_core=("attention",),  # AlbertAttention also holds the replicated output_dropout
    notes="layers share weights: ckpt_ratio > 0 checkpoints the shared layer (all of them)."))
