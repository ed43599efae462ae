"""The checks of a plan derived from a declared HF plan (`hf_plan.py`) against every layer
of the model, before any change: each layer's MoE block is one form, a hybrid layer's other
kind of module stays whole, and no parameter in a split module is left without a style (its
gradient would be one rank's share). A failed check is a `Refused` with the reason, which
`hf_plan.derive_plan` turns into a `RefusedPlan`."""

from __future__ import annotations

import torch.nn as nn

from .lora import is_tuner_layer
from .plan import OPTIONAL, Column, ShardParam, Style
from .plan_edges import GatherOutput, Replicated
from .plan_experts import Experts


class Refused(Exception):
    """A declared plan that cannot be translated exactly (the message: why)."""


def get(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at `path`, or None."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def other_kinds_optional(layers: list[nn.Module], rows: list[tuple[str, Style]],
                         model_type: str) -> list[tuple[str, Style]]:
    """A hybrid decoder may hold another kind of module at a row's place in some layers
    (MiniMax: a linear attention as `self_attn`, with none of the declared projections), or a
    per-head parameter in some layers only (MiMo-V2's attention sinks). Such a module stays whole
    there (replicated: its inputs and outputs are whole, so it is exact), so those rows are
    optional. A layer with some of a place's declared modules but not all is refused: a
    projection would be split without the one that completes it."""
    places: dict[str, list[tuple[str, Style]]] = {}
    for p, st in rows:
        if not p.endswith(OPTIONAL) and p:
            places.setdefault(p.split(".")[0], []).append((p, st))
    optional: set[tuple[str, Style]] = set()
    for place, entries in places.items():
        modules = sorted({p for p, st in entries if not isinstance(st, ShardParam)})
        for i, layer in enumerate(layers):
            if get(layer, place) is None:
                continue  # a layer without the place at all: `DeclaredPlan._node` skips it
            has = [p for p in modules if get(layer, p) is not None]
            if not has:
                optional |= set(entries)  # another kind of module at this place
            elif has != modules:
                raise Refused(f"{model_type!r}: layer {i} has {has} of the declared {modules}, "
                              "a projection without the one that completes it")
            optional |= {(p, st) for p, st in entries if isinstance(st, ShardParam)
                         and not has_param(get(layer, p), st.name)}
    return [(p + OPTIONAL if (p, st) in optional else p, st) for p, st in rows]


def has_param(mod: nn.Module | None, name: str) -> bool:
    """`mod` has its own registered parameter `name`."""
    return mod is not None and isinstance(mod._parameters.get(name), nn.Parameter)


def check_moe_layers(layers: list[nn.Module], rows: list[tuple[str, Style]],
                     experts: set[str], model_type: str) -> None:
    """Each layer's MoE block is one form: experts (with their shared experts) or a dense MLP
    whose every declared projection is there, never a mix (a row skipped beside an applied
    partner would leave a projection split without the one that completes it)."""
    for e in experts:
        parent = e.rpartition(".")[0]
        dense = sorted({p.rstrip(OPTIONAL) for p, _ in rows
                        if p.rstrip(OPTIONAL).rpartition(".")[0] == parent
                        and p.rstrip(OPTIONAL) != e})
        for i, layer in enumerate(layers):
            has = [d for d in dense if get(layer, d) is not None]
            moe = get(layer, e) is not None
            if (moe and has) or (not moe and dense and has != dense):
                raise Refused(f"{model_type!r}: layer {i} has {'experts and ' if moe else ''}"
                              f"{has or 'none'} of its dense MLP rows {dense}, neither the "
                              "experts alone nor the whole dense MLP")


def check_regions(layers: list[nn.Module], rows: list[tuple[str, Style]],
                  model_type: str) -> None:
    """Refuse a parameter no row covers inside a module whose column projections keep their
    outputs split (no `GatherOutput`): it may compute on this rank's features only (Apertus's
    xIELU `mlp.act_fn.alpha_p`), so its gradient would be partial, and the declared plan does
    not say (`replicated_with_grad_allreduce`) that it is. Where every column output is
    gathered, the module computes on whole tensors and its parameters are exact."""
    rows = [(p.rstrip(OPTIONAL), s) for p, s in rows]
    gathered = {p for p, s in rows if isinstance(s, GatherOutput)}
    covered = {p for p, _ in rows}
    for layer in layers:
        # only the rows this layer has split its regions (an MoE layer has no dense MLP rows);
        # tensor-parallel experts are a region of their own (their intermediate features)
        split = {p.rpartition(".")[0] for p, s in rows if isinstance(s, Column)
                 and p not in gathered and get(layer, p) is not None}
        split |= {p for p, s in rows if isinstance(s, Experts) and get(layer, p) is not None}
        # a PEFT adapter layer at a row's path: its base, A and B are the row's (lora.py); a
        # replicated module's submodules are its own
        tuned = tuple(c + "." for c in covered if is_tuner_layer(get(layer, c)))
        tuned += tuple(p + "." for p, s in rows if isinstance(s, Replicated))
        for region in sorted(split):
            mod = get(layer, region)
            if mod is None:
                continue
            for name, _ in mod.named_parameters():
                owner = join(region, name.rpartition(".")[0])
                if owner not in covered and not owner.startswith(tuned):
                    raise Refused(f"{model_type!r}: the parameter {join(region, name)!r} sits "
                                  f"in {region!r}, whose projections keep their outputs split, "
                                  "and the declared plan gives it no style, so its gradient "
                                  "could be one rank's share")


def join(*parts: str) -> str:
    return ".".join(p for p in parts if p)
