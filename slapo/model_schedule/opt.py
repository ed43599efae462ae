"""OPT: attention reshapes by `num_heads`; the MLP is `fc1`/`fc2` directly on the layer."""

from __future__ import annotations

from ..errors import SchedulingError
from ..schedule import Schedule
from ._common import column, divide_attr, enter_region, find_path, row
from ._registry import Family, register_family
from .sequence_parallel import SequencePlan


def shard_layer(layer, ws: int, sequence_parallel: bool = False) -> None:
    sp = sequence_parallel
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    enter_region(attn, sp)  # SP: the attention module sees the gathered sequence (and mask)
    divide_attr(attn, "num_heads", ws)
    row(attn["out_proj"], sp)
    column(layer["fc1"])
    # OPTDecoderLayer flattens the MLP's input to [B*S, H]: the MLP is token-wise, so gather and
    # reduce-scatter along those flattened tokens (axis 0) instead of the sequence axis
    enter_region(layer["fc1"], sp, token_axis=0)
    row(layer["fc2"], sp, token_axis=0)


def check_sequence_parallel(sch: Schedule) -> None:
    """SP gathers the final norm's output straight into the (vocabulary-parallel) head; OPT
    variants with `project_in/out` (word_embed_proj_dim != hidden_size) or post-LN layers
    (no decoder `final_layer_norm`) would put replicated work with parameters in between."""
    cfg = sch.mod.config
    if cfg.word_embed_proj_dim != cfg.hidden_size or find_path(sch.mod, "project_out"):
        raise SchedulingError(sch.path, f"sequence_parallel for OPT needs word_embed_proj_dim "
                              f"== hidden_size (got {cfg.word_embed_proj_dim} != "
                              f"{cfg.hidden_size}: project_in/project_out are not covered).",
                              "use sequence_parallel=False (plain tp works) for this variant.")
    if not cfg.do_layer_norm_before or find_path(sch.mod, "decoder.final_layer_norm") is None:
        raise SchedulingError(sch.path, "sequence_parallel for OPT needs pre-LN layers "
                              "(do_layer_norm_before=True, a decoder final_layer_norm).",
                              "use sequence_parallel=False for this variant.")


FAMILY = register_family(Family(
    name="opt", model_types=("opt",), layer_lists=("decoder.layers",), shard_layer=shard_layer,
    tp_rng=("self_attn",),  # the residual dropouts are functional calls of the layer itself
    # split entering the first layer (learned positions and the causal mask are full-sequence),
    # gather after the decoder's final norm. The residual-path dropouts are functional calls in
    # the layer's forward, so the whole layer runs in the per-rank RNG stream (".": inside the
    # attention the heads are sharded, so per-rank masks are right there too).
    sequence_plan=SequencePlan(split="decoder.layers.0", gather="decoder.final_layer_norm",
                               norms=("self_attn_layer_norm", "final_layer_norm",
                                      "/decoder.final_layer_norm"),
                               dropouts=(".",), validate=check_sequence_parallel)))
