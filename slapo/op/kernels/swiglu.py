"""Fused SwiGLU activation `silu(gate) * up`, and an HF LLaMA-MLP drop-in that uses it.

Why: eager PyTorch runs silu and the multiply as two kernels and saves three [tokens, ffn]
tensors for the backward (gate, silu(gate), up); the fused kernel reads gate and up once, writes
y once, saves only gate and up, and its backward is one kernel too.

Exactness: the reference path is HF's `act_fn(gate) * up` (bit-identical on CPU); the Triton
path rounds at the same points (silu to gate's dtype, then the product), differing only in
how silu is evaluated in fp32 (`x * sigmoid(x)`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import _common


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF LLaMA's `act_fn(gate_proj(x)) * up_proj(x)` activation, with act_fn = SiLU."""
    return F.silu(gate) * up


def _fwd_impl(g, u):
    from . import _swiglu_triton

    return _swiglu_triton.forward(g, u)


def _fwd_fake(g, u):
    return g.new_empty(g.shape, dtype=torch.promote_types(g.dtype, u.dtype))


def _bwd_impl(dy, g, u):
    from . import _swiglu_triton

    return _swiglu_triton.backward(dy, g, u)


def _bwd_fake(dy, g, u):
    return g.new_empty(g.shape), u.new_empty(u.shape)


_fwd_op = _common.define_op("swiglu_fwd", "(Tensor g, Tensor u) -> Tensor", _fwd_impl, _fwd_fake)
_bwd_op = _common.define_op("swiglu_bwd", "(Tensor dy, Tensor g, Tensor u) -> (Tensor, Tensor)",
                            _bwd_impl, _bwd_fake)


class SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up with one Triton kernel each way; saves gate and up only."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g2, u2 = _common.as_rows(gate), _common.as_rows(up)
        ctx.save_for_backward(g2, u2)
        ctx.shape = gate.shape
        return _fwd_op(g2, u2).view(gate.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g2, u2 = ctx.saved_tensors
        dg, du = _bwd_op(_common.as_rows(dy), g2, u2)
        return dg.view(ctx.shape), du.view(ctx.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """`silu(gate) * up`; Triton on CUDA, reference elsewhere. Shapes must match (no broadcast)."""
    if not _common.use_triton(_common.check_backend(backend), gate, up):
        return swiglu_reference(gate, up)
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    return SwiGLUFunction.apply(gate, up)


class FusedSwiGLU(nn.Module):
    """The activation alone: `forward(gate, up) = silu(gate) * up`."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = _common.check_backend(backend)
        _common.triton_available()

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(gate, up, self.backend)

    def extra_repr(self) -> str:
        return f"backend={self.backend}"


_SILU_NAMES = ("SiLU", "SiLUActivation")


def swiglu_mlp_problem(mlp: nn.Module) -> str | None:
    """Why `mlp` is not an HF gated-SiLU MLP `FusedLlamaMLP` can replace, or None if it is."""
    for name in ("gate_proj", "up_proj", "down_proj"):
        if not isinstance(getattr(mlp, name, None), nn.Module):
            return f"{type(mlp).__name__} has no `{name}` module"
    act = getattr(mlp, "act_fn", None)
    if act is None or type(act).__name__ not in _SILU_NAMES:
        return f"{type(mlp).__name__}'s activation is {type(act).__name__}, not SiLU"
    return None


class FusedLlamaMLP(nn.Module):
    """Drop-in for HF `LlamaMLP` (Mistral/Qwen2/Qwen3 too): `down(swiglu(gate(x), up(x)))`.

    Keeps `gate_proj`, `up_proj` and `down_proj` as the *same* module objects (so parameter names,
    state-dict keys, shards and hooks on them are unchanged) and HF's `config`, `hidden_size`
    and `intermediate_size` attributes. Only the activation changes, from `act_fn(g) * u` to the
    fused kernel.
    """

    def __init__(self, mlp: nn.Module, backend: str = "auto"):
        problem = swiglu_mlp_problem(mlp)
        if problem is not None:
            raise ValueError(f"FusedLlamaMLP: {problem}")
        super().__init__()
        for attr in ("config", "hidden_size", "intermediate_size"):
            if attr in mlp.__dict__:
                self.__dict__[attr] = mlp.__dict__[attr]
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act = FusedSwiGLU(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))
