"""Mixture-of-experts decoders whose experts are HF's fused experts module at `mlp.experts`,
each with its own HF router, which expert parallelism keeps: Mixtral (softmax top-k,
renormalised), Qwen3-MoE (softmax top-k, `norm_topk_prob`; dense `mlp_only_layers` have no
experts and are left alone) and DeepSeek-V3 (sigmoid scores, group-limited top-k with the
score-correction bias, a shared expert beside the routed ones, dense first layers).

Expert parallelism (a mesh with ep > 1) spreads each layer's experts (`moe.MoEPlan`).
Tensor parallelism (Mixtral, Qwen3-MoE): LLaMA's attention rows and expert TP
(`plan_experts.Experts`: each expert's FFN split over the ranks, the router replicated);
Qwen3-MoE's dense layers split their MLP per projection (an MoE layer has no such modules,
so those rows are optional). DeepSeek-V3 takes the plan derived from its declared one
(`_registry._with_declared_tp_plan`) with Slapo's supplement for its multi-head latent
attention (HF declares no attention rows for it; DeepSeek-V2's declared MLA rows serve:
`plan_supplements.py`), so tp splits its MLA heads, dense MLPs, shared expert and experts.
With ep > 1 as well, the tp plan leaves the experts to ep (`moe.without_experts`).
"""

from __future__ import annotations

from . import llama
from ._registry import Family
from .moe import MoEPlan
from .plan import Column, EnterRegion, Row, TPPlan
from .plan_experts import Experts

# LLaMA's attention rows (the same modules and Qwen3-MoE's per-head norms), then the experts
TP_PLAN = TPPlan(tuple(row for row in llama.TP_PLAN.entries if row[0].startswith("self_attn")) + (
    ("mlp.experts?", Experts()),
    # a dense layer (Qwen3-MoE's mlp_only_layers): each projection reduces its own input
    # gradient, since an MoE layer's `mlp` must not (its experts do)
    ("mlp.gate_proj?", Column()),
    ("mlp.gate_proj?", EnterRegion()),
    ("mlp.up_proj?", Column()),
    ("mlp.up_proj?", EnterRegion()),
    ("mlp.down_proj?", Row()),
))

# context_parallel: the attention module of a layer (the experts are per token: under cp each
# rank routes its own tokens; the load-balancing loss is refused with cp, `context_parallel`)
MIXTRAL = Family(name="mixtral", model_types=("mixtral",), layer_lists=("layers",),
                 moe=MoEPlan("mlp.experts"), tp_plan=TP_PLAN, context_parallel="self_attn")
QWEN3_MOE = Family(name="qwen3_moe", model_types=("qwen3_moe",), layer_lists=("layers",),
                   moe=MoEPlan("mlp.experts"), tp_plan=TP_PLAN, context_parallel="self_attn")
DEEPSEEK_V3 = Family(name="deepseek_v3", model_types=("deepseek_v3",), layer_lists=("layers",),
                     moe=MoEPlan("mlp.experts"), context_parallel="self_attn")
