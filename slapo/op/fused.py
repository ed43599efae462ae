"""Fused elementwise epilogues: bias + GELU, and bias + dropout + residual add.

Why: after a Linear without bias, these chains are memory-bound elementwise ops; eager PyTorch
runs 2-3 kernels and writes each intermediate. `torch.compile` fuses each chain into one kernel
(CUDA: Triton; CPU: C++), which is where the speed comes from. Compilation is opt-in
(`compile=True`) because the first call compiles (8-60 s on CPU) and needs a C++ compiler or
Triton; if compiling fails the module warns once and stays eager, so results never depend on it.

Exact: the eager path computes exactly `gelu(x + bias)` and `dropout(x + bias) + residual`; the
compiled path is the same math (summation order may differ in the last bit). Dropout draws differ
between eager and compiled code, so compare them with p=0 or in eval mode. Devices: any.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """gelu(x + bias), the epilogue of FC1."""
    return F.gelu(x + bias if bias is not None else x, approximate=approximate)


def bias_dropout_add(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    p: float,
    training: bool,
) -> torch.Tensor:
    """dropout(x + bias, p) + residual, the epilogue of attention-output and FC2 projections."""
    if bias is not None:
        x = x + bias
    return residual + F.dropout(x, p=p, training=training)


class _MaybeCompiled:
    """Calls `fn` compiled when asked and possible, eagerly otherwise (warning once on failure)."""

    def __init__(self, fn: Callable[..., torch.Tensor], compile: bool, name: str):
        self.fn, self.name, self.want = fn, name, compile
        self.compiled: Callable[..., torch.Tensor] | None = None
        self.failed = False

    def __call__(self, *args: Any) -> torch.Tensor:
        if not self.want or self.failed:
            return self.fn(*args)
        try:
            if self.compiled is None:
                self.compiled = torch.compile(self.fn, dynamic=False)
            return self.compiled(*args)
        except Exception as e:  # no compiler, unsupported backend, ...
            self.failed = True
            warnings.warn(
                f"{self.name}: torch.compile failed ({type(e).__name__}: {e}); running eagerly.",
                stacklevel=3,
            )
            return self.fn(*args)


class FusedBiasGELU(nn.Module):
    """gelu(x + bias) with the bias owned here (pair it with `nn.Linear(..., bias=False)`).

    `from_linear(linear)` moves a Linear's bias into this module and returns the bias-free Linear,
    so `Linear -> GELU` becomes `Linear(bias=False) -> FusedBiasGELU` with the same parameters.
    `approximate="tanh"` matches HF "gelu_new". `compile=True` fuses the epilogue.
    """

    def __init__(
        self,
        size: int,
        approximate: str = "none",
        compile: bool = False,
        bias: nn.Parameter | None = None,
    ):
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(
                f"FusedBiasGELU: approximate must be 'none' or 'tanh', got {approximate!r}"
            )
        if bias is not None and bias.shape != (size,):
            raise ValueError(f"FusedBiasGELU: bias shape {tuple(bias.shape)} != ({size},)")
        self.bias = bias if bias is not None else nn.Parameter(torch.zeros(size))
        self.approximate = approximate
        self._fn = _MaybeCompiled(bias_gelu, compile, "FusedBiasGELU")

    @staticmethod
    def from_linear(
        linear: nn.Linear, approximate: str = "none", compile: bool = False
    ) -> tuple[nn.Linear, FusedBiasGELU]:
        """(bias-free Linear sharing the weight, FusedBiasGELU holding the old bias)."""
        if linear.bias is None:
            raise ValueError("FusedBiasGELU.from_linear: the Linear has no bias to fuse")
        new = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        new.weight = linear.weight
        return new, FusedBiasGELU(linear.out_features, approximate, compile, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x, self.bias, self.approximate)


class FusedBiasDropoutAdd(nn.Module):
    """dropout(x + bias, p) + residual; `forward(x, residual, bias=None)`.

    Dropout is active only in training mode. `compile=True` fuses the epilogue.
    """

    def __init__(self, p: float, compile: bool = False):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"FusedBiasDropoutAdd: p must be in [0, 1), got {p}")
        self.p = p
        self._fn = _MaybeCompiled(bias_dropout_add, compile, "FusedBiasDropoutAdd")

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self._fn(x, bias, residual, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"
