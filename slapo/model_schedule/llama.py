"""LLaMA and its relatives (Mistral, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU.

HF reshapes heads with -1, so sharding q/k/v rows needs no head-count edits; with grouped-query
attention the number of KV heads must also divide by tp.
"""

from __future__ import annotations

from ._registry import Family
from .plan import Column, EnterRegion, ReduceParamGrads, Row, TPPlan
from .sequence_parallel import SequencePlan

TP_PLAN = TPPlan((
    ("self_attn.q_proj", Column()),
    ("self_attn.k_proj", Column()),
    ("self_attn.v_proj", Column()),
    ("self_attn", EnterRegion()),  # SP: the whole module sees the gathered sequence (RoPE, mask)
    ("self_attn.o_proj", Row()),
    # Qwen3 only: per-head norms see only this rank's heads, so their gradients are partial
    ("self_attn.q_norm?", ReduceParamGrads()),
    ("self_attn.k_norm?", ReduceParamGrads()),
    ("mlp.gate_proj", Column()),
    ("mlp.up_proj", Column()),
    ("mlp", EnterRegion()),
    ("mlp.down_proj", Row()),
))

FAMILY = Family(
    name="llama", model_types=("llama", "mistral", "qwen2", "qwen3"), layer_lists=("layers",),
    tp_plan=TP_PLAN, mlp_paths=("mlp",),
    context_parallel="self_attn",  # sliding windows: the window HF passes each layer
    tp_rng=("self_attn",),  # its only random op is the core's probability dropout
    # the hidden states are split entering the first layer (the rotary tables and the causal
    # mask are computed on the full sequence before it) and gathered after the final norm.
    sequence_plan=SequencePlan(split="layers.0", gather="norm",
                               norms=("input_layernorm", "post_attention_layernorm",
                                      "/norm")))
