"""GPT-Neo: separate q/k/v projections inside `attn.attention`, which reshapes by `num_heads`."""

from __future__ import annotations

from ._common import column, divide_attr, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["attn.attention"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    reduce_input_grad(attn)
    divide_attr(attn, "num_heads", ws)
    row(attn["out_proj"])
    column(layer["mlp.c_fc"])
    reduce_input_grad(layer["mlp.c_fc"])
    row(layer["mlp.c_proj"])


FAMILY = register_family(Family(
    name="gpt_neo", model_types=("gpt_neo",), layer_lists=("h",), shard_layer=shard_layer,
    mlp_paths=("mlp",)))
