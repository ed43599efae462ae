"""Apply the three Tempo layers to a schedule (or a plain module) by module replacement.

Why replacement and not graph rewriting: every target is its own module in HF models (LayerNorm,
the GELU activation module, the attention module whose core we swap), so `.replace()` keeps
parameters, names and checkpoints intact and is recorded in the schedule history.

What is replaced (each only where it saves memory and the result is the same computation):
* `nn.LayerNorm` (exact type)                   -> `TempoLayerNorm` sharing its parameters;
* GELU modules: `nn.GELU`, HF `GELUActivation`,
  `NewGELUActivation`, `GELUTanh`                  -> `TempoGELU` (erf or tanh form);
* HF attention modules whose model uses the "eager" attention implementation -> the same module
  with `TempoAttentionCore` (sdpa/flash already keep no s*s tensors, so they are left alone).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn

from ..errors import SchedulingError
from .hf_attention import is_hf_attention, use_attention_core
from .tempo_attention import TempoAttentionCore
from .tempo_gelu import TempoGELU
from .tempo_layernorm import TempoLayerNorm

_TANH_GELUS = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh"}


def gelu_kind(module: nn.Module) -> str | None:
    """'none' / 'tanh' for a GELU module Tempo can replace exactly, else None."""
    if type(module) is nn.GELU:
        return module.approximate
    name = type(module).__name__
    if name == "GELUActivation":
        act = getattr(module, "act", None)
        if act is F.gelu or getattr(act, "__name__", "") == "_gelu_python":
            return "none"
        return None
    if name in _TANH_GELUS:
        return "tanh"
    return None


def tempo_replacement(
    module: nn.Module,
    path: str = "",
    gelu: bool = True,
    layernorm: bool = True,
    attention: bool = True,
    band: float = 0.05,
    min_gamma_ratio: float | None = None,
) -> nn.Module | None:
    """The Tempo module to install in place of `module`, or None if it is not a target."""
    if layernorm and type(module) is nn.LayerNorm:
        return TempoLayerNorm.from_layernorm(module, min_gamma_ratio)
    if gelu:
        kind = gelu_kind(module)
        if kind is not None:
            return TempoGELU(kind, band)
    if (
        attention
        and is_hf_attention(module)
        and module.config._attn_implementation == "eager"
        and not getattr(module, "reorder_and_upcast_attn", False)
    ):
        return use_attention_core(module, TempoAttentionCore(), path)
    return None


def replace_layernorm(sch: Any, min_gamma_ratio: float | None = None) -> nn.Module:
    """One-line schedule replacement: `replace_layernorm(sch["attention.output.LayerNorm"])`."""
    if not isinstance(sch.mod, nn.LayerNorm):
        raise SchedulingError(sch.path, f"expected nn.LayerNorm, found {type(sch.mod).__name__}.")
    return sch.replace(TempoLayerNorm.from_layernorm(sch.mod, min_gamma_ratio))


def replace_gelu(sch: Any, band: float = 0.05) -> nn.Module:
    """One-line schedule replacement: `replace_gelu(sch["intermediate.intermediate_act_fn"])`."""
    kind = gelu_kind(sch.mod)
    if kind is None:
        raise SchedulingError(
            sch.path,
            f"{type(sch.mod).__name__} is not a GELU module Tempo can replace.",
            "target nn.GELU or HF's GELUActivation / NewGELUActivation / GELUTanh.",
        )
    return sch.replace(TempoGELU(kind, band))


def replace_attention_core(sch: Any, core: nn.Module | None = None) -> nn.Module:
    """One-line schedule replacement of an HF attention core (default: Tempo's fused core).

    `replace_attention_core(sch["attention.self"])`; pass `core=slapo.op.SDPAttention()` for SDPA.
    """
    return sch.replace(use_attention_core(sch.mod, core or TempoAttentionCore(), sch.path))


def apply_tempo(
    sch: Any,
    gelu: bool = True,
    layernorm: bool = True,
    attention: bool = True,
    band: float = 0.05,
    min_gamma_ratio: float | None = None,
) -> list[tuple[str, str]]:
    """Replace every Tempo target under schedule `sch` (any root: a whole model or one layer).

    Uses only `sch.replace`, deepest modules first (so a replaced attention module already holds
    its replaced children). Returns [(path, new module class)] in pre-order.
    """
    if not hasattr(sch, "named_schedules") or not hasattr(sch, "mod"):
        raise SchedulingError(
            "",
            f"apply_tempo expects a Slapo schedule, got {type(sch).__name__}.",
            "use slapo.create_schedule(model), or apply_tempo_to_module(model) for a plain module.",
        )
    nodes = [node for _, node in sch.named_schedules()]
    done = []
    for node in reversed(nodes):
        new = tempo_replacement(
            node.mod, node.path, gelu, layernorm, attention, band, min_gamma_ratio
        )
        if new is not None:
            node.replace(new)
            done.append((node.path, type(new).__name__))
    return done[::-1]


def apply_tempo_to_module(
    model: nn.Module,
    gelu: bool = True,
    layernorm: bool = True,
    attention: bool = True,
    band: float = 0.05,
    min_gamma_ratio: float | None = None,
) -> nn.Module:
    """`apply_tempo` for a plain module, without a schedule. Returns the (possibly new) root."""
    paths = [path for path, _ in model.named_modules()]
    for path in reversed(paths):
        mod = model.get_submodule(path)
        new = tempo_replacement(mod, path, gelu, layernorm, attention, band, min_gamma_ratio)
        if new is None:
            continue
        new.train(mod.training)
        if path == "":
            model = new
        else:
            parent, _, name = path.rpartition(".")
            model.get_submodule(parent)._modules[name] = new
    return model
