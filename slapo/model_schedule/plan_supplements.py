"""Slapo's rows for the declared tensor-parallel plans that transformers leaves incomplete.

A config's `base_model_tp_plan` is HF's statement of how an architecture splits, and
`hf_plan.py` translates it. A few declarations leave out a row the split needs, so that HF's
own TP of them computes one rank's share of a gradient:

- Apertus: the xIELU activation's scalar `alpha_p`/`alpha_n` act on this rank's MLP features
  (the translator refuses the plan as declared, naming the parameter);
- Sarvam-MoE: the per-head `q_norm`/`k_norm` (width head_dim) see this rank's heads only
  (Qwen3-MoE's plan, the same attention, declares them).

DeepSeek-V3 declares its MLP, shared-expert and expert rows but no attention rows: its
multi-head latent attention gets DeepSeek-V2's declared rows (the same module), so tp splits
its heads (`q_b_proj`, `kv_b_proj` column, `o_proj` row, the kv_a projection's shared rotary
key reduced: `hf_plan._mla_rows`).

Others declare only the input embedding, which splits nothing in the layers: HunYuan dense
(LLaMA's attention and MLP, per-head query/key norms) and GPT-OSS (LLaMA's attention with
biases and per-head attention sinks, and its biased experts as `moe_tp_experts`:
`plan_experts.Experts` splits `gate_up_proj` and its bias by interleaved (gate, up) pairs and
adds `down_proj_bias` once in the all-reduced sum).

LFM2 and LFM3 also declare only the embedding; their short-convolution layers have no HF style
(an input projection packing B|C|x, a depthwise convolution over the channels, an output
projection), so those rows are Slapo styles: the packed projection split per block
(`Column(blocks=3)`), the convolution's weight split over its channels (each channel is its own
group), the output projection a `Row`. A Slapo-style row is skipped where no layer has its
module (a config whose layers are all attention).

`declared_tp_plan(model)` is the declaration with the supplement of its model type, mostly in
HF's own style names: it goes through the same translator and the same checks (a row naming a
module a layer does not have, a parameter in a split module no row covers), and each model type
here is proven against one process by tests/test_hf_plans.py. A supplement only adds rows, for
the model types named here; every other model's plan is HF's alone.
"""

from __future__ import annotations

import torch.nn as nn

from .plan import Column, EnterRegion, Row, ShardParam

_GRAD_SUM = "replicated_with_grad_allreduce"
_ATTENTION = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
              "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}
_MLP = {"layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise"}


def _per_head(*names: str) -> dict[str, str]:
    """Norms applied to each head with one weight: their gradient sums over the ranks' heads."""
    return {f"layers.*.self_attn.{n}": _GRAD_SUM for n in names}


_XIELU = {"layers.*.mlp.act_fn": _GRAD_SUM}
# LFM's short convolution (B, C, x = in_proj(h).chunk(3); y = out_proj(C * conv(B * x))), in
# Slapo styles: every product and the depthwise convolution act per channel
_SHORT_CONV = {"layers.*.conv.in_proj": (Column(blocks=3), EnterRegion()),
               "layers.*.conv.conv": (ShardParam("weight", axis=0),),
               "layers.*.conv.out_proj": (Row(),)}
_LFM_FFN = {"layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
            "layers.*.feed_forward.w2": "rowwise"}
_LFM2_ATTENTION = {**{k: v for k, v in _ATTENTION.items() if not k.endswith("o_proj")},
                   "layers.*.self_attn.out_proj": "rowwise",
                   **_per_head("q_layernorm", "k_layernorm")}
# LFM3's attention: LLaMA's with per-head norms and a per-head output gate (`g_proj`)
_LFM3_ATTENTION = {**_ATTENTION, "layers.*.self_attn.g_proj": "colwise",
                   **_per_head("q_norm", "k_norm")}

# multi-head latent attention as DeepSeek-V2's config declares it (DeepSeek-V3's declares no
# attention rows, so HF's own TP of it, and Slapo's before this row, kept MLA whole)
_MLA = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.q_b_proj": "colwise",
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
        "layers.*.self_attn.kv_b_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"}

# model type -> {plan key: HF style, or a tuple of Slapo styles} added to its declared plan
SUPPLEMENTS: dict[str, dict[str, str | tuple]] = {
    "apertus": _XIELU,
    "apertus1p5_text": _XIELU,
    "sarvam_moe": _per_head("q_norm", "k_norm"),
    "hunyuan_v1_dense": {**_ATTENTION, **_MLP, **_per_head("query_layernorm", "key_layernorm")},
    "gpt_oss": {**_ATTENTION, "layers.*.self_attn.sinks": "colwise",
                "layers.*.mlp.experts": "moe_tp_experts"},
    "deepseek_v3": _MLA,
    "lfm2": {**_LFM2_ATTENTION, **_SHORT_CONV, **_LFM_FFN},
    "lfm3": {**_LFM3_ATTENTION, **_SHORT_CONV, **_LFM_FFN},
}


def declared_tp_plan(model: nn.Module) -> dict | None:
    """The model's declared tensor-parallel plan with Slapo's supplement for its model type, or
    None when its config declares none."""
    cfg = getattr(model, "config", None)
    declared = getattr(cfg, "base_model_tp_plan", None)
    if not isinstance(declared, dict) or not declared:
        return None
    return {**declared, **SUPPLEMENTS.get(getattr(cfg, "model_type", None), {})}


__all__ = ["SUPPLEMENTS", "declared_tp_plan"]
