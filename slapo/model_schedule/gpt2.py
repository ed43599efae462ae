"""GPT-2: fused q|k|v `c_attn` (HF Conv1D, weight (in, 3*out)) sharded per q/k/v block."""

from __future__ import annotations

from ._registry import Family
from .plan import Column, DivideAttr, EnterRegion, Row, TPPlan
from .sequence_parallel import SequencePlan

TP_PLAN = TPPlan((
    ("attn.c_attn", Column(blocks=3)),
    # GPT2Attention reshapes q/k/v by its *input's* shape, so under SP the attention module's
    # input is gathered (not c_attn's): q/k/v, the mask and the output all see the full sequence.
    ("attn.c_attn", EnterRegion(only="plain")),
    ("attn", EnterRegion(only="sp")),
    ("attn", DivideAttr("split_size")),  # it splits c_attn's output by this; heads use -1
    ("attn.c_proj", Row()),
    ("mlp.c_fc", Column()),
    ("mlp.c_fc", EnterRegion()),
    ("mlp.c_proj", Row()),
))

FAMILY = Family(
    name="gpt2", model_types=("gpt2",), layer_lists=("h",), tp_plan=TP_PLAN,
    mlp_paths=("mlp",),
    context_parallel="attn",  # learned positions: `wpe(position_ids)` of the cp batch's ids
    # the attention core (heads sharded) draws per-rank masks; `attn.resid_dropout`, in the same
    # module but after the row-parallel all-reduce, must not: fork the core alone
    tp_rng_core=("attn",),
    # the hidden states are split at the embedding dropout (after `wte + wpe`: positions are
    # full-sequence) and gathered after `ln_f`; residual-path dropouts see sequence shards.
    sequence_plan=SequencePlan(split="transformer.drop", gather="transformer.ln_f",
                               norms=("ln_1", "ln_2", "/transformer.ln_f"),
                               dropouts=("/transformer.drop", "attn.resid_dropout",
                                         "mlp.dropout")))


def __getattr__(name: str):
    """2023's names here, from the compatibility edge (`model_schedule/compat.py`), imported on
    first use (compat imports the registry, which imports this family)."""
    if name == "gen_embedding_hooks":
        from .compat import gen_embedding_hooks

        return gen_embedding_hooks
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
