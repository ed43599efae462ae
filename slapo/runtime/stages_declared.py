"""Pipeline stages of a decoder LM from the pipeline plan its config declares
(`config.base_model_pp_plan`, e.g. {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
"layers": (["hidden_states", "attention_mask"], ["hidden_states"]), "norm": (...)}).

The plan says which modules form the pipeline (the embedding and what follows it, the layer
list, the final norm) and what flows between them. It does not say what the model's `forward`
does *between* those modules, and models differ there: Granite multiplies the embeddings by a
config value and divides the logits, Cohere multiplies the logits, Gemma 2/3 soft-cap them,
Gemma 3 and OLMo 3 give each layer type its own rotary embedding, Mistral windows every layer,
Qwen2/3 and Gemma pick full or sliding attention per layer from `config.layer_types` (and the
linear-attention hybrids a recurrent layer's 2-D padding mask). A stage
re-implements that code, so a wrong guess trains silently wrong. Hence two tables, both data:

- `BETWEEN`: the model types whose forward between the declared modules was read (transformers
  5.24) and written down as a `Between`, each proven equal to one process (loss, every gradient,
  parameters after two AdamW steps) by `tests/test_pipeline_declared.py`'s sweep;
- `REFUSED`: model types whose forward does something a `Between` cannot say, and why.

Every other declared-plan model type is refused, naming itself, until the sweep proves it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch
import torch.nn as nn

from ..errors import SchedulingError

MASKS = ("causal", "window", "layer_types", "indexed")
ROPES = ("shared", "per_type", "per_theta", "none")
# the parameter-free modules outside the plan that each rope rule runs (every stage needs them)
ROPE_MODULES = {"shared": ("rotary_emb",), "per_type": ("rotary_emb",),
                "per_theta": ("rotary_emb", "rotary_embs"), "none": ()}
# the attention types a `layer_types` model may list, and the masking function of each
# (a linear-attention or recurrent layer takes the 2-D padding mask trimmed to the sequence)
LAYER_MASKS = {"full_attention": "create_causal_mask",
               "sliding_attention": "create_sliding_window_causal_mask",
               "linear_attention": "create_recurrent_attention_mask",
               "indexed_attention": "create_causal_mask"}
# the arguments a type's masking function takes beyond the common ones: an indexed (sparse)
# attention layer's indexer needs the causal mask materialised (no is_causal skip)
MASK_KWARGS = {"indexed_attention": {"allow_is_causal_skip": False}}


@dataclass(frozen=True)
class Between:
    """What a model's `forward` does between the modules of its declared pipeline plan.

    A value is read where the forward reads it: `"config.x"` (the model's config), `"lm.x"` (an
    attribute of the *ForCausalLM module), `"base.x"` (of its base model)."""

    # which mask each layer gets: one causal mask ("causal"); Mistral's rule, a sliding-window
    # mask for every layer when `config.sliding_window` is set ("window"); `config.layer_types[i]`
    # naming full, sliding or linear attention ("layer_types": `LAYER_MASKS`); one causal mask,
    # always materialised, for indexed sparse attention ("indexed": DeepSeek-V3.2)
    masks: str = "causal"
    # one rotary embedding for every layer, `rotary_emb(h, position_ids)` ("shared"); one per
    # layer type, `rotary_emb(h, position_ids, layer_type)` ("per_type": Gemma 3, OLMo 3; none
    # for a type whose `config.rope_parameters[type]` is None, Cohere Compass's NoPE layers);
    # one per base theta, layer i taking the module of `rotary_embs` whose theta is
    # `config.layer_rope_theta[i]`, none for theta 0 ("per_theta": Granite-SWA; its
    # `rotary_emb` stays unused); no position embeddings passed at all ("none": Kimi Linear)
    rope: str = "shared"
    # the layer types that get the rotary embedding, the others None (LARA-mini's global
    # layers); None: every type
    rope_types: tuple[str, ...] | None = None
    # the layer types whose rotary embedding is computed from the hidden state cast to float32
    # (its cos/sin then float32: Dots3's indexed layers)
    rope_float32: tuple[str, ...] = ()
    # the attention scaling of layers without a rotary embedding: a function of the positions
    # in the model's modeling module, passed as `attention_scaling` to every layer (None to the
    # roped ones: Beam's NoPE layers)
    nope_scaling: str | None = None
    materialise: bool = False  # every mask materialised, no is_causal skip (Doge adds onto it)
    embed_scale: str | None = None  # multiplies the embeddings (Granite)
    embed_dropout: str | None = None  # a functional dropout's p after the embedding (StarCoder2)
    hidden_divisor: str | None = None  # divides the last hidden state before the head (MiniCPM3)
    logit_scale: tuple[str, str] | None = None  # ("mul" or "div", value) on the logits
    softcap: str | None = None  # the logits' tanh soft-cap, off when None (Gemma 2/3)
    softcap_float32: bool = False  # the soft-cap computed on the logits cast to float32 (Beam)
    # (config flag, what the forward does then): refused when the flag is set
    refuse_if: tuple[tuple[str, str], ...] = ()
    # its loss adds HF's shared `load_balancing_loss_func` under `config.output_router_logits`,
    # which the stages compute from statistics they carry (`stage_router.py`)
    router: bool = False

    def __post_init__(self) -> None:
        assert self.masks in MASKS and self.rope in ROPES, self


LLAMA = Between()
WINDOW = Between(masks="window")
TYPED = Between(masks="layer_types")
TYPED_ROPE = Between(masks="layer_types", rope="per_type")
GEMMA2 = Between(masks="layer_types", softcap="config.final_logit_softcapping")
_BIDIRECTIONAL = ("use_bidirectional_attention",
                  "it attends both ways with its own mask overlays")
_ROUTER = ("output_router_logits", "its loss adds a router load-balancing loss of its own "
                                   "(not HF's shared function), which no pipeline stage "
                                   "computes")

# The model types whose stages are proven equal to the model (tests/test_pipeline_declared.py).
# A mixture of experts whose causal LM adds HF's shared load-balancing loss to its loss when
# `output_router_logits` is set has `router=True`: the stages carry its statistics
# (`stage_router.py`, proven by tests/test_pipeline_router.py); one with a loss of its own
# (Doge) is refused then (`_ROUTER`).
BETWEEN: dict[str, Between] = {
    **dict.fromkeys(("llama", "olmo", "olmo2", "glm", "glm4", "helium", "internlm3",
                     "iquestcoder", "apertus", "arcee", "exaone", "seed_oss", "youtu",
                     "ernie4_5", "jais2", "gemma", "gpt_neox", "phi", "gptj", "codegen",
                     "deepseek_v2", "deepseek_v3", "glm4_moe", "glm4_moe_lite", "solar_open",
                     "aria_text", "axk1", "sarvam_mla", "sarvam_moe", "hy_v3"), LLAMA),
    **dict.fromkeys(("ernie4_5_moe", "flex_olmo", "minimax_m2", "minimax_m3_vl_text"),
                    Between(router=True)),
    **dict.fromkeys(("mistral", "ministral3", "phi3"), WINDOW),
    **dict.fromkeys(("mixtral", "qwen3_moe"), Between(masks="window", router=True)),
    "starcoder2": Between(masks="window", embed_dropout="base.embedding_dropout"),
    **dict.fromkeys(("qwen2", "qwen3", "smollm3", "ministral", "exaone4", "cwm", "kolibri1",
                     "exaone_moe", "dots1"), TYPED),
    **dict.fromkeys(("qwen2_moe", "gpt_oss"), Between(masks="layer_types", router=True)),
    # HF's own forward fails with output_router_logits (transformers 5.24: an IndexError in
    # recording its router's outputs), so there is no loss to reproduce
    "flint": Between(masks="layer_types", refuse_if=(
        ("output_router_logits", "HF's own forward fails with it (transformers 5.24)"),)),
    "olmo3": TYPED_ROPE,
    "mimo_v2_flash": TYPED_ROPE,
    **dict.fromkeys(("laguna", "mellum"),
                    Between(masks="layer_types", rope="per_type", router=True)),
    "gemma2": GEMMA2,
    "vaultgemma": GEMMA2,
    "gemma3_text": Between(masks="layer_types", rope="per_type",
                           softcap="config.final_logit_softcapping", refuse_if=(_BIDIRECTIONAL,)),
    "cohere": Between(logit_scale=("mul", "lm.logit_scale")),
    "cohere_compass_text": Between(masks="layer_types", rope="per_type",
                                   logit_scale=("mul", "lm.logit_scale")),
    **dict.fromkeys(("cohere2", "cohere2_moe"),
                    Between(masks="layer_types", logit_scale=("mul", "lm.logit_scale"))),
    "granite": Between(embed_scale="base.embedding_multiplier",
                       logit_scale=("div", "config.logits_scaling")),
    "hyperclovax": Between(embed_scale="base.embedding_multiplier",
                           logit_scale=("mul", "config.logits_scaling")),
    "minicpm3": Between(hidden_divisor="config.logits_scaling"),
    **dict.fromkeys(("deepseek_v32", "axk2"), Between(masks="indexed")),
    # hybrids of linear (recurrent) and full attention layers
    # (Kimi Linear has no rotary embedding, which the stages share: refused by that check)
    **dict.fromkeys(("olmo_hybrid", "bailing_hybrid"), TYPED),
    **dict.fromkeys(("qwen3_next", "minimax"), Between(masks="layer_types", router=True)),
    # Qwen3.5 on text: its forward splits 4 position rows into the text positions (for the masks
    # and layers) and 3 multimodal rotary rows that equal them; its rotary embedding broadcasts
    # text positions to those rows itself (`position_ids.expand(3, -1, -1)`)
    "qwen3_5_text": TYPED,
    "qwen3_5_moe_text": Between(masks="layer_types", router=True),
    "apertus1p5_text": Between(refuse_if=(("output_vocab_size", "its LM head is pruned to "
                                           "config.output_vocab_size, the width its loss reads"),)),
    "afmoe": Between(masks="layer_types", refuse_if=(("mup_enabled", "its forward scales the "
                                                      "embeddings by sqrt(hidden_size)"),)),
    # each layer's rotary embedding by its own theta, from a list of rotary modules
    "granite_swa": Between(masks="layer_types", rope="per_theta",
                           embed_scale="base.embedding_multiplier",
                           logit_scale=("div", "config.logits_scaling")),
    # only the sliding layers are roped; the global ones are NoPE
    "lara_mini": Between(masks="layer_types", rope_types=("sliding_attention",),
                         router=True),
    # NoPE layers (rope_parameters[type] None) get an attention scaling of the positions
    # and the logits are soft-capped in float32
    "beam": Between(masks="layer_types", rope="per_type",
                    nope_scaling="modeling.compute_attention_scaling",
                    softcap="config.final_logit_softcapping", softcap_float32=True),
    "kimi_linear": Between(masks="layer_types", rope="none"),
    # Mistral's window rule, the mask always materialised (its dynamic mask is added onto it)
    "doge": Between(masks="window", materialise=True, refuse_if=(_ROUTER,)),
    # the indexed layers' rotary embedding is computed in float32
    "dots3_note_text": Between(masks="layer_types", rope="per_type",
                               rope_float32=("indexed_attention",)),
}

# Model types refused by name: what their forward does between the layers that `Between`
# cannot say.
REFUSED: dict[str, str] = {
    "gemma4_unified_text": "later layers share key/value states with earlier ones, sliced in "
                           "the forward",
    "inkling_text": "its forward divides the hidden state and cuts the logits to the unpadded "
                    "vocabulary",
    "glm_moe_dsa": "its indexed (sparse) attention layers pass the indexer's top-k from one "
                   "layer to the next",
    "longcat_flash": "its forward runs config.num_layers layers, each a pair of attention "
                     "sublayers",
}

FIX = ("train it without pp_stages (tensor or data parallelism work), or add its model type to "
       "slapo/runtime/stages_declared.py's BETWEEN once tests/test_pipeline_declared.py's "
       "sweep (SLAPO_SWEEP=all) proves its stages equal to the model.")


@dataclass(frozen=True)
class DeclaredParts:
    """The paths (from the root) of a declared-plan decoder's pipeline parts."""

    embed: tuple[str, ...]  # the embedding, then the plan's modules before the layers (dropout)
    layers: str
    final: tuple[str, ...]  # the plan's modules after the layers (the norm), then the LM head
    shared: tuple[str, ...]  # parameter-free modules every stage needs (the rotary embedding)
    between: Between


def declared_plan(model: nn.Module) -> dict | None:
    """The model's declared pipeline plan, or None."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    return dict(plan) if plan else None


def declared_parts(model: nn.Module) -> DeclaredParts | None:
    """The pipeline parts of `model` from its config's `base_model_pp_plan`; None for a model
    that declares none; a SchedulingError for a declared-plan model whose stages are not proven
    (see the module docstring) or whose plan is not embedding, layers, final norm."""
    plan = declared_plan(model)
    if plan is None:
        return None
    cfg, name = model.config, type(model).__name__
    model_type = getattr(cfg, "model_type", None)
    where = f"{name} (model_type={model_type!r})"
    if model_type in REFUSED:
        raise SchedulingError("", f"pipeline stages of {where}: {REFUSED[model_type]}.", FIX)
    parts = _parts(model, plan, where)  # the plan's shape first: its reason is the more precise
    between = BETWEEN.get(model_type)
    if between is None:
        raise SchedulingError("", f"{where} declares a pipeline plan, but its stages would "
                              "re-implement its forward between the layers, and that is proven "
                              "(a sweep against one process) for "
                              f"{len(BETWEEN)} model types only; another may scale, cap or "
                              "mask there and train silently wrong.", FIX)
    parts = replace(parts, between=between)
    _check_shared(parts, where)
    _check_config(model, parts, where)
    return parts


def _parts(model: nn.Module, plan: dict, where: str) -> DeclaredParts:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(base, nn.Module) or head is None:
        raise SchedulingError("", f"{where} is not a decoder LM with a head (its base model and "
                              "an output embedding): its pipeline plan has no stage for it.",
                              "pipeline its *ForCausalLM class, or train without pp_stages.")
    names = list(plan)
    lists = [k for k in names if isinstance(getattr(base, k, None), nn.ModuleList)]
    if len(lists) != 1 or plan[names[0]][0] != ["input_ids"] or not \
            all(isinstance(getattr(base, k, None), nn.Module) for k in names):
        raise SchedulingError(prefix, f"the pipeline plan {names} of {where} is not an "
                              "embedding, one layer list and the modules after it.", FIX)
    at = names.index(lists[0])
    head_path = next(n for n, m in model.named_modules() if m is head)
    shared, owned = [], []
    for child, mod in base.named_children():
        if child in plan or mod is None:
            continue
        (owned if any(True for _ in mod.parameters()) else shared).append(child)
    outside = owned + [n for n, m in model.named_children()
                       if m is not base and n != head_path and any(True for _ in m.parameters())]
    if outside:
        raise SchedulingError(prefix, f"{where} has parameters outside its declared pipeline "
                              f"plan ({', '.join(outside)}), which no stage would run.", FIX)
    return DeclaredParts(tuple(f"{prefix}.{k}" for k in names[:at]), f"{prefix}.{lists[0]}",
                         tuple(f"{prefix}.{k}" for k in names[at + 1:]) + (head_path,),
                         tuple(f"{prefix}.{k}" for k in shared), Between())


def _check_shared(parts: DeclaredParts, where: str) -> None:
    """The parameter-free modules outside the plan must be the ones its rope rule runs."""
    shared = tuple(p.rsplit(".", 1)[-1] for p in parts.shared)
    want = ROPE_MODULES[parts.between.rope]
    if sorted(shared) != sorted(want):
        raise SchedulingError("", f"{where} has {list(shared) or 'no'} modules outside its "
                              f"declared pipeline plan where its rope rule "
                              f"({parts.between.rope!r}) runs {list(want) or 'none'}.", FIX)


def _check_config(model: nn.Module, parts: DeclaredParts, where: str) -> None:
    """The config values under which the forward is not the one the stages re-implement."""
    cfg = model.config
    from .stage_router import router_aux

    router_aux(model, parts.between.router)  # what the stages read for the router's loss
    for flag, why in parts.between.refuse_if:
        if getattr(cfg, flag, False):
            raise SchedulingError("", f"{where} with config.{flag} set: {why}.",
                                  f"set config.{flag} = False, or train without pp_stages.")
    n_layers = len(model.get_submodule(parts.layers))
    if getattr(cfg, "num_hidden_layers", n_layers) != n_layers:
        raise SchedulingError(parts.layers, f"{where} runs config.num_hidden_layers="
                              f"{cfg.num_hidden_layers} of its {n_layers} layers.",
                              "make config.num_hidden_layers the number of layers.")
    if parts.between.masks == "layer_types":
        unknown = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(LAYER_MASKS))
        if unknown:
            raise SchedulingError(parts.layers, f"{where}'s attention types {unknown} have no "
                                  "pipeline mask.", FIX)


# ---- the forward between the layers, as the table says ----------------------------------------

def value(stage: nn.Module, spec: str):
    """The value `spec` names ("config.x", "lm.x", "base.x", "modeling.f": a function of the
    model's modeling module), read as the forward reads it."""
    owner, attr = spec.split(".", 1)
    root = stage._root[0]
    if owner == "modeling":  # a function of the model's modeling module (its own class's,
        # not a class Slapo patched in: `module_patch.original_class`)
        from ..module_patch import original_class

        return getattr(sys.modules[original_class(root).__module__], attr)
    src = {"config": root.config, "lm": root,
           "base": getattr(root, getattr(root, "base_model_prefix", ""), None)}[owner]
    return getattr(src, attr)


def embed_extra(stage: nn.Module, between: Between, h: torch.Tensor) -> torch.Tensor:
    """What the forward does to the embedding output before the plan's next module."""
    if between.embed_scale is not None:
        h = h * value(stage, between.embed_scale)
    if between.embed_dropout is not None:
        h = nn.functional.dropout(h, p=value(stage, between.embed_dropout),
                                  training=stage.training)
    return h


def attention_type(cfg, between: Between, i: int) -> str:
    """The mask layer `i` takes under the table's rule."""
    if between.masks == "window" and getattr(cfg, "sliding_window", None) is not None:
        return "sliding_attention"
    if between.masks == "layer_types" and getattr(cfg, "layer_types", None):
        return cfg.layer_types[i]
    if between.masks == "indexed":
        return "indexed_attention"
    return "full_attention"


def rope_key(cfg, between: Between, i: int):
    """Which of the stage's position embeddings layer `i` takes: its attention type, or its
    base theta under the per-theta rule."""
    if between.rope == "per_theta":
        return cfg.layer_rope_theta[i]
    return attention_type(cfg, between, i)


def rotary(stage: nn.Module, between: Between, modules: dict[str, nn.Module], h: torch.Tensor,
           pos: torch.Tensor, keys: set) -> dict:
    """{rope key: position embeddings, None for a NoPE layer} for this stage's layers; {} when
    the rule passes none (`modules`: the stage's rope modules by name, `ROPE_MODULES`)."""
    if between.rope == "none":
        return {}
    if between.rope == "per_theta":
        by_theta = {m.config.rope_parameters["rope_theta"]: m for m in modules["rotary_embs"]}
        return {t: by_theta[t](h, position_ids=pos) if t else None for t in keys}
    params = getattr(stage.config, "rope_parameters", None) or {}
    out, shared = {}, {}  # shared: the one embedding of the "shared" rule, by input dtype
    for k in keys:
        x = h.float() if k in between.rope_float32 else h
        if between.rope_types is not None and k not in between.rope_types:
            out[k] = None
        elif between.rope == "per_type":
            out[k] = None if k in params and params[k] is None else \
                modules["rotary_emb"](x, pos, k)
        else:
            if x.dtype not in shared:
                shared[x.dtype] = modules["rotary_emb"](x, position_ids=pos)
            out[k] = shared[x.dtype]
    return out


def layer_kwargs(stage: nn.Module, between: Between, modules: dict[str, nn.Module],
                 h: torch.Tensor, pos: torch.Tensor, keys: set) -> dict:
    """{rope key: the position arguments a layer of that key takes beyond its hidden state,
    mask and positions}, each computed once per stage forward, as the model's forward does:
    its position embeddings (`rotary`), and under `nope_scaling` the attention scaling of the
    NoPE layers (None for the roped ones)."""
    rope = rotary(stage, between, modules, h, pos, keys)
    if between.rope == "none":
        return dict.fromkeys(keys, {})
    scaling = None
    if between.nope_scaling is not None and any(e is None for e in rope.values()):
        scaling = value(stage, between.nope_scaling)(pos)
    out = {}
    for k, emb in rope.items():
        out[k] = {"position_embeddings": emb}
        if between.nope_scaling is not None:
            out[k]["attention_scaling"] = scaling if emb is None else None
    return out


def mask_kwargs(between: Between | None, kind: str) -> dict:
    """What the masking function of attention type `kind` takes beyond the common arguments
    (`MASK_KWARGS`; every mask materialised under `materialise`)."""
    out = dict(MASK_KWARGS.get(kind, {}))
    if between is not None and between.materialise:
        out["allow_is_causal_skip"] = False
    return out


def hidden_extra(stage: nn.Module, between: Between, h: torch.Tensor) -> torch.Tensor:
    """What the forward does to the last hidden state before the LM head."""
    if between.hidden_divisor is not None:
        h = h / value(stage, between.hidden_divisor)
    return h


def logits_extra(stage: nn.Module, between: Between, logits: torch.Tensor) -> torch.Tensor:
    """What the forward does to the logits after the LM head (scaling, then soft-capping)."""
    if between.logit_scale is not None:
        op, spec = between.logit_scale
        scale = value(stage, spec)
        logits = logits * scale if op == "mul" else logits / scale
    cap = value(stage, between.softcap) if between.softcap is not None else None
    if cap is not None:
        logits = logits.float() if between.softcap_float32 else logits
        logits = torch.tanh(logits / cap) * cap
    return logits


def has_tail(between: Between) -> bool:
    """Whether the forward changes the last hidden state or the logits around the head (a
    fused head + loss would skip that)."""
    return any(v is not None for v in (between.hidden_divisor, between.logit_scale,
                                       between.softcap))
