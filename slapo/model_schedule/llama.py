"""LLaMA and its relatives (Mistral, Qwen2): GQA, RoPE, RMSNorm, SwiGLU.

HF reshapes heads with -1, so sharding q/k/v rows needs no head-count edits; with grouped-query
attention the number of KV heads must also divide by tp.
"""

from __future__ import annotations

from ._common import column, reduce_input_grad, row
from ._registry import Family, register_family


def shard_layer(layer, ws: int) -> None:
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    reduce_input_grad(attn)
    row(attn["o_proj"])
    mlp = layer["mlp"]
    column(mlp["gate_proj"])
    column(mlp["up_proj"])
    reduce_input_grad(mlp)
    row(mlp["down_proj"])


FAMILY = register_family(Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), layer_lists=("layers",),
    shard_layer=shard_layer, mlp_paths=("mlp",)))
