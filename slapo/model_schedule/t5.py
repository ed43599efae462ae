"""T5 (encoder-decoder): q/k/v/o without bias, per-head relative position bias, cross-attention.

Attention reshapes by `n_heads`/`inner_dim`, divided by tp; the relative-position bias embedding
(buckets x heads, in the first block's self-attention) is sharded over heads. In cross-attention
the keys and values read the encoder output, so each projection's input gradient is all-reduced
separately. Encoder blocks are [self-attention, FF], decoder blocks [self, cross, FF], so the
cross-attention rows and the FF at `layer.1` / `layer.2` are optional ("?"), as are v1's `wi`
and v1.1's gated `wi_0`/`wi_1`.
"""

from __future__ import annotations

from ._registry import Family
from .plan import Column, DivideAttr, ReduceInputGrad, Row, ShardParam, Style, TPPlan


def _rows(prefix: str, rows: tuple[tuple[str, Style], ...]) -> tuple[tuple[str, Style], ...]:
    """`rows` with paths under `prefix` ("" is the prefix itself; a trailing "?" stays last)."""
    out = []
    for path, style in rows:
        rel, opt = path.removesuffix("?"), "?" if path.endswith("?") else ""
        out.append((f"{prefix}.{rel}{opt}" if rel else f"{prefix}{opt}", style))
    return tuple(out)


_HEADS = (("", DivideAttr("n_heads")), ("", DivideAttr("inner_dim")))
SELF_ATTENTION = _rows("layer.0.SelfAttention", (
    ("q", Column()), ("k", Column()), ("v", Column()),
    ("", ReduceInputGrad()),
    ("o", Row()), *_HEADS,
    ("relative_attention_bias?", ShardParam("weight", axis=1)),
))
CROSS_ATTENTION = _rows("layer.1.EncDecAttention", (
    ("q?", Column()), ("q?", ReduceInputGrad()),
    ("k?", Column()), ("k?", ReduceInputGrad()),
    ("v?", Column()), ("v?", ReduceInputGrad()),
    ("o?", Row()), ("?", DivideAttr("n_heads")), ("?", DivideAttr("inner_dim")),
))
FEED_FORWARD = (("wi?", Column()), ("wi_0?", Column()), ("wi_1?", Column()),
                ("?", ReduceInputGrad()), ("wo?", Row()))

TP_PLAN = TPPlan((*SELF_ATTENTION, *CROSS_ATTENTION,
                  *_rows("layer.1.DenseReluDense", FEED_FORWARD),     # encoder
                  *_rows("layer.2.DenseReluDense", FEED_FORWARD)))    # decoder

FAMILY = Family(
    name="t5", model_types=("t5", "mt5"), layer_lists=("encoder.block", "decoder.block"),
    tp_plan=TP_PLAN,
    # attention (only its probability dropout is random) and the FF dropout between the
    # column-parallel `wi` and the row-parallel `wo` (feature-sharded) draw per-rank masks
    tp_rng=("layer.0.SelfAttention", "layer.1.EncDecAttention", "layer.1.DenseReluDense.dropout",
            "layer.2.DenseReluDense.dropout"),
    mlp_paths=("layer.1.DenseReluDense", "layer.2.DenseReluDense"))
