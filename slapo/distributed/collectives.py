"""Collectives as autograd functions with the right backward (Megatron's f/g operator pairs).

| op             | forward                          | backward                              |
|----------------|----------------------------------|---------------------------------------|
| reduce_backward| identity ("f", copy to TP region)| all-reduce                            |
| reduce_forward | all-reduce ("g")                 | identity                              |
| all_gather     | all-gather along `dim`           | reduce-scatter (partial grads) or     |
|                |                                  | split (replicated grads)              |
| reduce_scatter | reduce-scatter along `dim`       | all-gather                            |
| scatter        | keep this rank's chunk           | all-gather                            |

The bodies use `torch.distributed._functional_collectives`, which torch.compile can trace. With a
world of one rank every op is the identity (but still a distinct autograd node where it matters).

On a `group.VirtualGroup` (the cost model's one rank of a tensor-parallel group, in one process)
no data moves and no autograd node is added: all-reduces are the identity, an all-gather repeats
this rank's piece `size` times and a reduce-scatter/scatter keeps this rank's chunk. Shapes, and
so the activations autograd saves and the FLOPs that follow, are one real rank's; values are not
the model's (the cost model counts, it does not compute).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import group as _g


def _ws(group) -> int:
    return _g.world_size(group)


def _grp(group):
    return group if group is not None else dist.group.WORLD


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", _grp(group)))


# torch 2.13 names these `*_single` (and deprecates `all_gather_tensor` /
# `reduce_scatter_tensor`); torch 2.11, the GPU image's, has only the older names.
_GATHER = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_SCATTER = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Gather along dim 0 and put the pieces along `dim` here, as funcol does inside for
    another dim: torch 2.11's dynamo will not trace funcol's helper for that
    (`_maybe_view_chunk_cat`, marked skipped), a graph break at every sequence-parallel gather."""
    out = funcol.wait_tensor(_GATHER(x.contiguous(), 0, _grp(group)))
    return out if dim == 0 else torch.cat(out.chunk(_ws(group), 0), dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return funcol.wait_tensor(_SCATTER(x.contiguous(), "sum", dim, _grp(group)))


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(_ws(group), dim=dim)[_g.rank(group)].contiguous()


class _ReduceBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group, partial_grad):
        ctx.dim, ctx.group, ctx.partial_grad = dim, group, partial_grad
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.partial_grad:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


def _norm_dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim()


def _virtual_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The gathered shape without the other ranks: this rank's piece, `size` times."""
    return torch.cat([x] * group.size, dim=dim)


def _virtual_chunk(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def reduce_backward(x: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron's f)."""
    if _ws(group) == 1 or _g.is_virtual(group):
        return x
    return _ReduceBackward.apply(x, group)


def reduce_forward(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward (Megatron's g)."""
    if _ws(group) == 1 or _g.is_virtual(group):
        return x
    return _ReduceForward.apply(x, group)


def all_gather(x: torch.Tensor, dim: int, group=None, partial_grad: bool = False) -> torch.Tensor:
    """All-gather along `dim`.

    `partial_grad=True` when each rank holds only a partial gradient of the gathered tensor (the
    gathered activation feeds a sharded computation, as in sequence parallelism): the backward is
    a reduce-scatter. `False` when every rank computes the same full gradient (the gathered
    tensor feeds replicated computation): the backward just keeps this rank's slice.
    """
    if _ws(group) == 1:
        return x
    if _g.is_virtual(group):
        return _virtual_gather(x, dim, group)
    return _AllGather.apply(x, _norm_dim(x, dim), group, partial_grad)


def reduce_scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Reduce-scatter (sum) along `dim`; backward all-gathers."""
    if _ws(group) == 1:
        return x
    if _g.is_virtual(group):
        return _virtual_chunk(x, dim, group)
    return _ReduceScatter.apply(x, _norm_dim(x, dim), group)


def scatter(x: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Keep this rank's chunk along `dim`; backward all-gathers."""
    if _ws(group) == 1:
        return x
    if _g.is_virtual(group):
        return _virtual_chunk(x, dim, group)
    return _Scatter.apply(x, _norm_dim(x, dim), group)
