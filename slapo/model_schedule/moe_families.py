"""Mixture-of-experts decoders whose experts are HF's fused experts module at `mlp.experts`,
each with its own HF router, which expert parallelism keeps: Mixtral (softmax top-k,
renormalised), Qwen3-MoE (softmax top-k, `norm_topk_prob`; dense `mlp_only_layers` have no
experts and are left alone) and DeepSeek-V3 (sigmoid scores, group-limited top-k with the
score-correction bias, a shared expert beside the routed ones, dense first layers).

Expert parallelism (a mesh with ep > 1) spreads each layer's experts (`moe.MoEPlan`); their
attention (DeepSeek-V3's MLA included) has no tensor-parallel plan here yet, so tp > 1 is
refused before anything changes.
"""

from __future__ import annotations

from ._registry import Family
from .moe import MoEPlan

MIXTRAL = Family(name="mixtral", model_types=("mixtral",), layer_lists=("layers",),
                 moe=MoEPlan("mlp.experts"))
QWEN3_MOE = Family(name="qwen3_moe", model_types=("qwen3_moe",), layer_lists=("layers",),
                   moe=MoEPlan("mlp.experts"))
DEEPSEEK_V3 = Family(name="deepseek_v3", model_types=("deepseek_v3",), layer_lists=("layers",),
                     moe=MoEPlan("mlp.experts"))
