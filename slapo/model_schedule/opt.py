"""OPT: attention reshapes by `num_heads`; the MLP is `fc1`/`fc2` directly on the layer."""

from __future__ import annotations

from ._common import column, divide_attr, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    reduce_input_grad(attn)
    divide_attr(attn, "num_heads", ws)
    row(attn["out_proj"])
    column(layer["fc1"])
    reduce_input_grad(layer["fc1"])
    row(layer["fc2"])


FAMILY = register_family(Family(
    name="opt", model_types=("opt",), layer_lists=("decoder.layers",), shard_layer=shard_layer))
