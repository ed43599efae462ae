"""OPT: attention reshapes by `num_heads`; the MLP is `fc1`/`fc2` directly on the layer."""

from __future__ import annotations

from ..errors import SchedulingError
from ..schedule import Schedule
from ._common import find_path
from ._registry import Family
from .plan import Column, DivideAttr, EnterRegion, Row, TPPlan
from .sequence_parallel import SequencePlan

TP_PLAN = TPPlan((
    ("self_attn.q_proj", Column()),
    ("self_attn.k_proj", Column()),
    ("self_attn.v_proj", Column()),
    ("self_attn", EnterRegion()),  # SP: the attention module sees the gathered sequence (and mask)
    ("self_attn", DivideAttr("num_heads")),
    ("self_attn.out_proj", Row()),
    ("fc1", Column()),
    # OPTDecoderLayer flattens the MLP's input to [B*S, H]: the MLP is token-wise, so gather and
    # reduce-scatter along those flattened tokens (axis 0) instead of the sequence axis
    ("fc1", EnterRegion(token_axis=0)),
    ("fc2", Row(token_axis=0)),
))


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


FAMILY = Family(
    name="opt", model_types=("opt",), layer_lists=("decoder.layers",), tp_plan=TP_PLAN,
    tp_rng=("self_attn",),  # the residual dropouts are functional calls of the layer itself
    context_parallel="self_attn",  # positions: the cp split passes OPT's own (position_rule)
    # split entering the first layer (learned positions and the causal mask are full-sequence),
    # gather after the decoder's final norm. The residual-path dropouts are functional calls in
    # the layer's forward, so the whole layer runs in the per-rank RNG stream (".": inside the
    # attention the heads are sharded, so per-rank masks are right there too).
    sequence_plan=SequencePlan(split="decoder.layers.0", gather="decoder.final_layer_norm",
                               norms=("self_attn_layer_norm", "final_layer_norm",
                                      "/decoder.final_layer_norm"),
                               dropouts=(".",), validate=check_sequence_parallel))
