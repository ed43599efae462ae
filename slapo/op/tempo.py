"""Apply the three Tempo layers to a schedule (or a plain module) by module replacement.

Why replacement and not graph rewriting: every target is its own module in HF models (LayerNorm,
the GELU activation module, the attention module whose core we swap), so `.replace()` keeps
parameters, names and checkpoints intact and is recorded in the schedule history.

What is replaced (each only where it saves memory and the result is the same computation):
* `nn.LayerNorm` (exact type)                   -> `TempoLayerNorm` sharing its parameters;
* GELU modules: `nn.GELU`, HF `GELUActivation`,
  `NewGELUActivation`, `GELUTanh`                  -> `TempoGELU` (erf or tanh form);
* HF attention modules whose model uses the "eager" attention implementation -> the same module
  with `TempoAttentionCore`, unless the module passes its attention function an input the core
  does not compute (Gemma 2's soft-cap, GPT-OSS's sinks: `hf_attention.uncomputed_inputs`),
  which keeps its own. Attention that runs SDPA / flash (or any non-eager implementation) is
  kept: those kernels never store the s*s probabilities, so they already save more than Tempo's
  softmax-dropout trick and are faster. `apply_tempo` reports the choice per attention module
  (`TempoReport.attention`: "tempo" or "kept <implementation>") and logs it.

GELU and LayerNorm run fused kernels (Triton on CUDA; see `tempo_gelu` / `tempo_layernorm`).
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn.functional as F
from torch import nn

from ..errors import SchedulingError
from . import tempo_kernels
from .hf_attention import is_hf_attention, uncomputed_inputs, use_attention_core
from .tempo_attention import TempoAttentionCore
from .tempo_gelu import TempoGELU
from .tempo_layernorm import TempoLayerNorm

_TANH_GELUS = {"NewGELUActivation", "GELUTanh", "PytorchGELUTanh"}
_log = logging.getLogger(__name__)


class TempoReport(list):
    """`apply_tempo`'s result: [(path, new module class)] in pre-order, plus `.attention`.

    `.attention` maps every HF attention module met to "tempo" (its core was replaced by
    `TempoAttentionCore`: the model runs eager attention) or "kept <implementation>" (SDPA/flash
    or a core a schedule installed before: faster and already free of s*s tensors), or "off"
    when `attention=False`.
    `.compiled` says how each part runs inside a `torch.compile`d region (`compiled_plan`).
    """

    def __init__(self, items=(), attention: dict[str, str] | None = None):
        super().__init__(items)
        self.attention: dict[str, str] = dict(attention or {})
        self.compiled: dict[str, str] = compiled_plan()


def compiled_plan() -> dict[str, str]:
    """How each Tempo part runs inside `torch.compile` on the current path (docs/tempo.md).

    Every part is installed in compiled layers too: measured on CPU with inductor (BERT and
    GPT-2 layers, fp32 and bf16 autocast), each still saves bytes over inductor's own
    partitioner, which keeps both the GELU's input and output and the LayerNorm's fp32 input.
    """
    if tempo_kernels.compiled_path() == "opaque":
        return {"layernorm": "custom op slapo_tempo::ln_fwd/ln_bwd (opaque to inductor)",
                "gelu": "custom op slapo_tempo::gelu_fwd/gelu_bwd (opaque to inductor)"}
    return {"layernorm": "traced: inductor fuses it; saves y (bf16 copy under autocast), rstd",
            "gelu": "y by inductor; code byte slapo_tempo::gelu_code, backward gelu_bwd"}


def attention_choice(module: nn.Module, enabled: bool = True) -> str | None:
    """What Tempo does with an HF attention module: "tempo", "kept <impl>", "off"; None if the
    module is not HF attention."""
    if not is_hf_attention(module):
        return None
    if not enabled:
        return "off"
    impl = module.config._attn_implementation
    if impl != "eager":
        return f"kept {impl}"
    if getattr(module, "reorder_and_upcast_attn", False):
        return "kept eager (reorder_and_upcast_attn)"
    dropped = uncomputed_inputs(module)  # a soft-cap, sinks: Tempo's core computes neither
    if dropped:
        return f"kept eager (passes {', '.join(dropped)})"
    return "tempo"


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
    min_gamma_ratio: float | None = None,
) -> nn.Module | None:
    """The Tempo module to install in place of `module`, or None if it is not a target."""
    if layernorm and type(module) is nn.LayerNorm:
        return TempoLayerNorm.from_layernorm(module, min_gamma_ratio)
    if gelu:
        kind = gelu_kind(module)
        if kind is not None:
            return TempoGELU(kind)
    if attention_choice(module, bool(attention)) == "tempo":
        return use_attention_core(module, TempoAttentionCore(), path)
    return None


def replace_layernorm(sch: Any, min_gamma_ratio: float | None = None) -> nn.Module:
    """One-line schedule replacement: `replace_layernorm(sch["attention.output.LayerNorm"])`."""
    if not isinstance(sch.mod, nn.LayerNorm):
        raise SchedulingError(sch.path, f"expected nn.LayerNorm, found {type(sch.mod).__name__}.")
    return sch.replace(TempoLayerNorm.from_layernorm(sch.mod, min_gamma_ratio))


def replace_gelu(sch: Any) -> nn.Module:
    """One-line schedule replacement: `replace_gelu(sch["intermediate.intermediate_act_fn"])`."""
    kind = gelu_kind(sch.mod)
    if kind is None:
        raise SchedulingError(
            sch.path,
            f"{type(sch.mod).__name__} is not a GELU module Tempo can replace.",
            "target nn.GELU or HF's GELUActivation / NewGELUActivation / GELUTanh.",
        )
    return sch.replace(TempoGELU(kind))


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
    min_gamma_ratio: float | None = None,
) -> TempoReport:
    """Replace every Tempo target under schedule `sch` (any root: a whole model or one layer).

    Uses only `sch.replace`, deepest modules first (so a replaced attention module already holds
    its replaced children). Returns a `TempoReport`: [(path, new module class)] in pre-order, and
    `.attention` saying per attention module whether Tempo's core or the model's SDPA/flash runs.
    """
    if not hasattr(sch, "named_schedules") or not hasattr(sch, "mod"):
        raise SchedulingError(
            "",
            f"apply_tempo expects a Slapo schedule, got {type(sch).__name__}.",
            "use slapo.create_schedule(model), or apply_tempo_to_module(model) for a plain module.",
        )
    nodes = [node for _, node in sch.named_schedules()]
    done, choices = [], {}
    for node in reversed(nodes):
        choice = attention_choice(node.mod, bool(attention))
        if choice is not None:
            choices[node.path] = choice
        new = tempo_replacement(node.mod, node.path, gelu, layernorm, attention, min_gamma_ratio)
        if new is not None:
            node.replace(new)
            done.append((node.path, type(new).__name__))
    report = TempoReport(done[::-1], dict(sorted(choices.items())))
    _log_attention(report.attention)
    return report


def _log_attention(choices: dict[str, str]) -> None:
    kinds: dict[str, int] = {}
    for choice in choices.values():
        kinds[choice] = kinds.get(choice, 0) + 1
    if kinds:
        summary = ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items()))
        _log.info("apply_tempo attention: %s", summary)


def apply_tempo_to_module(
    model: nn.Module,
    gelu: bool = True,
    layernorm: bool = True,
    attention: bool = True,
    min_gamma_ratio: float | None = None,
) -> nn.Module:
    """`apply_tempo` for a plain module, without a schedule. Returns the (possibly new) root."""
    paths = [path for path, _ in model.named_modules()]
    for path in reversed(paths):
        mod = model.get_submodule(path)
        new = tempo_replacement(mod, path, gelu, layernorm, attention, min_gamma_ratio)
        if new is None:
            continue
        new.train(mod.training)
        if path == "":
            model = new
        else:
            parent, _, name = path.rpartition(".")
            model.get_submodule(parent)._modules[name] = new
    return model
