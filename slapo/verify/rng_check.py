"""Verify's RNG placement check: dropout masks per rank inside sharded regions, shared outside.

An elementwise comparison cannot judge dropout under tensor parallelism: the original draws one
mask over all heads, each rank draws its own over its heads, and neither equals the original's.
What must hold is the *placement* rule (Megatron's, the 2023 Slapo's):

- a random op whose input differs across the tensor-parallel ranks (a shard: heads, features or
  sequence positions) must draw *different* numbers on each rank (`fork_rng`), or every rank's
  shard gets the same mask (heads 0-1 on rank 0 and 2-3 on rank 1 dropped alike);
- a random op whose input is identical on every rank (a replicated activation, e.g. residual
  dropout after the all-reduce) must draw the *same* numbers, or the replicated activation
  silently diverges across ranks.

The check runs the scheduled model once in training mode (no gradients) under a
`TorchFunctionMode` that sees every `dropout`-family call and `scaled_dot_product_attention` with
`dropout_p > 0`, and records, per call, the innermost module running, a fingerprint of the
input (shape, sum of squares, position-weighted sum) and a hash of the generator state the
numbers come from (CPU, or the input's CUDA device). The ranks' records are gathered and
compared call by call; every rank reaches the same verdict from the same gathered data. Ops
with p = 0 draw nothing and are ignored; a model without random ops passes trivially. Only the
first misplaced op is reported: after it the activations differ across ranks, so later ops
would be flagged as its consequences.

Limits: a partial sum (row-parallel output before its all-reduce) differs across ranks but must
share the mask; no built-in schedule drops out a partial sum, and the check would flag it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import module_patch
from ..distributed import group as _g
from ..primitives.fork_rng import ForkRNGWrapper
from ..schedule import Schedule
from .report import applied_around

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
             F.feature_alpha_dropout, torch.dropout}


@dataclass(frozen=True)
class Site:
    """One random op call on one rank."""

    path: str
    op: str
    p: float
    shape: tuple
    sums: tuple[float, float]
    rng: str


def _prob(func, args: tuple, kwargs: dict) -> float:
    """The op's drop probability (0 when it draws nothing)."""
    if func is F.scaled_dot_product_attention:
        p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
        return float(p or 0.0)
    if func in _DROPOUTS:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        training = args[2] if len(args) > 2 else kwargs.get("training", kwargs.get("train", True))
        return float(p) if training else 0.0
    return 0.0


def _rng_hash(x: torch.Tensor) -> str:
    state = torch.cuda.get_rng_state(x.device) if x.device.type == "cuda" \
        else torch.get_rng_state()
    return hashlib.sha1(state.cpu().numpy().tobytes()).hexdigest()[:16]


def _fingerprint(x: torch.Tensor) -> tuple[float, float]:
    """(sum of squares, position-weighted sum): equal on two ranks only for equal tensors in
    practice. Not the plain sum: softmax probabilities sum to the row count on every rank."""
    v = x.double().flatten()
    w = torch.arange(v.numel(), dtype=torch.float64, device=v.device) % 7 + 1
    return (v * v).sum().item(), (v * w).sum().item()


class _Sites(TorchFunctionMode):
    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack, self.sites = stack, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        p = _prob(func, args, kwargs)
        if p > 0 and args and isinstance(args[0], torch.Tensor):
            x = args[0].detach()
            self.sites.append(Site(self.stack[-1] if self.stack else "",
                                   getattr(func, "__name__", str(func)), p, tuple(x.shape),
                                   _fingerprint(x), _rng_hash(x)))
        return func(*args, **kwargs)


def record_sites(model: nn.Module, run) -> list[Site]:
    """Run `run(model)` in training mode without gradients; the random ops it calls."""
    stack: list[str] = []

    def pop(m, a, o) -> None:  # returns None: a forward hook's value would replace the output
        if stack:
            stack.pop()

    handles = []
    for path, mod in model.named_modules():
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, path=path: stack.append(path)))
        handles.append(mod.register_forward_hook(pop))
    mode = model.training
    model.train()
    try:
        with torch.no_grad(), _Sites(stack) as sites:
            run(model)
    finally:
        model.train(mode)
        for h in handles:
            h.remove()
    return sites.sites


def _same_input(a: Site, b: Site) -> bool:
    if a.shape != b.shape:
        return False
    return all(abs(x - y) <= 1e-9 * max(abs(x), abs(y), 1e-30) for x, y in zip(a.sums, b.sums))


def _forked_at(model: nn.Module, path: str) -> str | None:
    """The module at or above `path` whose `fork_rng` puts this op in the per-rank stream."""
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        p = ".".join(parts[:i])
        try:
            mod = model.get_submodule(p)
        except AttributeError:
            continue
        if any(isinstance(w, ForkRNGWrapper) for w in module_patch.wrappers(mod)):
            return p
    return None


def problems(sch: Schedule, model: nn.Module, per_rank: list[list[Site]]) -> list[str]:
    """The report lines of every misplaced random op (empty: placement is right)."""
    first = per_rank[0]
    if any(len(s) != len(first) for s in per_rank):
        return ["  the ranks called different numbers of random ops "
                f"({[len(s) for s in per_rank]}): their control flow differs."]
    out = []
    for i, site in enumerate(first):
        peers = [s[i] for s in per_rank]
        same_input = all(_same_input(site, s) for s in peers)
        same_rng = all(s.rng == site.rng for s in peers)
        if same_input != same_rng:
            out.append(_line(sch, model, site, same_input))
    return out


def _line(sch: Schedule, model: nn.Module, site: Site, replicated: bool) -> str:
    where = site.path or "<root>"
    prims = "; ".join(applied_around(sch, site.path)[:8]) or "none"
    if replicated:
        fork = _forked_at(model, site.path)
        return (f"  {where}: {site.op}(p={site.p:g}) draws different numbers on the tensor-"
                "parallel ranks, but its input is replicated (identical on every rank): the "
                f"replicated activation diverges across ranks. fork_rng() at {fork or '?'} "
                "puts it in the per-rank stream; apply fork_rng only to sharded regions (e.g. "
                f"the attention core). Primitives applied: {prims}")
    return (f"  {where}: {site.op}(p={site.p:g}) draws the same mask on every tensor-parallel "
            "rank, but its input is sharded (differs per rank: different heads, features or "
            "tokens), so the ranks' shards are dropped alike. Missing fork_rng(): apply it to "
            f"this module or the sharded region around it. Primitives applied: {prims}")


def check_rng(sch: Schedule, model: nn.Module, run) -> str | None:
    """Collective over the schedule's group: None when every random op is placed right, else
    the report (the same text on every rank)."""
    group = sch.group
    ws = _g.world_size(group)
    if ws == 1:
        return None
    sites = record_sites(model, run)
    per_rank = [None] * ws
    dist.all_gather_object(per_rank, sites, group=group)
    lines = problems(sch, model, per_rank)
    if not lines:
        return None
    # only the first: a misplaced op makes the activations after it differ across ranks, so
    # later ops are flagged as its consequences
    more = f" ({len(lines) - 1} later call(s) flagged too, as consequences)" if len(lines) > 1 \
        else ""
    head = (f"random ops misplaced under tensor parallelism, first of {len(per_rank[0])} calls "
            f"checked in training mode{more}:")
    return "\n".join([head, lines[0]])
