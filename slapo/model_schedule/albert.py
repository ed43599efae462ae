"""ALBERT: one layer's weights shared by every layer, so sharding it once shards them all."""

from __future__ import annotations

from ._registry import Family
from .plan import Column, ReduceInputGrad, Row, TPPlan

# AlbertAttention adds its input back (residual + LayerNorm inside the module), so its input
# gradient is not all partial: reduce only what flows through each sharded projection.
TP_PLAN = TPPlan((
    ("attention.query", Column()), ("attention.query", ReduceInputGrad()),
    ("attention.key", Column()), ("attention.key", ReduceInputGrad()),
    ("attention.value", Column()), ("attention.value", ReduceInputGrad()),
    ("attention.dense", Row()),
    ("ffn", Column()), ("ffn", ReduceInputGrad()),
    ("ffn_output", Row()),
))

FAMILY = Family(
    name="albert", model_types=("albert",), layer_lists=("albert_layer_groups.0.albert_layers",),
    tp_plan=TP_PLAN,
    tp_rng_core=("attention",),  # AlbertAttention also holds the replicated output_dropout
    notes="layers share weights: ckpt_ratio > 0 checkpoints the shared layer (all of them).")
