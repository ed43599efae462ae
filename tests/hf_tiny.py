"""Tiny configs of every text decoder the installed transformers declares a tensor-parallel plan
for: the architectures `tests/test_hf_plans.py` sweeps.

One builder for all of them: the config class's defaults, with the sizes that make a model big
shrunk by their (standard or family-specific) field names, so a new architecture in a new
transformers is swept without an entry here. A model type whose defaults do not build (fields
left None, layer types the model requires but does not default) has a row in `OVERRIDES`, with
why. What cannot be built is reported with the reason.
"""

from __future__ import annotations

import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SIZES = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=128, intermediate_size=128, head_dim=16, max_position_embeddings=64,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
# family-specific size fields (by name), shrunk when the config has them: MLA's latent ranks and
# rotary/no-rotary head dims, partial rotary, per-layer-input vocabularies, sliding windows
PATTERNS = ((r"^qk_rope_head_dim$", 8), (r"^qk_nope_head_dim$", 8), (r"^v_head_dim$", 16),
            (r"^kv_lora_rank$", 16), (r"^q_lora_rank$", 32), (r"^rotary_dim$", 8),
            (r"vocab_size", 128), (r"^sliding_window$", 4), (r"^num_kv_shared_layers$", 0),
            (r"intermediate_size", 128), (r"head_dim$", 16),
            # the dense layers before the first MoE layer: 1, so layer 1 of 2 has experts
            (r"^first_k_dense_replace$", 1))
SEQ = 8
# Fields a model type's defaults leave unusable (the model does not build, or 2 layers hold
# none of what its plan splits), set as the released checkpoints set them, at test size.
OVERRIDES: dict[str, tuple[dict, str]] = {
    "cohere_compass_text": (
        {"layer_types": ["sliding_attention", "full_attention"], "logit_scale": 0.5,
         "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                   "mrope_section": [4, 2, 2]},
                             "full_attention": None}},
        "its defaults carry no RoPE parameters, which the model reads per layer type; the "
        "layers its config's back-compat rule interleaves: sliding with RoPE (mrope_section "
        "sums to head_dim / 2), full without (None: NoPE); a logit scale that is not 1"),
    "dots1": (
        {"n_routed_experts": 4, "n_shared_experts": 1},
        "its defaults leave the routed and shared expert counts None (a checkpoint sets them)"),
    "jamba": (
        {"attn_layer_period": 2, "attn_layer_offset": 0},
        "its layer types derive from the attention period (default: layer 4 of every 8, so 2 "
        "layers are all Mamba): layer 0 attention with a dense MLP, layer 1 Mamba with the "
        "experts, as the defaults pair them"),
    "lfm2_moe": (
        {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
        "its defaults leave layer_types None, and 2 dense layers would leave no experts"),
    "qwen4_exp_text": (
        {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 16,
         "indexer_budget": 4, "indexer_compress_ratio": 2},
        "its indexed attention layers always build the QSA indexer, whose sizes default to "
        "None (one key head is required; a budget of 2 blocks of 2 selects within SEQ)"),
}


# Model types whose forward needs the tensors the class keeps in float32 to *be* float32 (a
# float64 model does not run otherwise): Inkling 2 casts its router's input to float32 and
# multiplies it by the router weight. Every other model runs wholly in float64 (stricter: a
# float32 part's roundoff would be amplified by AdamW in the parameters).
KEEP_FP32 = ("inkling2_text", "inkling2_loop_text")


class CannotBuild(Exception):
    """The tiny config or model could not be made (the reason is the message)."""


def decoders(plan: str = "base_model_tp_plan") -> list[tuple[str, str]]:
    """(model_type, *ForCausalLM class name) of every architecture whose config declares a
    `plan` (the tensor-parallel plan; `base_model_pp_plan`: the pipeline plan), sorted."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        try:
            cfg_cls = CONFIG_MAPPING[model_type]
        except KeyError:
            continue
        if getattr(cfg_cls, plan, None) and cls_name.endswith("ForCausalLM"):
            out.append((model_type, cls_name))
    return out


def _layer_types(default) -> list[str] | None:
    """One layer of each kind the default config mixes (full attention last: some configs
    insist), so a 2-layer model still has sliding and full, or linear and full, layers."""
    types = getattr(default, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(set(types)) < 2:
        return None
    kinds = list(dict.fromkeys(types))
    if "full_attention" in kinds:
        kinds.remove("full_attention")
        kinds.append("full_attention")
    return kinds


def _derived(cls, name: str) -> bool:
    """True when the config computes `name` from other fields (a read-only property, like
    Jamba's layer types from its attention period): it cannot be given, only its sources."""
    return isinstance(getattr(cls, name, None), property)


def tiny_config(model_type: str):
    """The model type's config with its defaults, at test size, dropout off."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    try:
        default = cls()
    except Exception as e:  # noqa: BLE001 - a config without usable defaults
        raise CannotBuild(f"default config: {type(e).__name__}: {e}") from e
    subs = sorted(getattr(cls, "sub_configs", None) or {})
    if subs:
        raise CannotBuild(f"composite config (sub-configs {subs}): not a text decoder")
    kw = dict(SIZES)
    for name, value in vars(default).items():
        if name in kw or isinstance(value, bool):
            continue
        if isinstance(value, float) and re.search(r"dropout|pdrop", name):
            kw[name] = 0.0
        elif isinstance(value, int):
            for pattern, small in PATTERNS:
                if re.search(pattern, name):
                    kw[name] = min(value, small) if small else 0
                    break
    kinds = _layer_types(default)
    if kinds and not _derived(cls, "layer_types"):
        kw["layer_types"], kw["num_hidden_layers"] = kinds, len(kinds)
    if "qk_rope_head_dim" in kw:  # MLA: one KV head per query head, the rotary part is head_dim
        kw.update(head_dim=kw["qk_rope_head_dim"], num_key_value_heads=SIZES["num_attention_heads"])
    if getattr(default, "num_experts_per_tok", 0) is None:  # DeepSeek-V2's default: no top-k
        kw["num_experts_per_tok"] = 2
    kw.update(OVERRIDES.get(model_type, ({}, ""))[0])
    try:
        return cls(**kw)
    except Exception as e:  # noqa: BLE001
        raise CannotBuild(f"tiny config: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def build(model_type: str, cls_name: str, seed: int = 0, meta: bool = False,
          experts: str = "eager", config=None):
    """The tiny *ForCausalLM in float64 (on the meta device with `meta=True`), of `config` when
    given (a tiny config changed by the caller)."""
    import torch
    import transformers

    cfg = tiny_config(model_type) if config is None else config
    # MoE experts: torch's grouped GEMM (HF's default) takes no float64; the eager loop is each
    # class's own forward (test_moe_tp checks the grouped and batched kernels in float32)
    cfg._experts_implementation = experts
    torch.manual_seed(seed)
    try:
        if meta:
            with torch.device("meta"):
                return getattr(transformers, cls_name)(cfg)
        model = getattr(transformers, cls_name)(cfg).double()
        return _keep_fp32(model) if model_type in KEEP_FP32 else model
    except Exception as e:  # noqa: BLE001
        raise CannotBuild(f"model: {type(e).__name__}: {str(e).splitlines()[0]}") from e


def batch(seed: int = 1):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids, "use_cache": False}


def _keep_fp32(model):
    """The tensors the class keeps in float32 whatever the model's dtype (its
    `_keep_in_fp32_modules_strict`, as `from_pretrained` keeps them: Inkling 2's router casts
    its input to float32 and multiplies it by the router weight) back in float32."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None) or []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if any(n in name for n in names):
            t.data = t.data.float()
    return model
