"""Drop-in kernels and layers for schedules (`.replace()` / `.fuse()` targets).

Each op's docstring says when to use it, whether it is exact or approximate, and on which devices.

* Attention: `SDPAttention` (SDPA / flash-attn core), `SelfAttention`, `use_attention_core` (swap
  the core of an HF BERT/GPT-2/LLaMA attention module), `TempoAttentionCore`.
* Tempo (memory-efficient, arXiv 2210.10246): `TempoGELU`, `TempoLayerNorm`,
  `softmax_dropout_matmul`, `apply_tempo(sch)`, `apply_tempo_to_module(model)`.
* Fused epilogues: `FusedBiasGELU`, `FusedBiasDropoutAdd` (torch.compile when asked).
* GPU kernels (Triton on CUDA, exact PyTorch elsewhere): `kernels` (RMSNorm, LayerNorm, SwiGLU,
  bias+GELU+dropout, RoPE; see docs/kernels.md).
* LM head: `fused_linear_cross_entropy` (scalar loss, gradient in forward, no logits; the
  `fused_loss` knob), `linear_cross_entropy` (chunked, per-row losses too), `VocabParallelEmbedding`,
  `VocabParallelLMHead`, `vocab_parallel_cross_entropy` (tensor parallel over the vocabulary).
* `RMSNorm`, `SwiGLU`.
* Slapo 2023 class names (`FlashAttention`, `FlashAttentionOp`, `FusedQKV`, `FusedMLP`,
  `LinearWithSeparateBias`, `LinearWithSyncFunc`, `LinearWithAct`, `LinearWithDropout`,
  `ParallelCrossEntropy`, `Print`): adapters onto the ops above (`compat2023`).
"""

from . import kernels
from .attention import SDPAttention, SelfAttention, flash_attn_available
from .attention_core import AttentionCore, causal_mask, padding_mask, repeat_kv
from .compat2023 import (
    FlashAttention,
    FlashAttentionOp,
    FusedMLP,
    FusedQKV,
    LinearWithAct,
    LinearWithDropout,
    LinearWithSeparateBias,
    LinearWithSyncFunc,
    ParallelCrossEntropy,
    Print,
)
from .fused import FusedBiasDropoutAdd, FusedBiasGELU, bias_dropout_add, bias_gelu
from .hf_attention import SLAPO_ATTN, is_hf_attention, use_attention_core
from .linear_ce import (
    ChunkedLinearCrossEntropy,
    ChunkedLinearCrossEntropyFunction,
    fused_linear_cross_entropy,
    linear_cross_entropy,
)
from .mlp import RMSNorm, SwiGLU
from .rnn import FusedGRU, FusedLSTM
from .tempo import (
    TempoReport,
    apply_tempo,
    apply_tempo_to_module,
    attention_choice,
    replace_attention_core,
    replace_gelu,
    replace_layernorm,
    tempo_replacement,
)
from .tempo_attention import (
    SoftmaxDropoutMatmulFunction,
    TempoAttentionCore,
    softmax_dropout_matmul,
)
from .tempo_gelu import TempoGELU, TempoGELUFunction, gelu_derivative_from_output, tempo_gelu
from .tempo_layernorm import TempoLayerNorm, TempoLayerNormFunction, tempo_layer_norm
from .vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    copy_to_group,
    reduce_from_group,
    vocab_parallel_cross_entropy,
    vocab_range,
)

__all__ = [
    "FlashAttention",
    "FlashAttentionOp",
    "FusedMLP",
    "FusedQKV",
    "LinearWithAct",
    "LinearWithDropout",
    "LinearWithSeparateBias",
    "LinearWithSyncFunc",
    "ParallelCrossEntropy",
    "Print",
    "SLAPO_ATTN",
    "AttentionCore",
    "ChunkedLinearCrossEntropy",
    "ChunkedLinearCrossEntropyFunction",
    "FusedBiasDropoutAdd",
    "FusedBiasGELU",
    "FusedGRU",
    "FusedLSTM",
    "RMSNorm",
    "SwiGLU",
    "VocabParallelEmbedding",
    "VocabParallelLMHead",
    "bias_dropout_add",
    "bias_gelu",
    "copy_to_group",
    "linear_cross_entropy",
    "reduce_from_group",
    "vocab_parallel_cross_entropy",
    "vocab_range",
    "SDPAttention",
    "SelfAttention",
    "SoftmaxDropoutMatmulFunction",
    "TempoAttentionCore",
    "TempoGELU",
    "TempoGELUFunction",
    "TempoLayerNorm",
    "TempoLayerNormFunction",
    "TempoReport",
    "apply_tempo",
    "apply_tempo_to_module",
    "attention_choice",
    "fused_linear_cross_entropy",
    "kernels",
    "causal_mask",
    "flash_attn_available",
    "gelu_derivative_from_output",
    "is_hf_attention",
    "padding_mask",
    "repeat_kv",
    "replace_attention_core",
    "replace_gelu",
    "replace_layernorm",
    "softmax_dropout_matmul",
    "tempo_gelu",
    "tempo_layer_norm",
    "tempo_replacement",
    "use_attention_core",
]
