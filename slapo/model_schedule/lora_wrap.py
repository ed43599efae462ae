"""Wrapping a model with PEFT's LoRA before it is scheduled: the targets checked, and by default
the projections the family's tensor-parallel plan splits.

Why the plan decides the default: the modules a family's plan shards as `Column`/`Row` are its
attention and MLP projections, the ones LoRA is usually put on, and the ones
`model_schedule.lora` knows how to split with an adapter; a second per-family list of names
could drift from the plan. The targets are passed to PEFT as full module paths, so a name that
also occurs outside the layers (BERT's pooler `dense`) is not caught by accident.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from ..errors import SchedulingError
from ._common import find_path
from .plan import Column, Row, TPPlan


def default_targets(model: nn.Module) -> list[str]:
    """The full paths of the projections the model's family plan splits (`Column`/`Row` rows
    of every layer): LoRA's default targets. Refused for a family without a plan."""
    from ._registry import detect

    family = detect(model)
    plan = family.tp_plan
    if not isinstance(plan, TPPlan):
        raise SchedulingError("", f"family {family.name!r} has no tensor-parallel plan to take "
                              "LoRA's default targets from.", "pass the targets (module names "
                              "or path suffixes of its Linear layers).")
    rels = [p.rstrip("?") for p, s in plan.entries if isinstance(s, (Column, Row))]
    mods = dict(model.named_modules())
    out = []
    for suffix in family.layer_lists:
        path = find_path(model, suffix)
        for i in range(len(mods[path]) if path is not None else 0):
            out += [f"{path}.{i}.{rel}" for rel in rels if f"{path}.{i}.{rel}" in mods]
    return list(dict.fromkeys(out))


def check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Every target names at least one module (its path, or a suffix after a dot, PEFT's
    rule); a target that matches nothing is a typo PEFT would report without the candidates."""
    if isinstance(targets, str) or not targets or not all(isinstance(t, str) and t
                                                          for t in targets):
        raise SchedulingError("", f"LoRA targets must be a non-empty list of module names, got "
                              f"{targets!r}.", "pass e.g. ['q_proj', 'v_proj'].")
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise SchedulingError("", f"LoRA targets {missing} match no module of "
                              f"{type(model).__name__}.", f"use names of its projections "
                              f"(its Linear layers: {', '.join(linear)}).")


def add_lora(model: nn.Module, r: int, alpha: float | None = None, dropout: float = 0.0,
             targets: Sequence[str] | None = None):
    """`peft.get_peft_model(model, LoraConfig(...))` on `targets` (default:
    `default_targets(model)`), checked first: a refused call leaves the model unchanged.
    `alpha=None` keeps PEFT's default. Returns the `PeftModel` (base frozen, adapters
    trainable), which `model_schedule.apply` schedules like its base. A base on the meta device
    (a pretrained model whose weights are read after scheduling) gets real adapters,
    initialised as PEFT initialises them (`materialize_adapters`)."""
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise SchedulingError("", f"LoRA rank r must be a positive int, got {r!r}.",
                              "pass e.g. r=8.")
    if not 0.0 <= dropout < 1.0:
        raise SchedulingError("", f"LoRA dropout must be in [0, 1), got {dropout!r}.",
                              "pass e.g. dropout=0.0.")
    try:
        import peft
    except ImportError as e:
        raise SchedulingError("", "LoRA needs the peft package.",
                              "pip install 'slapo[peft]'.") from e
    chosen = targets if targets is not None else default_targets(model)
    check_targets(model, chosen)
    chosen = list(chosen)
    kw = {} if alpha is None else {"lora_alpha": alpha}
    if _all_conv1d(model, chosen):  # GPT-2's Conv1D stores (in, out): PEFT's flag for it
        kw["fan_in_fan_out"] = True
    config = peft.LoraConfig(r=r, lora_dropout=dropout, target_modules=chosen, **kw)
    wrapped = peft.get_peft_model(model, config)
    materialize_adapters(wrapped)
    return wrapped


def _all_conv1d(model: nn.Module, targets: Sequence[str]) -> bool:
    """Every module the targets match is an HF `Conv1D` (PEFT warns and flips its
    `fan_in_fan_out` per layer otherwise)."""
    hit = [m for n, m in model.named_modules()
           if n and any(n == t or n.endswith("." + t) for t in targets)]
    return bool(hit) and all(type(m).__name__ == "Conv1D" for m in hit)


def materialize_adapters(model: nn.Module) -> int:
    """Allocate (on CPU) and initialise every LoRA adapter that PEFT left on the meta device,
    as PEFT does (`reset_lora_parameters`: A as an `nn.Linear`, B zero) from the global RNG;
    returns how many layers it filled.

    Why: PEFT puts adapters on their base layer's device, so a meta base (`slapo train
    --model DIR` builds on meta and reads each rank's shards after scheduling) yields meta
    adapters, which no checkpoint fills and which `init.materialize` would give nn.Linear's
    init (B random, not zero). Done before scheduling, so every tp rank draws the same whole
    adapter and keeps its slice, as with a model built on CPU."""
    from .lora import is_tuner_layer

    filled = 0
    for mod in model.modules():
        if not is_tuner_layer(mod) or not hasattr(mod, "lora_A"):
            continue
        for name in list(mod.lora_A.keys()):
            parts = (mod.lora_A[name], mod.lora_B[name])
            if not any(p.is_meta for part in parts for p in part.parameters()):
                continue
            for part in parts:
                part.to_empty(device="cpu")
            init = model.peft_config[name].init_lora_weights if hasattr(model, "peft_config") \
                else True
            mod.reset_lora_parameters(name, init)
            filled += 1
    return filled


__all__ = ["add_lora", "check_targets", "default_targets", "materialize_adapters"]
