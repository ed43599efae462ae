"""Which experts of a mixture-of-experts layer diverge: the part of Verify's localisation
below an experts module, and the expert-parallel (ep) layout Verify compares against.

An *experts module* holds its experts stacked: HF's (`MixtralExperts`, `Qwen3MoeExperts`, ...:
3-D `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I], maybe biases [E, ...]) or Slapo's
`op.moe.ExpertParallelExperts`, which holds rows `[first, first + E/ep)` of those tensors
(`op.moe.expert_shard`) and is called the same way, `experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]`. Every tensor whose first axis is the experts' is compared
expert by expert, under global indices (`first + local index`):

- values: the scheduled rows (gathered over the ep group) against the original's, before the
  run (a loader or schedule that put an expert's weights in the wrong place);
- the forward output, attributed exactly to experts through the routing: the module is called
  again, on both models, with the original's recorded inputs and the routing weights of every
  (token, slot) not routed to expert e set to zero, which leaves e's contribution only (HF's
  loop and Slapo's ep dispatch both multiply each expert's rows by their weight);
- gradients: the scheduled expert gradient, gathered, against the original's summed over the ep
  group (each rank's experts receive the rows, and so the loss gradients, of every rank of the
  group).

Collective: every rank of the agreement groups (`agree_groups`: the schedule's tp group, then
the ep group) calls the same functions with the same module path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import sharding
from ..distributed import group as _g

_MAIN = ("gate_up_proj", "down_proj")
_LISTED = 8  # experts named per line; the rest counted


@dataclass(frozen=True)
class ExpertsInfo:
    """An experts module: its stacked tensors and which global experts this rank holds."""

    num: int  # experts in the whole layer
    first: int  # global index of this rank's first expert
    count: int  # experts held here
    ep: int
    group: Any  # the ep group (None at ep=1)
    stacked: tuple[str, ...]  # direct parameters whose axis 0 is the experts'


def experts_info(mod: nn.Module) -> ExpertsInfo | None:
    """The `ExpertsInfo` of an experts module (module doc), else None."""
    from ..op.moe import expert_shard

    params = dict(mod.named_parameters(recurse=False))
    main = [params[n] for n in _MAIN if n in params and params[n].dim() == 3]
    if not main:
        return None
    count = main[0].shape[0]
    stacked = tuple(n for n, p in params.items() if p.dim() >= 2 and p.shape[0] == count)
    s = expert_shard(main[0])
    if s is None or s.ep == 1:
        return ExpertsInfo(count, 0, count, 1, None, stacked)
    return ExpertsInfo(s.num_experts, s.first, s.count, s.ep, s.group, stacked)


def expert_parallel_spec(p: torch.Tensor) -> sharding.ShardSpec | None:
    """The tensor-parallel spec of `p` if it has one, else its expert-parallel rows as a spec
    (`op.moe.expert_shard_spec`), else None: how to gather `p` (or its gradient) whole."""
    from ..op.moe import expert_shard_spec

    return sharding.shard_spec(p) or expert_shard_spec(p)


def ep_group(model: nn.Module):
    """The ep group of the model's expert-parallel parameters (ep > 1), else None."""
    from ..op.moe import expert_shard

    for p in model.parameters():
        s = expert_shard(p)
        if s is not None and s.ep > 1:
            return s.group
    return None


def agree_groups(tp_group, model: nn.Module) -> list:
    """The groups whose ranks must reach one verdict, in order: the schedule's (tp) group,
    then the ep group of the model's experts (their all-to-alls couple those ranks)."""
    groups = [tp_group] if _g.world_size(tp_group) > 1 else []
    ep = ep_group(model)
    if ep is not None:
        groups.append(ep)
    return groups


def agree(value: Any, groups: Sequence) -> Any:
    """The first non-None value in rank order, over each group in turn (the tp group, then the
    ep group: ep groups take the same tp rank of each member, so the result is one value over
    the whole tp x ep block)."""
    for group in groups:
        everyone = [None] * _g.world_size(group)
        dist.all_gather_object(everyone, value, group=group)
        value = next((v for v in everyone if v is not None), None)
    return value


def sum_expert_grads(model: nn.Module, *refs: nn.Module | None) -> None:
    """For each expert-parallel parameter of `model`, sum the gradient of the same parameter of
    each reference over its ep group, in place: an ep rank's experts get the loss gradients of
    every rank of the group (module doc), which the one-process reference computes per rank."""
    from ..op.moe import expert_shard_spec

    specs = {n: s for n, s in ((n, expert_shard_spec(p)) for n, p in model.named_parameters())
             if s is not None}
    for ref in refs:
        if ref is None or not specs:
            continue
        for name, rp in ref.named_parameters():
            if name in specs and rp.grad is not None:
                dist.all_reduce(rp.grad, group=specs[name].group)


# ------------------------------------------------------------------------------------------
# per-expert comparisons
# ------------------------------------------------------------------------------------------

@dataclass
class Tolerance:
    rtol: float
    atol: float | None

    def per_expert(self, got: torch.Tensor, ref: torch.Tensor) -> list[tuple[float, float]]:
        """(max |got-ref| / (atol + rtol |ref|), max abs error) of each expert's rows (axis 0);
        atol as Verify's (rtol x max|ref| of the whole tensor, at least 1e-6 of it)."""
        got, ref = got.detach().double(), ref.detach().double()
        if got.shape != ref.shape or not ref.numel():
            return []  # not comparable expert by expert
        scale = ref.abs().max().item()
        atol = self.atol if self.atol is not None else max(self.rtol * scale, 1e-6 * scale,
                                                           1e-30)
        err = (got - ref).abs().reshape(ref.shape[0], -1)
        ratio = err / (atol + self.rtol * ref.abs().reshape(ref.shape[0], -1))
        return list(zip(ratio.max(dim=1).values.tolist(), err.max(dim=1).values.tolist(),
                        strict=True))


def _full(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """`t` (the value or gradient of `p`) gathered to the whole [E, ...] tensor."""
    spec = expert_parallel_spec(p)
    return sharding.gather_full(t, spec) if spec is not None else t.detach()


def _diverging(rows: list[tuple[float, float]], groups: Sequence) -> list[tuple[int, float]]:
    """(expert, max abs error) of the experts whose ratio exceeds 1 on any rank."""
    if not rows:
        return []
    t = _max_over(torch.tensor(rows, dtype=torch.float64), groups)
    return [(e, err) for e, (ratio, err) in enumerate(t.tolist()) if not ratio <= 1]


def _max_over(t: torch.Tensor, groups: Sequence) -> torch.Tensor:
    """The element-wise maximum over the ranks of every group (NaN counted as infinite)."""
    t = torch.nan_to_num(t, nan=float("inf"))
    for group in groups:
        t = t.to(_device(group))
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.cpu()


def _who(experts: list[int], num: int) -> str:
    shown = ", ".join(str(e) for e in experts[:_LISTED])
    more = f" and {len(experts) - _LISTED} more" if len(experts) > _LISTED else ""
    return f"expert{'s' if len(experts) > 1 else ''} {shown}{more} of {num}"


def _line(path: str, info: ExpertsInfo, what: str, bad: list[tuple[int, float]],
          detail: str = "") -> str:
    """`  experts 3, 5 of 8 (layer <path>, <what>): max abs 1.2e-02 (expert 3), ...`"""
    held = ""
    if info.ep > 1:
        ranks = sorted({e // info.count for e, _ in bad})
        held = f"; held by ep rank{'s' if len(ranks) > 1 else ''} " + \
            ", ".join(str(r) for r in ranks)
    if len(bad) == 1:
        errs = f"max abs {bad[0][1]:.1e}"
    else:
        errs = "max abs " + ", ".join(f"{err:.1e} (expert {e})" for e, err in bad[:_LISTED])
    return (f"  {_who([e for e, _ in bad], info.num)} (layer {path}, {what}{held}): {errs}"
            f"{detail}")


def value_lines(path: str, mod: nn.Module, ref_mod: nn.Module, info: ExpertsInfo,
                tol: Tolerance, groups: Sequence) -> list[str]:
    """The experts whose stacked weights differ from the original's before the run."""
    lines = []
    for name in info.stacked:
        p, rp = getattr(mod, name), getattr(ref_mod, name, None)
        if rp is None:
            continue
        bad = _diverging(tol.per_expert(_full(p, p), rp), groups)
        if bad:
            lines.append(_line(path, info, name, bad, "; the scheduled weights differ from "
                               "the original's before the run"))
    return lines


def grad_lines(path: str, mod: nn.Module, ref_mod: nn.Module, info: ExpertsInfo,
               tol: Tolerance, groups: Sequence) -> list[str]:
    """The experts whose gradient differs (the original's summed over the ep group)."""
    lines = []
    for name in info.stacked:
        p, rp = getattr(mod, name), getattr(ref_mod, name, None)
        if rp is None or p.grad is None or rp.grad is None:
            continue
        want = rp.grad.detach().clone()
        if info.ep > 1:
            dist.all_reduce(want, group=info.group)
        bad = _diverging(tol.per_expert(_full(p.grad, p), want), groups)
        if bad:
            lines.append(_line(path, info, f"grad {name}", bad))
    return lines


def _routing(args: tuple, kwargs: dict) -> tuple[str | int, str | int] | None:
    """The positions (int: positional, str: keyword) of the routing tensors of an experts
    call: the integer `top_k_index` [T, k] and the float `top_k_weights` of its shape."""
    named = list(enumerate(args)) + list(kwargs.items())
    index = next((k for k, v in named if isinstance(v, torch.Tensor) and v.dim() == 2
                  and not v.is_floating_point() and v.dtype != torch.bool), None)
    if index is None:
        return None
    shape = _get(args, kwargs, index).shape
    weights = next((k for k, v in named if isinstance(v, torch.Tensor) and
                    v.is_floating_point() and v.shape == shape), None)
    return None if weights is None else (index, weights)


def _get(args: tuple, kwargs: dict, key: str | int):
    return args[key] if isinstance(key, int) else kwargs[key]


def _with(args: tuple, kwargs: dict, key: str | int, value) -> tuple[tuple, dict]:
    if isinstance(key, int):
        args = args[:key] + (value,) + args[key + 1:]
    else:
        kwargs = {**kwargs, key: value}
    return args, kwargs


def forward_lines(path: str, mod: nn.Module, ref_mod: nn.Module, info: ExpertsInfo,
                  call: tuple[tuple, dict] | None, tol: Tolerance,
                  groups: Sequence) -> list[str] | None:
    """The experts whose contribution to the output differs, on the original's inputs of the
    diverging call (module doc); None when the call's routing tensors are not recognised."""
    routing = _routing(*call) if call is not None else None
    if routing is None:
        return None
    args, kwargs = call
    index, weights = (_get(args, kwargs, k) for k in routing)
    stats = torch.zeros(info.num, 4, dtype=torch.float64)  # ratio, err, rows differing, routed
    with torch.no_grad():
        scale = ref_mod(*args, **kwargs).detach().double().abs().max().item()
        atol = tol.atol if tol.atol is not None else max(tol.rtol * scale, 1e-6 * scale, 1e-30)
        for e in range(info.num):
            routed = index == e
            a, k = _with(args, kwargs, routing[1], weights * routed.to(weights.dtype))
            got, want = mod(*a, **k).detach().double(), ref_mod(*a, **k).detach().double()
            if got.shape != want.shape:
                return None
            err = (got - want).abs().reshape(got.shape[0], -1)
            ratio = (err / (atol + tol.rtol * want.abs().reshape(got.shape[0], -1))).amax(1)
            stats[e] = torch.tensor([ratio.max().item() if ratio.numel() else 0.0,
                                     err.max().item() if err.numel() else 0.0,
                                     float((ratio > 1).sum()), float(routed.sum())])
    if info.ep > 1:  # token rows: summed over the ep ranks (each ran its own tokens)
        rows = stats[:, 2:].to(_device(info.group))
        dist.all_reduce(rows, group=info.group)
        stats[:, 2:] = rows.cpu()
    stats = _max_over(stats, groups)  # then the maximum over the whole tp x ep block
    bad = [(e, stats[e, 1].item()) for e in range(info.num) if not stats[e, 0] <= 1]
    if not bad:
        return [f"  each expert's output on its own tokens agrees with the original's (layer "
                f"{path}): the combination of the experts' outputs (weights, sum) differs"]
    rows = ", ".join(f"{int(stats[e, 2])} of {int(stats[e, 3])} (expert {e})"
                     if len(bad) > 1 else f"{int(stats[e, 2])} of its {int(stats[e, 3])}"
                     for e, _ in bad[:_LISTED])
    return [_line(path, info, "forward output on its tokens" if len(bad) == 1
                  else "forward output on their tokens", bad, f"; token rows differing: {rows}")]


def _device(group) -> torch.device:
    from ..runtime.mesh import backend_device_type, local_device

    return local_device(backend_device_type(dist.get_backend(group)))


def expert_lines(path: str, model: nn.Module, ref: nn.Module, what: str | None,
                 call: tuple[tuple, dict] | None, rtol: float, atol: float | None,
                 groups: Sequence) -> list[str]:
    """The report lines naming the diverging experts of the experts module at `path`: its
    weights (when they differ already), the forward output attributed to experts (`what` is
    "forward output"), else each stacked tensor's gradient. Collective (module doc)."""
    try:
        mod, ref_mod = model.get_submodule(path), ref.get_submodule(path)
    except AttributeError:
        return []
    info = experts_info(mod)
    if info is None:
        return []
    tol = Tolerance(rtol, atol)
    lines = value_lines(path, mod, ref_mod, info, tol, groups)
    fwd = forward_lines(path, mod, ref_mod, info, call, tol, groups) \
        if what == "forward output" else None
    if fwd is not None:
        return fwd + lines
    return grad_lines(path, mod, ref_mod, info, tol, groups) + lines
