"""GPT-Neo: separate q/k/v projections inside `attn.attention`, which reshapes by `num_heads`."""

from __future__ import annotations

from ._registry import Family
from .plan import Column, DivideAttr, EnterRegion, Row, TPPlan
from .sequence_parallel import SequencePlan

TP_PLAN = TPPlan((
    ("attn.attention.q_proj", Column()),
    ("attn.attention.k_proj", Column()),
    ("attn.attention.v_proj", Column()),
    # SP: the whole attention module sees the gathered sequence (its causal / local-window mask
    # is built from the query and key lengths)
    ("attn.attention", EnterRegion()),
    ("attn.attention", DivideAttr("num_heads")),
    ("attn.attention.out_proj", Row()),
    ("mlp.c_fc", Column()),
    ("mlp.c_fc", EnterRegion()),
    ("mlp.c_proj", Row()),
))

FAMILY = Family(
    name="gpt_neo", model_types=("gpt_neo",), layer_lists=("h",), tp_plan=TP_PLAN,
    mlp_paths=("mlp",),
    # GPTNeoSelfAttention applies its probability dropout as the `attn_dropout` module (its
    # `resid_dropout`, after the row-parallel all-reduce, stays in the default stream)
    tp_rng=("attn.attention.attn_dropout",),
    # as GPT-2: split at the embedding dropout (after `wte + wpe`, positions and the mask are
    # full-sequence), gather after `ln_f` (before the model's `view` to the full length)
    sequence_plan=SequencePlan(split="transformer.drop", gather="transformer.ln_f",
                               norms=("ln_1", "ln_2", "/transformer.ln_f"),
                               dropouts=("/transformer.drop", "attn.attention.resid_dropout",
                                         "mlp.dropout")))
