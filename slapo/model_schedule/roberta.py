"""RoBERTa: the BERT layer structure with its own embeddings and LM head."""

from __future__ import annotations

from . import bert
from ._registry import Family, register_family

FAMILY = register_family(Family(
    name="roberta", model_types=("roberta", "xlm-roberta", "camembert"),
    layer_lists=("encoder.layer",), shard_layer=bert.shard_layer, mlp_paths=("intermediate",)))
