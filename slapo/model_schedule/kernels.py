"""Swap the fused kernels of `slapo.op.kernels` into a scheduled HF model.

    n = apply_kernels(sch, "llama")   # or "gpt2", "bert", "roberta", "opt", "gpt_neo", "albert",
                                      # "t5"

Only `.replace()` is used, so every swap is recorded in the schedule's history, the new modules
hold the *same* parameter objects, and parameter names / state-dict keys do not change.

Plans (what is replaced, per family):
* llama (also Mistral, Qwen2, Qwen3): every `*RMSNorm` of the LLaMA kind -> `FusedRMSNorm`;
  every gated-SiLU MLP (`gate_proj`/`up_proj`/`down_proj`) -> `FusedLlamaMLP`, which keeps the
  three Linear objects and fuses `silu(gate) * up`.
  RoPE is *not* swapped: HF applies it with a module-level function inside the attention
  forward, not a module, so there is nothing to `.replace()`; patching that function would
  change every model in the process (what Liger-Kernel does). `slapo.op.kernels.
  apply_rotary_pos_emb` has HF's signature for callers who want that.
* t5 (also mT5): every `T5LayerNorm` -> `FusedRMSNorm(style="t5")` (T5 rounds the normalised
  value to the weight's dtype, and only when that is half precision: not LLaMA's order, so a
  style of its own); v1.1's gated-GELU activation (`NewGELUActivation`) -> `FusedGELU` (tanh).
  The gate multiply stays HF's: the whole `DenseReluDense` is not replaced, since under TP it
  carries the all-reduce of its input gradient (`fuse=True` compiles the gated activation
  with its multiply instead). v1's ReLU is left alone.
* gpt2, gpt_neo, bert, roberta, opt, albert: every `nn.LayerNorm` over one dimension -> `FusedLayerNorm`
  (a subclass, sharing weight and bias); every GELU module (`nn.GELU`, HF `GELUActivation`,
  `NewGELUActivation`, `GELUTanh`) -> `FusedGELU` (erf or tanh form, no bias, no dropout: HF's
  MLPs apply dropout after the second projection, not after the activation). OPT's default
  activation is ReLU, which is left alone.

Order with the other concerns of `model_schedule.apply`: run this before `checkpoint`,
sequence parallelism's `reduce_param_grads` and Tempo; a target that a primitive has already
patched (its class was swapped by checkpoint / sync / fork_rng ...) is refused, since replacing
it would drop that behaviour. The one exception is `reduce_param_grads` alone (TP's rows for
Qwen3's per-head `q_norm`/`k_norm`): its wrapper is moved onto the fused module, which holds the
same parameters under the same names. TP sharding of the MLP projections is fine (the Linear objects,
their shards and hooks are kept).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import nn

from .. import module_patch
from ..errors import SchedulingError
from ..module_patch import original_class
from ..schedule import Schedule

_LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
_T5_NORMS = ("T5LayerNorm", "MT5LayerNorm")
_LLAMA_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
_TANH_GELUS = ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh")
_LN_GELU = ("layer_norm", "gelu")

PLANS: dict[str, tuple[str, ...]] = {
    "llama": ("rms_norm", "swiglu_mlp"),
    "gpt2": _LN_GELU,
    "gpt_neo": _LN_GELU,
    "bert": _LN_GELU,
    "roberta": _LN_GELU,
    "opt": _LN_GELU,
    "albert": _LN_GELU,
    "t5": ("t5_rms_norm", "gelu"),
}


def gelu_form(module: nn.Module) -> str | None:
    """"none" (erf) / "tanh" for a GELU module `FusedGELU` computes exactly, else None."""
    cls = original_class(module)  # a module patched by a primitive still matches (then refused)
    if cls is nn.GELU:
        return module.approximate
    name = cls.__name__
    if name == "GELUActivation":
        act = getattr(module, "act", None)
        ok = act is F.gelu or getattr(act, "__name__", "") == "_gelu_python"
        return "none" if ok else None
    return "tanh" if name in _TANH_GELUS else None


def _rms_norm(mod: nn.Module, backend: str) -> Callable[[], nn.Module] | None:
    if original_class(mod).__name__ not in _LLAMA_NORMS:
        return None
    from ..op.kernels import FusedRMSNorm

    return lambda: FusedRMSNorm.from_module(mod, backend)


def _t5_rms_norm(mod: nn.Module, backend: str) -> Callable[[], nn.Module] | None:
    if original_class(mod).__name__ not in _T5_NORMS:
        return None
    from ..op.kernels import FusedRMSNorm

    return lambda: FusedRMSNorm.from_module(mod, backend, style="t5")


def _swiglu_mlp(mod: nn.Module, backend: str) -> Callable[[], nn.Module] | None:
    if original_class(mod).__name__ not in _LLAMA_MLPS:
        return None
    from ..op.kernels import FusedLlamaMLP

    return lambda: FusedLlamaMLP(mod, backend)


def _layer_norm(mod: nn.Module, backend: str) -> Callable[[], nn.Module] | None:
    if original_class(mod) is not nn.LayerNorm or len(mod.normalized_shape) != 1:
        return None
    from ..op.kernels import FusedLayerNorm

    return lambda: FusedLayerNorm.from_module(mod, backend)


def _gelu(mod: nn.Module, backend: str) -> Callable[[], nn.Module] | None:
    form = gelu_form(mod)
    if form is None:
        return None
    from ..op.kernels import FusedGELU

    return lambda: FusedGELU(form, backend=backend)


_RULES = {"rms_norm": _rms_norm, "t5_rms_norm": _t5_rms_norm, "swiglu_mlp": _swiglu_mlp,
          "layer_norm": _layer_norm, "gelu": _gelu}


def _carried_wrappers(mod: nn.Module) -> list | None:
    """The primitives' forward wrappers a replacement can take over, or None when `mod` was
    changed in a way replacing it would undo. Only `reduce_param_grads` is carried: it names
    parameters, and the fused module holds the same parameter objects under the same names
    (Qwen3's per-head `q_norm`/`k_norm` under TP sum their gradients over the group)."""
    from ..primitives.reduce_param_grads import ReduceParamGradsWrapper

    if not getattr(type(mod), "_slapo_patched", False):
        return []
    held = module_patch.wrappers(mod)
    extra = set(mod.__dict__) & {"_slapo_kernel", "_slapo_meta"}
    if extra or not held or not all(isinstance(w, ReduceParamGradsWrapper) for w in held):
        return None
    return held


def _problem(node: Schedule, kind: str) -> str | None:
    """Why a matched target cannot be replaced (checked for all targets before any change)."""
    mod = node.mod
    if _carried_wrappers(mod) is None:
        return (f"{type(mod).__name__} at {node.path or '<root>'} was already changed by a "
                "primitive (checkpoint, sync, fork_rng, ...), which replacing it would undo")
    if kind == "swiglu_mlp":
        from ..op.kernels import swiglu_mlp_problem

        return swiglu_mlp_problem(mod)
    return None


def plan_targets(sch: Schedule, family_name: str,
                 backend: str = "auto") -> list[tuple[Schedule, Callable[[], nn.Module]]]:
    """[(node, factory of its replacement)] for every target under `sch`; mutates nothing."""
    if family_name not in PLANS:
        raise SchedulingError(sch.path, f"no kernel plan for the {family_name!r} family.",
                              f"use one of {', '.join(sorted(PLANS))}, or replace modules "
                              "with slapo.op.kernels yourself.")
    from ..op.kernels import BACKENDS

    if backend not in BACKENDS:
        raise SchedulingError(sch.path, f"unknown kernel backend {backend!r}.",
                              f"use one of {', '.join(BACKENDS)}.")
    targets: list[tuple[Schedule, Callable[[], nn.Module]]] = []
    for _, node in sch.named_schedules():
        if any(node.path.startswith(t.path + ".") or t.path == "" for t, _ in targets):
            continue  # inside a module already planned for replacement
        for kind in PLANS[family_name]:
            factory = _RULES[kind](node.mod, backend)
            if factory is None:
                continue
            problem = _problem(node, kind)
            if problem is not None:
                raise SchedulingError(node.path, f"cannot swap in the {kind} kernel: {problem}.",
                                      "apply kernels before the other primitives.")
            targets.append((node, factory))
            break
    return targets


def apply_kernels(sch: Schedule, family_name: str, *, backend: str = "auto") -> int:
    """Replace the modules of `family_name`'s plan under `sch` by fused-kernel modules.

    `backend` is passed to every new module ("auto": Triton on CUDA, the exact reference
    elsewhere). Returns the number of modules replaced (0 when run twice: the new modules are
    not targets). Raises SchedulingError before any change for an unknown family or backend, or
    a target that cannot be replaced.
    """
    if not isinstance(sch, Schedule):
        raise SchedulingError("", f"apply_kernels expects a Slapo schedule, got "
                              f"{type(sch).__name__}.", "use slapo.create_schedule(model).")
    targets = plan_targets(sch, family_name, backend)
    for node, factory in targets:
        carried = _carried_wrappers(node.mod)
        new = factory()
        node.replace(new)
        for wrapper in carried:
            module_patch.add_wrapper(new, wrapper)
    return len(targets)
