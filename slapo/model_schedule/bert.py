"""BERT (also the template for RoBERTa): Megatron TP per `BertLayer`."""

from __future__ import annotations

from ._registry import Family
from .plan import Column, EnterRegion, Row, TPPlan
from .sequence_parallel import SequencePlan

TP_PLAN = TPPlan((
    ("attention.self.query", Column()),
    ("attention.self.key", Column()),
    ("attention.self.value", Column()),
    # SP: gather the self-attention's input (BertAttention keeps the sharded input for its
    # residual, after `attention.output`)
    ("attention.self", EnterRegion()),
    ("attention.output.dense", Row()),
    ("intermediate.dense", Column()),
    ("intermediate.dense", EnterRegion()),
    ("output.dense", Row()),
))

FAMILY = Family(
    name="bert", model_types=("bert",), layer_lists=("encoder.layer",),
    tp_plan=TP_PLAN, mlp_paths=("intermediate",),
    # BertSelfAttention draws only the probability dropout; `attention.output.dropout` and
    # `output.dropout` act after the row-parallel all-reduce (replicated)
    tp_rng=("attention.self",),
    context_parallel="attention.self",  # bidirectional: the module's is_causal is False
    # post-LN: the norms and dropouts sit inside `attention.output` / `output`. The embeddings
    # (positions, token types, their norm) run on the full sequence before the first layer; the
    # encoder's output is gathered, then the (replicated) MLM transform and pooler run on it.
    sequence_plan=SequencePlan(split="encoder.layer.0", gather="encoder",
                               norms=("attention.output.LayerNorm", "output.LayerNorm"),
                               dropouts=("attention.output.dropout", "output.dropout"),
                               gather_feeds_head=False))
