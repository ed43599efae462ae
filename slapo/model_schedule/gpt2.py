"""GPT-2: fused q|k|v `c_attn` (HF Conv1D, weight (in, 3*out)) sharded per q/k/v block."""

from __future__ import annotations

from ._common import column, divide_attr, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["attn"]
    column(attn["c_attn"], blocks=3)
    reduce_input_grad(attn["c_attn"])
    divide_attr(attn, "split_size", ws)
    row(attn["c_proj"])
    column(layer["mlp.c_fc"])
    reduce_input_grad(layer["mlp.c_fc"])
    row(layer["mlp.c_proj"])


FAMILY = register_family(Family(
    name="gpt2", model_types=("gpt2",), layer_lists=("h",), shard_layer=shard_layer,
    mlp_paths=("mlp",)))
