"""GPT-2: fused q|k|v `c_attn` (HF Conv1D, weight (in, 3*out)) sharded per q/k/v block."""

from __future__ import annotations

from ._common import column, divide_attr, enter_region, row
from ._registry import Family, register_family
from .sequence_parallel import SequencePlan


def shard_layer(layer, ws: int, sequence_parallel: bool = False) -> None:
    sp = sequence_parallel
    attn = layer["attn"]
    column(attn["c_attn"], blocks=3)
    # GPT2Attention reshapes q/k/v by its *input's* shape, so under SP the attention module's
    # input is gathered (not c_attn's): q/k/v, the mask and the output all see the full sequence.
    enter_region(attn if sp else attn["c_attn"], sp)
    divide_attr(attn, "split_size", ws)
    row(attn["c_proj"], sp)
    column(layer["mlp.c_fc"])
    enter_region(layer["mlp.c_fc"], sp)
    row(layer["mlp.c_proj"], sp)


FAMILY = register_family(Family(
    name="gpt2", model_types=("gpt2",), layer_lists=("h",), shard_layer=shard_layer,
    mlp_paths=("mlp",),
    # the attention core (heads sharded) draws per-rank masks; `attn.resid_dropout`, in the same
    # module but after the row-parallel all-reduce, must not: fork the core alone
    tp_rng_core=("attn",),
    # the hidden states are split at the embedding dropout (after `wte + wpe`: positions are
    # full-sequence) and gathered after `ln_f`; residual-path dropouts see sequence shards.
    sequence_plan=SequencePlan(split="transformer.drop", gather="transformer.ln_f",
                               norms=("ln_1", "ln_2", "/transformer.ln_f"),
                               dropouts=("/transformer.drop", "attn.resid_dropout",
                                         "mlp.dropout"))))
