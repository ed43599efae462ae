"""GPT-Neo: separate q/k/v projections inside `attn.attention`, which reshapes by `num_heads`."""

from __future__ import annotations

from ._common import column, divide_attr, enter_region, row
from ._registry import Family, register_family
from .sequence_parallel import SequencePlan


def shard_layer(layer, ws: int, sequence_parallel: bool = False) -> None:
    sp = sequence_parallel
    attn = layer["attn.attention"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    # SP: the whole attention module sees the gathered sequence (its causal / local-window mask
    # is built from the query and key lengths)
    enter_region(attn, sp)
    divide_attr(attn, "num_heads", ws)
    row(attn["out_proj"], sp)
    column(layer["mlp.c_fc"])
    enter_region(layer["mlp.c_fc"], sp)
    row(layer["mlp.c_proj"], sp)


FAMILY = register_family(Family(
    name="gpt_neo", model_types=("gpt_neo",), layer_lists=("h",), shard_layer=shard_layer,
    mlp_paths=("mlp",),
    # GPTNeoSelfAttention applies its probability dropout as the `attn_dropout` module (its
    # `resid_dropout`, after the row-parallel all-reduce, stays in the default stream)
    tp_rng=("attn.attention.attn_dropout",),
    # as GPT-2: split at the embedding dropout (after `wte + wpe`, positions and the mask are
    # full-sequence), gather after `ln_f` (before the model's `view` to the full length)
    sequence_plan=SequencePlan(split="transformer.drop", gather="transformer.ln_f",
                               norms=("ln_1", "ln_2", "/transformer.ln_f"),
                               dropouts=("/transformer.drop", "attn.attention.resid_dropout",
                                         "mlp.dropout"))))
