"""T5 (encoder-decoder): q/k/v/o without bias, per-head relative position bias, cross-attention.

Attention reshapes by `n_heads`/`inner_dim`, divided by tp; the relative-position bias embedding
(buckets x heads) is sharded over heads. In cross-attention the keys and values read the encoder
output, so each projection's input gradient is all-reduced separately.
"""

from __future__ import annotations

from ._common import column, divide_attr, reduce_input_grad, row
from ._registry import Family, register_family


def _attention(attn, ws: int, cross: bool) -> None:
    for name in ("q", "k", "v"):
        column(attn[name])
        if cross:
            reduce_input_grad(attn[name])
    if not cross:
        reduce_input_grad(attn)
    row(attn["o"])
    divide_attr(attn, "n_heads", ws)
    divide_attr(attn, "inner_dim", ws)
    if "relative_attention_bias" in attn.child:
        attn["relative_attention_bias"].shard("weight", axis=1)


def _mlp(ff, ws: int) -> None:
    for name in ("wi", "wi_0", "wi_1"):
        if name in ff.child:
            column(ff[name])
    reduce_input_grad(ff)
    row(ff["wo"])


def shard_layer(block, ws: int) -> None:
    for sub in block["layer"]:
        if "SelfAttention" in sub.child:
            _attention(sub["SelfAttention"], ws, cross=False)
        elif "EncDecAttention" in sub.child:
            _attention(sub["EncDecAttention"], ws, cross=True)
        elif "DenseReluDense" in sub.child:
            _mlp(sub["DenseReluDense"], ws)


FAMILY = register_family(Family(
    name="t5", model_types=("t5", "mt5"), layer_lists=("encoder.block", "decoder.block"),
    shard_layer=shard_layer,
    # attention (only its probability dropout is random) and the FF dropout between the
    # column-parallel `wi` and the row-parallel `wo` (feature-sharded) draw per-rank masks
    tp_rng=("layer.0.SelfAttention", "layer.1.EncDecAttention", "layer.1.DenseReluDense.dropout",
            "layer.2.DenseReluDense.dropout"),
    # encoder blocks: [self-attention, FF]; decoder blocks: [self, cross, FF]
    mlp_paths=("layer.1.DenseReluDense", "layer.2.DenseReluDense")))
