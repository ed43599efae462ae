"""The text of Verify's localisation: the module, the primitives applied there, the likely
cause (what `slapo.verify.localise` found, written for the person who has to fix it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import module_patch, sharding
from ..schedule import Schedule

_COMPLETING = {("fwd_post", "all_reduce"), ("fwd_post", "reduce_scatter")}


@dataclass
class Finding:
    """The first divergence: module path, what diverged, max abs error, partial sum?"""

    path: str
    what: str
    err: float
    partial: bool
    receivers: list[str] = field(default_factory=list)
    tensor: str = ""
    call: int = 0  # the module's call number (forward outputs)


def completed_above(model: nn.Module, path: str) -> bool:
    """Whether an ancestor of `path` has a fwd_post sync that completes a partial sum."""
    parts = path.split(".") if path else []
    for i in range(len(parts)):
        anc = model.get_submodule(".".join(parts[:i]))
        if set(module_patch.module_meta(anc).get("syncs", [])) & _COMPLETING:
            return True
    return False


# ------------------------------------------------------------------------------------------

def applied_around(sch: Schedule, path: str, below: bool = False) -> list[str]:
    """`path: primitive(...)` for the module at `path` and its ancestors (root first); with
    `below`, also its descendants'."""
    found: list[tuple[str, Any]] = []
    parts = path.split(".") if path else []
    for i in range(len(parts) + 1):
        p = ".".join(parts[:i])
        if p in sch.root:
            found += [(p, h) for h in sch.root[p].history]
    if below and path in sch.root:
        found += [(p, h) for p, h in sch.root[path].applied() if p != path]
    grouped: dict[str, list[str]] = {}
    for p, h in found:
        grouped.setdefault(p or "<root>", []).append(str(h))
    return [f"{p}: {', '.join(hs)}" for p, hs in grouped.items()]


def _bias_multiple(mod: nn.Module, diff: torch.Tensor) -> int | None:
    """k when `diff` is k x the module's (whole) bias, broadcast over the last axis."""
    bias = getattr(mod, "bias", None)
    if not isinstance(bias, torch.Tensor) or sharding.shard_spec(bias) is not None or \
            bias.dim() != 1 or diff.shape[-1:] != bias.shape:
        return None
    b = bias.detach().double()
    d = diff.double().reshape(-1, b.numel())
    k = (d @ b).mean().item() / max((b @ b).item(), 1e-30)
    if round(k) >= 1 and (d - round(k) * b).abs().max().item() <= 1e-3 * d.abs().max().item():
        return round(k)
    return None


def _cause(model: nn.Module, f: Finding, ws: int, diff: torch.Tensor | None) -> str:
    """The likely cause, from the module's metadata and the difference's form."""
    try:
        mod = model.get_submodule(f.path)
    except AttributeError:
        return ""
    meta = module_patch.module_meta(mod)
    layout = meta.get("output_layout")
    if f.what == "input gradient":
        if f.partial:
            return (f"this input's gradient is a partial sum: it equals the original's only "
                    f"summed over the {ws} ranks. The column-parallel region entered here needs "
                    "sync('bwd_post', 'all_reduce') on its entry module.")
        return ""
    k = _bias_multiple(mod, diff) if diff is not None else None
    if k is not None:
        return (f"the output is off by {k} x this module's bias: the bias is added on every "
                "rank before the all-reduce (a callable fwd_post sync or a hook after the "
                "module); sync('fwd_post', 'all_reduce') reduces before adding the bias.")
    if layout is not None and layout[0] == sharding.PARTIAL and not completed_above(
            model, f.path):
        return ("its output is a partial sum (row-parallel shard) and no "
                "sync('fwd_post', 'all_reduce') completes it.")
    if f.partial:
        return (f"its output equals the original's only summed over the {ws} ranks: a partial "
                "sum missing its all-reduce (sync('fwd_post', 'all_reduce')).")
    return ""


def _diff_of(got: Any, ref: Any, f: Finding) -> torch.Tensor | None:
    for g in got.outputs:
        if g.path == f.path and g.key[2] == f.tensor:
            for r in ref.outputs:
                if r.key == g.key and r.value.shape == g.value.shape:
                    return g.value - r.value
            return None
    return None


def format_finding(sch: Schedule, model: nn.Module, f: Finding, ws: int,
                   diff: torch.Tensor | None, experts: list[str] = ()) -> str:
    """The report lines for one finding (`experts`: the diverging experts' lines, when the
    module is an experts module)."""
    where = f.path or "<root>"
    shared = f" (the same tensor is the input of {', '.join(f.receivers)})" if f.receivers \
        else ""
    lines = [f"  {where}: {f.what} differs (max abs {f.err:.1e}){shared}", *experts]
    prims = applied_around(sch, f.path, below=True)
    lines.append("  primitives applied: " + ("; ".join(prims[:10]) if prims else "none here "
                                             "or above (an unscheduled module)"))
    cause = _cause(model, f, ws, diff)
    if cause:
        lines.append(f"  likely cause: {cause}")
    return "\n".join(lines)


def report_text(sch: Schedule, model: nn.Module, gr, rr, finding, ws: int,
                failed: str, experts: list[str] = ()) -> str:
    """The localisation text: the finding, or (none) the owner of the failed tensor; with
    the diverging experts' lines (`slapo.verify.experts`) below the module's."""
    head = "Localisation (both models re-run with module hooks, fp32):"
    if finding is not None:
        diff = _diff_of(gr, rr, finding) if finding.what == "forward output" else None
        return f"{head}\n{format_finding(sch, model, finding, ws, diff, experts)}"
    owner = _owner_of(failed, model)
    lines = [f"{head}\n  no module's forward output or input gradient differs; the mismatch "
             f"arises in {failed or 'the compared tensor'} itself."]
    if owner is not None:
        prims = applied_around(sch, owner)
        lines.append(f"  {owner or '<root>'} owns it; primitives applied: "
                     + ("; ".join(prims[:10]) if prims else "none"))
    return "\n".join([*lines, *experts])


def _owner_of(failed: str, model: nn.Module) -> str | None:
    """The module owning the parameter named in Verify's failed tensor name, if any."""
    for prefix in ("grad ", "param after step "):
        if failed.startswith(prefix):
            name = failed[len(prefix):]
            return name.rpartition(".")[0]
    return None
