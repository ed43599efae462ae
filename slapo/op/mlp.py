"""RMSNorm and SwiGLU building blocks (LLaMA-style), exact replacements for HF's modules.

Why: `RMSNorm` gives non-HF models (and schedules) one module with HF's exact semantics
(normalise in fp32 for half inputs, cast back, then scale; bit-identical to `LlamaRMSNorm` for
fp32/bf16/fp16, and kept in fp64 for fp64 inputs where HF drops to fp32); `SwiGLU` runs the gate and up projections as one matmul
(one GEMM with a 2x wider output reads the input once), which is faster on GPU and the natural
unit to shard column-wise. Both are exact (same math; the fused GEMM only changes summation
order within rounding). Devices: any.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalising in fp32 and casting back (as HF does).

    Use in place of `LlamaRMSNorm`/`T5LayerNorm`-style modules (`from_module` shares the weight).
    """

    def __init__(self, hidden: int, eps: float = 1e-6, weight: nn.Parameter | None = None):
        super().__init__()
        self.eps = eps
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(hidden))

    @classmethod
    def from_module(cls, module: nn.Module) -> RMSNorm:
        """Wrap an HF RMSNorm-like module (attributes `weight` and `variance_epsilon`/`eps`)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        if eps is None or not isinstance(getattr(module, "weight", None), nn.Parameter):
            raise ValueError(f"RMSNorm.from_module: {type(module).__name__} has no weight/eps")
        return cls(module.weight.shape[-1], eps, module.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[-1]}, eps={self.eps}"


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection.

    `from_llama_mlp(mlp)` builds it from an HF LLaMA/Mistral/Qwen MLP (`gate_proj`, `up_proj`,
    `down_proj`); the gate/up weights are concatenated (a copy: the new module owns them).
    """

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)

    @classmethod
    def from_llama_mlp(cls, mlp: nn.Module) -> SwiGLU:
        g, u, d = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        act = getattr(mlp, "act_fn", None)
        if act is not None and type(act).__name__ not in ("SiLU", "SiLUActivation"):
            raise ValueError(f"SwiGLU.from_llama_mlp: activation is {type(act).__name__}, not SiLU")
        new = cls(g.in_features, g.out_features, bias=g.bias is not None).to(
            device=g.weight.device, dtype=g.weight.dtype
        )
        with torch.no_grad():
            new.gate_up.weight.copy_(torch.cat([g.weight, u.weight], 0))
            if g.bias is not None:
                new.gate_up.bias.copy_(torch.cat([g.bias, u.bias], 0))
        new.down = d
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)
