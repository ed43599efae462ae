"""Where a scheduled model first diverges from the original: `Verify`'s report on a mismatch.

Both models are re-run (same inputs, seed and loss, in fp32 even under mixed precision: a
schedule bug shows in fp32 too, and fp32 roundoff does not hide it) with module hooks:

- a forward hook records every module's output, in completion order (a module completes after
  its children, so "first" is the innermost module that diverged earliest);
- a forward pre-hook, placed before any hook a `sync` put there, records every module's input
  tensors (one record per tensor object, naming every module that received it), and a tensor
  hook its gradient, in the order backward computes them.

Records are matched by (module path, call number). What is comparable under tensor parallelism:

- an output of the original's shape is compared as it is; if it only matches after summing over
  the ranks it is a *partial sum*, accepted when an ancestor's `sync('fwd_post', 'all_reduce' |
  'reduce_scatter')` completes it, and reported otherwise;
- an output with one axis `tp` times smaller is a *shard*: the ranks' pieces are gathered along
  that axis (in blocks when the module's weight was sharded with `blocks=`, as fused q|k|v) and
  compared;
- an input gradient is compared where the input's forward value is the original's (as it is, or
  gathered); a gradient that only matches summed over the ranks is accepted when the input is
  the output of a Slapo collective (a `bwd_post` all-reduce completes it), and reported
  otherwise (a column-parallel region entered without its backward all-reduce);
- anything else (shapes that no shard explains, a module the original lacks) is skipped, and
  so is everything inside an experts module (HF's loop calls its children once per expert,
  Slapo's expert-parallel module once per (rank, expert): their call numbers do not match).

When the first divergence is an MoE experts module (or the failed tensor is an expert tensor
stacked [E, ...]), `slapo.verify.experts` names the experts that diverge, by global index: its
weights, its forward output attributed to experts through the routing, else its gradients.
With expert parallelism the finding and the text are agreed over the ep group too.

The first diverging forward output is reported; when every output agrees, the first diverging
input gradient in backward order. Every rank takes part in the same collectives and the
verdict uses the maximum over ranks, and the text is rank 0's, so both ranks report the same.
The report names the module's schedule path, the primitives applied to it and its ancestors
(from the schedule's history) and, where the metadata tells, the likely cause.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import module_patch, sharding
from ..distributed import group as _g
from ..schedule import Schedule
from . import experts as _experts
from .report import Finding, completed_above, report_text


def flatten(out: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a (nested) model output."""
    if isinstance(out, torch.Tensor):
        return [(prefix, out)]
    if isinstance(out, dict):
        items = []
        for k, v in out.items():
            items += flatten(v, f"{prefix}.{k}")
        return items
    if isinstance(out, (tuple, list)):
        items = []
        for i, v in enumerate(out):
            items += flatten(v, f"{prefix}[{i}]")
        return items
    return []


@dataclass
class _Rec:
    """One recorded tensor: a module output, or a module input with its gradient."""

    key: tuple
    path: str
    value: torch.Tensor
    receivers: list[str] = field(default_factory=list)
    grad: torch.Tensor | None = None
    synced: bool = False


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _from_collective(t: torch.Tensor) -> bool:
    fwd = getattr(t.grad_fn, "_forward_cls", None)
    return fwd is not None and fwd.__module__.endswith("distributed.collectives")


class _Recorder:
    """Module hooks that record outputs and input gradients of one run (see module doc)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.outputs: list[_Rec] = []
        self.inputs: dict[int, _Rec] = {}
        self.grad_order: list[_Rec] = []
        self.recording = True
        self._count: dict[str, int] = {}
        self._stack: dict[str, list[int]] = {}
        self._handles: list = []
        # experts modules: their calls' arguments (to attribute a divergence to experts); the
        # modules inside them are not recorded (module doc)
        self.experts = {p for p, m in model.named_modules() if _experts.experts_info(m)}
        self.calls: dict[tuple[str, int], tuple[tuple, dict]] = {}

    def _inside_experts(self, path: str) -> bool:
        return any(path.startswith(e + ".") for e in self.experts)

    def __enter__(self) -> _Recorder:
        for path, mod in self.model.named_modules():
            if self._inside_experts(path):
                continue
            self._handles.append(mod.register_forward_pre_hook(
                self._pre(path), prepend=True, with_kwargs=True))
            self._handles.append(mod.register_forward_hook(self._post(path)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()

    def _pre(self, path: str):
        def hook(mod, args, kwargs):
            if not self.recording:
                return
            idx = self._count.get(path, 0)
            self._count[path] = idx + 1
            self._stack.setdefault(path, []).append(idx)
            if path in self.experts:
                self.calls[(path, idx)] = (tuple(_copy(a) for a in args),
                                           {k: _copy(v) for k, v in kwargs.items()})
            named = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
            for name, t in named:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad:
                    self._input(path, idx, name, t)
        return hook

    def _input(self, path: str, idx: int, name: str, t: torch.Tensor) -> None:
        rec = self.inputs.get(id(t))
        if rec is not None and rec.value is not None:
            rec.receivers.append(path)
            return
        rec = _Rec((path, idx, name), path, t.detach().clone(), [path],
                   synced=_from_collective(t))
        self.inputs[id(t)] = rec
        rec._graph = t  # keeps the tensor (and so its id) alive for the run

        def on_grad(g, rec=rec):
            if rec.grad is None:
                self.grad_order.append(rec)
                rec.grad = g.detach().clone()
            else:
                rec.grad = rec.grad + g.detach()
        t.register_hook(on_grad)

    def _post(self, path: str):
        def hook(mod, args, out):
            if not self.recording:
                return
            stack = self._stack.get(path)
            idx = stack.pop() if stack else 0
            for name, t in flatten(out):
                if t.is_floating_point():
                    self.outputs.append(_Rec((path, idx, name), path, t.detach().clone()))
        return hook


# ------------------------------------------------------------------------------------------
# comparing what is comparable
# ------------------------------------------------------------------------------------------

@dataclass
class _Ctx:
    group: Any
    ws: int
    collective: bool  # every rank recorded the same keys and shapes
    rtol: float
    atol: float | None

    def ratio(self, got: torch.Tensor, ref: torch.Tensor, floor: float) -> tuple[float, float]:
        """(max of |got-ref| / (atol + rtol |ref|), max abs error); atol as Verify's."""
        got, ref = got.double(), ref.double()
        if not ref.numel():
            return 0.0, 0.0
        err = (got - ref).abs()
        scale = ref.abs().max().item()
        atol = self.atol if self.atol is not None else max(self.rtol * scale, floor, 1e-30)
        return (err / (atol + self.rtol * ref.abs())).max().item(), err.max().item()

    def shard_axis(self, got: torch.Tensor, ref: torch.Tensor) -> int | None:
        """The one axis along which `got` is a 1/ws piece of `ref`, else None."""
        if got.dim() != ref.dim() or self.ws == 1:
            return None
        diff = [a for a, (g, r) in enumerate(zip(got.shape, ref.shape)) if g != r]
        if len(diff) == 1 and got.shape[diff[0]] * self.ws == ref.shape[diff[0]]:
            return diff[0]
        return None

    def gather(self, t: torch.Tensor, axis: int, blocks: int) -> torch.Tensor:
        pieces = [torch.empty_like(t) for _ in range(self.ws)]
        dist.all_gather(pieces, t.contiguous(), group=self.group)
        return sharding.assemble(pieces, axis, blocks)

    def summed(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=self.group)
        return t

    def rows_max(self, rows: list[list[float]]) -> list[list[float]]:
        """Element-wise maximum over the ranks (one collective), so every rank decides alike."""
        if not rows or not self.collective or self.ws == 1:
            return rows
        t = torch.tensor(rows, dtype=torch.float64)
        t = torch.nan_to_num(t, nan=math.inf)
        device = _device(self.group)
        t = t.to(device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.cpu().tolist()


def _device(group) -> torch.device:
    from ..runtime.mesh import backend_device_type, local_device

    return local_device(backend_device_type(dist.get_backend(group)))


def _blocks(model: nn.Module, path: str) -> int:
    """The `blocks` of the module's sharded weight when its output is partitioned by it."""
    try:
        mod = model.get_submodule(path)
    except AttributeError:
        return 1
    spec = sharding.shard_spec(getattr(mod, "weight", None)) \
        if isinstance(getattr(mod, "weight", None), torch.Tensor) else None
    layout = module_patch.module_meta(mod).get("output_layout")
    if spec is not None and layout is not None and layout[0] == sharding.PARTITION:
        return spec.blocks
    return 1


def _compare(ctx: _Ctx, got: torch.Tensor, ref: torch.Tensor, blocks: int,
             floor: float) -> list[float] | None:
    """[ratio as it is (or gathered), ratio of the sum over ranks, max abs error]; None when
    not comparable. Collectives only depend on shapes, which every rank shares."""
    if got.shape == ref.shape:
        ra, err = ctx.ratio(got, ref, floor)
        rs = ctx.ratio(ctx.summed(got), ref, floor)[0] if ctx.collective and ctx.ws > 1 \
            else math.inf
        return [ra, rs, err]
    axis = ctx.shard_axis(got, ref) if ctx.collective else None
    if axis is None:
        return None
    ra, err = ctx.ratio(ctx.gather(got, axis, blocks), ref, floor)
    return [ra, math.inf, err]


def _floor(recs: list[torch.Tensor]) -> float:
    return 1e-6 * max((r.abs().max().item() for r in recs if r.numel()), default=0.0)


# ------------------------------------------------------------------------------------------
# findings
# ------------------------------------------------------------------------------------------

def forward_divergence(model: nn.Module, got: _Recorder, ref: _Recorder,
                       ctx: _Ctx) -> Finding | None:
    """The first module output (completion order) that differs from the original's."""
    by_key = {r.key: r for r in ref.outputs}
    pairs = [(g, by_key[g.key]) for g in got.outputs if g.key in by_key]
    floor = _floor([r.value for _, r in pairs])
    rows, kept = [], []
    for g, r in pairs:
        row = _compare(ctx, g.value, r.value, _blocks(model, g.path), floor)
        if row is not None:
            rows.append(row)
            kept.append((g, r))
    for (g, _), (ra, rs, err) in zip(kept, ctx.rows_max(rows)):
        if ra <= 1:
            continue
        partial = rs <= 1
        if partial and completed_above(model, g.path):
            continue
        return Finding(g.path, "forward output", err, partial, tensor=g.key[2],
                       call=g.key[1])
    return None


def backward_divergence(got: _Recorder, ref: _Recorder, ctx: _Ctx) -> Finding | None:
    """The first module input gradient (backward order) that differs from the original's."""
    by_key = {r.key: r for r in ref.inputs.values() if r.grad is not None}
    pairs = [(g, by_key[g.key]) for g in got.grad_order if g.key in by_key]
    vfloor = _floor([r.value for _, r in pairs])
    gfloor = _floor([r.grad for _, r in pairs])
    rows, kept = [], []
    for g, r in pairs:
        if g.value.shape != r.value.shape and (g.grad.shape != g.value.shape):
            continue
        val = _compare(ctx, g.value, r.value, 1, vfloor)
        grad = _compare(ctx, g.grad, r.grad, 1, gfloor)
        if val is None or grad is None:
            continue
        rows.append([val[0], *grad])
        kept.append(g)
    for g, (rv, ra, rs, err) in zip(kept, ctx.rows_max(rows)):
        if rv > 1 or ra <= 1:  # not the original's value here (not comparable), or agrees
            continue
        partial = rs <= 1
        if partial and g.synced:
            continue
        primary = max(g.receivers, key=lambda p: p.count(".") + 1 if p else 0)
        return Finding(primary, "input gradient", err, partial,
                       [p for p in g.receivers if p != primary])
    return None


def localise(sch: Schedule, model: nn.Module, ref: nn.Module,
             run: Callable[[nn.Module], Any], backward: Callable[[nn.Module, Any], None] | None,
             rtol: float, atol: float | None, failed: str = "") -> str:
    """Re-run `ref` and `model` with hooks and name the first diverging module (module doc).
    `run(m)` runs a forward as Verify does; `backward(m, out)` its loss backward (None: outputs
    only). `failed` names the tensor Verify flagged, used when no module diverges. Collective:
    every rank of the schedule's group must call it; all get rank 0's text."""
    group = sch.group
    ws = _g.world_size(group)
    groups = _experts.agree_groups(group, model)
    with _Recorder(ref) as rr:
        out = run(ref)
        rr.recording = False
        if backward is not None:
            backward(ref, out)
    with _Recorder(model) as gr:
        out = run(model)
        gr.recording = False
        if backward is not None:
            backward(model, out)
    ctx = _Ctx(group, ws, _same_on_every_rank(gr, group, ws), rtol, atol)
    finding = forward_divergence(model, gr, rr, ctx)
    if finding is None and backward is not None:
        finding = backward_divergence(gr, rr, ctx)
    if _experts.ep_group(model) is not None:  # each ep rank ran its own tokens: one finding
        finding = _experts.agree(finding, groups)
    lines = _expert_lines(model, ref, rr, finding, failed, rtol, atol, groups)
    text = report_text(sch, model, gr, rr, finding, ws, failed, lines)
    return _experts.agree(text, groups)


def _expert_lines(model: nn.Module, ref: nn.Module, rr: _Recorder, finding: Finding | None,
                  failed: str, rtol: float, atol: float | None, groups: list) -> list[str]:
    """The diverging experts (`slapo.verify.experts`) when the finding is an experts module,
    or, with no finding, when the failed tensor is a stacked expert tensor."""
    if finding is not None:
        path, what = finding.path, finding.what
    else:
        for prefix in ("grad ", "param after step "):
            if failed.startswith(prefix):
                path, _, name = failed[len(prefix):].rpartition(".")
                break
        else:
            return []
        try:
            info = _experts.experts_info(model.get_submodule(path))
        except AttributeError:
            return []
        if info is None or name not in info.stacked:
            return []
        what = None
    if path not in rr.experts:
        return []
    call = rr.calls.get((path, finding.call)) if finding is not None else None
    lines = _experts.expert_lines(path, model, ref, what, call, rtol, atol, groups)
    if not lines and failed.startswith("param after step "):
        lines = [f"  every expert's weights and gradient agree with the original's (layer "
                 f"{path}): the difference arises in the optimizer step"]
    return lines


def _same_on_every_rank(rec: _Recorder, group, ws: int) -> bool:
    """Whether every rank recorded the same keys and shapes (collectives are then safe)."""
    if ws == 1:
        return True
    sig = ([(r.key, tuple(r.value.shape)) for r in rec.outputs],
           [(r.key, tuple(r.value.shape), None if r.grad is None else tuple(r.grad.shape))
            for r in rec.grad_order])
    everyone = [None] * ws
    dist.all_gather_object(everyone, sig, group=group)
    return all(s == everyone[0] for s in everyone)
