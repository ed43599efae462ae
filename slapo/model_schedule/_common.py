"""Helpers shared by `apply` and the per-architecture schedules: finding a family's modules,
the vocabulary-parallel embedding and head, layer checkpointing, the tensor-parallel
divisibility check and the per-rank dropout streams. A layer's own tensor-parallel plan is data
(`plan.TPPlan`, one table per family file); its styles (column, row, ...) live in `plan.py`.
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..errors import SchedulingError
from ..module_patch import module_meta, original_class, wrappers
from ..op.attention_core import AttentionCore
from ..schedule import Schedule

SEQ_DIM = 1  # Hugging Face hidden states are [batch, sequence, hidden]


def find_path(model: nn.Module, suffix: str) -> str | None:
    """Full path of the first module named `suffix` or ending with `.suffix` (so schedules work
    for every HF head class: `encoder.layer` in BertModel is `bert.encoder.layer` in
    BertForMaskedLM)."""
    for name, _ in model.named_modules():
        if name == suffix or name.endswith("." + suffix):
            return name
    return None


def require_path(sch: Schedule, suffix: str, family: str) -> str:
    path = find_path(sch.mod, suffix)
    if path is None:
        raise SchedulingError(sch.path, f"the {family} schedule expects a submodule "
                              f"'{suffix}', which this model does not have.",
                              "check the model class, or write a schedule for this variant.")
    return path


def vocab_parallel(sch: Schedule, head_input_grad: bool = True) -> bool:
    """Shard the input embedding (and the LM head, tied or not) over the vocabulary.

    Embedding lookups of ids owned by other ranks give zeros and are summed (all-reduce); the
    head's vocabulary-sharded logits are all-gathered for the loss. Returns False (and changes
    nothing) when the vocabulary is not divisible by the tensor-parallel degree, or when the
    embedding's class overrides `nn.Embedding.forward` (Gemma 3's scaled embedding multiplies
    the lookup by `embed_scale`): the vocabulary-parallel kernel replaces that forward, so the
    model would silently lose what the override adds; or when the model's forward reads the
    head's `out_features` (Apertus 1.5 passes it to its loss as the vocabulary size), which the
    shard makes this rank's share.
    `head_input_grad=False` leaves the head's input-gradient reduction to the caller (sequence
    parallelism gathers the head's input with a reduce-scatter backward instead).
    """
    model, ws = sch.mod, sch.tp_size
    get_in = getattr(model, "get_input_embeddings", None)
    emb = get_in() if callable(get_in) else None
    if emb is None or not isinstance(emb, nn.Embedding) or emb.num_embeddings % ws:
        return False
    if original_class(emb).forward is not nn.Embedding.forward or _reads_head_width(model):
        return False
    get_out = getattr(model, "get_output_embeddings", None)
    head = get_out() if callable(get_out) else None
    if head is not None and (not isinstance(head, nn.Linear) or head.out_features % ws):
        return False
    sch._node_of(emb).shard("weight", axis=0)
    # every embedding module holding this weight is a lookup (T5: shared, encoder, decoder)
    for _, node in sch.named_schedules():
        mod = node.mod
        if isinstance(mod, nn.Embedding) and mod.weight is emb.weight and \
                ("fwd_post", "all_reduce") not in module_meta(mod).get("syncs", []):
            node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    if head is not None:
        head_node = sch._node_of(head)
        if getattr(head.weight, "_slapo_shard", None) is None:
            head_node.shard("weight", axis=0)
        if head.bias is not None and getattr(head.bias, "_slapo_shard", None) is None:
            head_node.shard("bias", axis=0)
        if head_input_grad:  # its input feeds the vocabulary-sharded head (Megatron f)
            head_node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        head_node.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)
    return True


def _reads_head_width(model: nn.Module) -> bool:
    import inspect

    try:
        return ".out_features" in inspect.getsource(original_class(model).forward)
    except (OSError, TypeError):
        return False


def checkpoint_layers(layers: list[Schedule], ratio: float, policy=None) -> int:
    """Checkpoint the first round-half-up(ratio * L) layers (the earliest activations live
    longest); `policy` as the checkpoint primitive's (None: full, "selective": SAC)."""
    if not 0.0 <= ratio <= 1.0:
        raise SchedulingError(layers[0].parent.path if layers else "", f"ckpt_ratio must be "
                              f"in [0, 1], got {ratio}.", "pass e.g. ckpt_ratio=0.5.")
    n = math.floor(ratio * len(layers) + 0.5)  # round half up: ratio 0.5 of 1 layer checkpoints it
    for node in layers[:n]:
        if policy is None:
            node.checkpoint()
        else:
            node.checkpoint(policy=policy)
    return n


def offload_layers(layers: list[Schedule], ratio: float, after: int) -> None:
    """Offload (`offload` primitive) the saved activations of round-half-up(ratio * L) layers
    from layer `after` on (the ones after the checkpointed layers: a layer is checkpointed or
    offloaded, and the earliest layers, whose activations live longest, are recomputed)."""
    chosen = layers[after:after + math.floor(ratio * len(layers) + 0.5)]
    for node in chosen:
        node.offload()
    if chosen:  # backward reaches the last of them first: its prefetch starts at the layer
        from ..primitives.offload import prefetch_first_reached  # after it, or at the loss

        rest = layers[after + len(chosen):]
        prefetch_first_reached(chosen[-1], rest[0] if rest else None)


# ---- tensor-parallel dropout: per-rank masks inside sharded regions -------------------------

class HFAttentionCore(AttentionCore):
    """The model's own attention function (`eager_attention_forward` of its modeling file, or
    the registry entry its config names, e.g. "sdpa") behind the attention-core interface.

    Why: GPT-2 and ALBERT keep a *replicated* residual dropout inside the same module as the
    head-sharded attention core, so neither the module (its residual dropout must draw the same
    mask on every rank) nor an `nn.Dropout` child (the core's dropout is functional, inside
    SDPA) can be put in the per-rank RNG stream. Routing the call through this child module
    makes the core alone forkable; the numbers are the model's own (same function, same mask).
    """

    runs_model_function = True  # every input HF passed reaches the model's own function

    def __init__(self, impl: str, eager_fn):
        super().__init__()
        self.impl = impl
        self._eager = eager_fn

    def forward(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        if self.impl == "eager":
            return self._eager(module, query, key, value, attention_mask, **kwargs)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.impl](module, query, key, value, attention_mask,
                                                   **kwargs)


def install_hf_core(node: Schedule) -> bool:
    """Give HF attention module `node` an `attn_core` running its own implementation (see
    `HFAttentionCore`); False (nothing changed) when it has a core or is no HF attention."""
    import sys

    from ..op import is_hf_attention, use_attention_core

    mod = node.mod
    if "attn_core" in mod._modules or not is_hf_attention(mod):
        return False
    eager = getattr(sys.modules[type(mod).__module__], "eager_attention_forward", None)
    impl = mod.config._attn_implementation or "eager"
    if impl == "eager" and eager is None:
        return False
    node.replace(use_attention_core(mod, HFAttentionCore(impl, eager), node.path))
    return True


def _forked(mod: nn.Module) -> bool:
    return any(w.name == "fork_rng" for w in wrappers(mod))


def fork_sharded_rng(layer: Schedule, paths: tuple[str, ...], core_paths: tuple[str, ...]) -> int:
    """Run the random ops of `layer`'s sharded regions in the per-rank TP stream (`fork_rng`).

    `paths`: modules (relative to the layer) whose every random op is inside a head- or
    feature-sharded region (BERT's self-attention, LLaMA's attention, T5's FF dropout);
    `core_paths`: attention modules that also hold replicated dropout, whose `attn_core` alone
    is forked. Missing paths are skipped (T5 encoder blocks have no cross-attention); a module
    already in (or containing, or inside) a forked module is left alone: nested forks of the
    same stream would replay its numbers. Returns the number of modules forked."""
    targets = [layer[p] for p in paths if p in layer]
    targets += [layer[p]["attn_core"] for p in core_paths
                if p in layer and "attn_core" in layer[p].mod._modules]
    n = 0
    for node in targets:
        if _forked_around(layer, node):
            continue
        node.fork_rng(draws="dropout")
        n += 1
    return n


def _forked_around(layer: Schedule, node: Schedule) -> bool:
    """A fork_rng on `node`, a module inside it, or a module between the root and it."""
    if any(_forked(m) for m in node.mod.modules()):
        return True
    up = node.parent
    while up is not None:
        if _forked(up.mod):
            return True
        up = up.parent
    return False
