"""All-to-all with uneven splits, as an autograd function: expert parallelism's dispatch and
combine (`slapo.op.moe`).

Each rank sends `send[j]` rows of `x` (dim 0, in rank order) to rank `j` and receives
`recv[j]` rows from it; the backward is the same exchange reversed (the gradient of a row goes
back to the rank that sent it). The row counts are exchanged first (`exchange_counts`), so a
rank only says how many rows it sends and every rank learns what it receives. Built on
`torch.distributed.all_to_all_single`, which gloo (CPU) and NCCL (GPU) both run with uneven
splits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange_counts(send: torch.Tensor, group) -> torch.Tensor:
    """Rows each rank of `group` sends here, given the rows this rank sends to each of them
    (`send`: an int64 tensor of the group's size)."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv,
                           input_split_sizes=send, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Send `send[j]` rows of `x` to rank `j` of `group`, receive `recv[j]` from it (module
    docstring); differentiable (integer tensors pass without autograd)."""
    if not x.requires_grad:
        return _exchange(x, send, recv, group)
    return _AllToAll.apply(x, send, recv, group)


# torch 2.11's dynamo (aot_eager and inductor alike) traces `_AllToAll` inside a compiled block
# and loses its gradient: the forward writes its output in place (`all_to_all_single` into
# `out`), the bug docs/runtime.md's torch-versions table records for the loss Functions. The
# experts' gradients came out zero under ep=2 with compiled blocks (the first loss right;
# tests/test_moe_compose.py). Below 2.13 the exchange runs eagerly between the compiled pieces
# (the counts' `.tolist()` breaks the graph there already); 2.13 traces it right.
if torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
    all_to_all = torch.compiler.disable(all_to_all)
