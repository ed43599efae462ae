"""LLaMA and its relatives (Mistral, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU.

HF reshapes heads with -1, so sharding q/k/v rows needs no head-count edits; with grouped-query
attention the number of KV heads must also divide by tp.
"""

from __future__ import annotations

from ._common import column, enter_region, row
from ._registry import Family, register_family
from .sequence_parallel import SequencePlan


def shard_layer(layer, ws: int, sequence_parallel: bool = False) -> None:
    sp = sequence_parallel
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    enter_region(attn, sp)  # SP: the whole module sees the gathered sequence (RoPE, mask)
    row(attn["o_proj"], sp)
    for norm in ("q_norm", "k_norm"):  # Qwen3: per-head norms see only this rank's heads
        if norm in attn.child:
            attn[norm].reduce_param_grads()
    mlp = layer["mlp"]
    column(mlp["gate_proj"])
    column(mlp["up_proj"])
    enter_region(mlp, sp)
    row(mlp["down_proj"], sp)


FAMILY = register_family(Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), layer_lists=("layers",),
    shard_layer=shard_layer, mlp_paths=("mlp",),
    tp_rng=("self_attn",),  # its only random op is the core's probability dropout
    # the hidden states are split entering the first layer (the rotary tables and the causal
    # mask are computed on the full sequence before it) and gathered after the final norm.
    sequence_plan=SequencePlan(split="layers.0", gather="norm",
                               norms=("input_layernorm", "post_attention_layernorm",
                                      "/norm"))))
