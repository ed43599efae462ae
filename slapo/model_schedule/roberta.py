"""RoBERTa: the BERT layer structure with its own embeddings and LM head.

Sequence parallelism follows BERT's plan: RoBERTa's embeddings differ only in how position ids
are made (from the padding mask of `input_ids`), which happens on the full sequence before the
split; its LM head (`dense` -> GELU -> `layer_norm` -> `decoder`) is replicated ahead of the
vocabulary-parallel `decoder`, so the gathered encoder output does not feed the head directly.
"""

from __future__ import annotations

from . import bert
from ._registry import Family

FAMILY = Family(
    name="roberta", model_types=("roberta", "xlm-roberta", "camembert"),
    layer_lists=("encoder.layer",), tp_plan=bert.TP_PLAN, mlp_paths=("intermediate",),
    tp_rng=bert.FAMILY.tp_rng,
    context_parallel="attention.self",  # positions: the cp split passes RoBERTa's own
    sequence_plan=bert.FAMILY.sequence_plan)
