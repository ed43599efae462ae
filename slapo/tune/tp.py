"""Per-rank tensor-parallel shards of a block, built in one process.

The cost model needs "what does *one rank* of a tp-way Megatron-sharded block save and compute".
That is exactly the block whose column-parallel weights (q/k/v, fc1) keep 1/tp of their output
features and whose row-parallel weights (attention out, fc2) keep 1/tp of their input features:
the attention then runs on heads/tp heads, the MLP on intermediate/tp features, and the row-
parallel output is a full-size partial sum (its all-reduce happens in place and saves nothing).
So we build that block directly — no process group — and capture it like any other module.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..errors import SchedulingError

# Submodule -> how it is sharded. "col3": a fused q/k/v projection sharded per q, k and v part.
TP_PLANS: dict[str, dict[str, str]] = {
    "GPT2Block": {"attn.c_attn": "col3", "attn.c_proj": "row", "mlp.c_fc": "col", "mlp.c_proj": "row"},
    "BertLayer": {
        "attention.self.query": "col", "attention.self.key": "col", "attention.self.value": "col",
        "attention.output.dense": "row", "intermediate.dense": "col", "output.dense": "row",
    },
}
# Integer attributes that count per-rank heads/features and must be divided too.
TP_ATTRS: dict[str, list[str]] = {
    "GPT2Block": ["attn.split_size", "attn.num_heads"],
    "BertLayer": ["attention.self.num_attention_heads", "attention.self.all_head_size"],
}


def _narrow(w: torch.Tensor, dim: int, tp: int, rank: int, parts: int = 1) -> torch.Tensor:
    size = w.shape[dim]
    if size % (tp * parts):
        raise ValueError(f"dimension {dim} of size {size} is not divisible by tp*{parts}={tp * parts}")
    if parts == 1:
        return w.narrow(dim, rank * size // tp, size // tp).clone()
    chunks = w.chunk(parts, dim)
    return torch.cat([c.narrow(dim, rank * c.shape[dim] // tp, c.shape[dim] // tp) for c in chunks], dim)


def _shard_linear(mod: nn.Module, kind: str, tp: int, rank: int, path: str) -> None:
    parts = 3 if kind == "col3" else 1
    col = kind in ("col", "col3")
    if isinstance(mod, nn.Linear):  # weight (out, in)
        wdim, attr = (0, "out_features") if col else (1, "in_features")
    elif type(mod).__name__ == "Conv1D":  # HF Conv1D: weight (in, out)
        wdim, attr = (1, "nf") if col else (0, "nx")
    else:
        raise SchedulingError(path, f"cannot shard a {type(mod).__name__} for TP.",
                              "shard only nn.Linear or HF Conv1D submodules.")
    try:
        mod.weight = nn.Parameter(_narrow(mod.weight.data, wdim, tp, rank, parts),
                                  mod.weight.requires_grad)
        if col and getattr(mod, "bias", None) is not None:
            mod.bias = nn.Parameter(_narrow(mod.bias.data, 0, tp, rank, parts), mod.bias.requires_grad)
    except ValueError as e:
        raise SchedulingError(path, f"cannot split for tp={tp}: {e}.", "use a tp that divides it.") from None
    setattr(mod, attr, getattr(mod, attr) // tp)


def shard_for_tp(module: nn.Module, tp: int, rank: int = 0, plan: dict[str, str] | None = None,
                 attrs: list[str] | None = None) -> nn.Module:
    """A copy of ``module`` holding rank ``rank``'s shard of a ``tp``-way Megatron split.

    ``plan`` maps submodule paths to "col", "row" or "col3"; ``attrs`` lists integer attributes
    (head counts, split sizes) to divide by ``tp``. Built-in plans cover HF ``GPT2Block`` and
    ``BertLayer``. Raises :class:`SchedulingError` for unknown blocks or indivisible sizes.
    """
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}.")
    name = type(module).__name__
    plan = plan if plan is not None else TP_PLANS.get(name)
    attrs = attrs if attrs is not None else TP_ATTRS.get(name, [])
    if plan is None:
        raise SchedulingError("", f"no tensor-parallel plan for {name}.",
                              f"pass plan={{'path.to.linear': 'col'|'row'|'col3', ...}}; known: {sorted(TP_PLANS)}.")
    out = copy.deepcopy(module)
    if tp == 1:
        return out
    for path, kind in plan.items():
        if kind not in ("col", "row", "col3"):
            raise ValueError(f"plan entry {path!r}: kind {kind!r} must be 'col', 'row' or 'col3'.")
        try:
            sub = out.get_submodule(path)
        except AttributeError:
            raise SchedulingError(path, f"{name} has no submodule {path!r}.", "fix the TP plan.") from None
        _shard_linear(sub, kind, tp, rank, path)
    for a in attrs:
        owner_path, _, field = a.rpartition(".")
        owner = out.get_submodule(owner_path) if owner_path else out
        val = getattr(owner, field)
        if val % tp:
            raise SchedulingError(a, f"{field}={val} is not divisible by tp={tp}.", "choose a tp that divides it.")
        setattr(owner, field, val // tp)
    return out
