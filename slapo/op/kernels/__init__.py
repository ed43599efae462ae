"""Fused training kernels a schedule can swap in: Triton on CUDA, exact PyTorch elsewhere.

Each kernel comes as a functional op, an `autograd.Function` (Triton forward *and* backward
kernels) and an `nn.Module` drop-in for the HF module it replaces:

| kernel | functional | Function | module (replaces) |
|---|---|---|---|
| RMSNorm | `rms_norm` | `RMSNormFunction` | `FusedRMSNorm` (`LlamaRMSNorm` & copies; `T5LayerNorm` with `style="t5"`) |
| LayerNorm | `layer_norm` | `LayerNormFunction` | `FusedLayerNorm` (`nn.LayerNorm`) |
| SwiGLU | `swiglu` | `SwiGLUFunction` | `FusedSwiGLU`, `FusedLlamaMLP` (`LlamaMLP`) |
| bias+GELU(+dropout) | `bias_gelu_dropout` | `BiasGELUDropoutFunction` | `FusedGELU` (GELU modules) |
| RoPE | `apply_rotary_pos_emb` | `RoPEFunction` | `FusedRoPE` |

Backends (`backend=` on every op and module): "auto" (Triton for CUDA tensors when the triton
package is installed, the reference otherwise), "triton", "reference". The reference path is the
computation of the replaced HF/PyTorch module itself, so CPU results are unchanged. Triton is
imported lazily, on the first Triton launch. Each launch is a `torch.library` custom op
(`torch.ops.slapo_kernels.*`), so `torch.compile` keeps it as one graph node without a break.
Test the kernels without a GPU with `TRITON_INTERPRET=1` (see docs/kernels.md).
"""

from ._common import BACKENDS, triton_available
from .gelu import BiasGELUDropoutFunction, FusedGELU, bias_gelu_dropout, bias_gelu_dropout_reference
from .layer_norm import FusedLayerNorm, LayerNormFunction, layer_norm
from .rms_norm import (
    FusedRMSNorm,
    RMSNormFunction,
    rms_norm,
    rms_norm_reference,
    t5_rms_norm_reference,
)
from .rope import FusedRoPE, RoPEFunction, apply_rotary_pos_emb, rope_reference
from .swiglu import (
    FusedLlamaMLP,
    FusedSwiGLU,
    SwiGLUFunction,
    swiglu,
    swiglu_mlp_problem,
    swiglu_reference,
)

__all__ = [
    "BACKENDS",
    "BiasGELUDropoutFunction",
    "FusedGELU",
    "FusedLayerNorm",
    "FusedLlamaMLP",
    "FusedRMSNorm",
    "FusedRoPE",
    "FusedSwiGLU",
    "LayerNormFunction",
    "RMSNormFunction",
    "RoPEFunction",
    "SwiGLUFunction",
    "apply_rotary_pos_emb",
    "bias_gelu_dropout",
    "bias_gelu_dropout_reference",
    "layer_norm",
    "rms_norm",
    "rms_norm_reference",
    "t5_rms_norm_reference",
    "rope_reference",
    "swiglu",
    "swiglu_mlp_problem",
    "swiglu_reference",
    "triton_available",
]
