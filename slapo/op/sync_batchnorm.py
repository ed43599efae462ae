"""BatchNorm statistics over the ranks of a process group, on any device and backend.

Data parallelism splits the batch: each rank's BatchNorm normalises its own samples, so with a
small per-rank batch the statistics are noisy and the model trains as at that batch, not the
global one. Synchronised BatchNorm takes the mean and variance over every rank's samples, so
DDP/FSDP2 on n ranks computes what one process computes on the whole batch.

torch's `nn.SyncBatchNorm` does this on CUDA only (its forward refuses CPU tensors), so a
CPU/gloo job, and every test here, could not use it. `SyncBatchNormKernel` is installed on the
existing BatchNorm modules by the `sync_batchnorm` primitive: same objects, classes, parameters
and buffers (state_dict keys, optimizer state, the `checkpoint` primitive's BN guard all stay
valid). In training mode over more than one rank it computes, in fp32 (fp64 for a double
model):

    mean = all_reduce(sum x) / N,  var = all_reduce(sum (x - mean)^2) / N   (N: every rank's
    elements per channel; two passes, no E[x^2] - mean^2 cancellation),

normalises with them, and updates the running statistics with the unbiased variance, as
`nn.BatchNorm` does on the whole batch (a BatchNorm without running statistics uses batch
statistics in eval mode too: synchronised there as well). The all-reduces are
differentiable (an all-reduce's adjoint is an all-reduce), so each rank's input gradient gets
every rank's share of the statistics' gradient; with the data-parallel gradient average the
step is the whole batch's.
In eval mode with running statistics, or over one rank, the module's own forward runs
unchanged.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed import collectives
from ..distributed import group as _g
from ..module_patch import Kernel, original_class


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group's ranks, forward and (the adjoint) backward."""
    return collectives.reduce_forward(collectives.reduce_backward(t, group), group)


class SyncBatchNormKernel(Kernel):
    """The forward of a `nn.modules.batchnorm._BatchNorm` with statistics over `group`."""

    name = "sync_batchnorm"

    def __init__(self, group):
        self.group = group

    def __call__(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        batch_stats = module.training or module.running_mean is None  # as nn.BatchNorm decides
        if not batch_stats or _g.world_size(self.group) == 1:
            return original_class(module).forward(module, x)
        module._check_input_dim(x)
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        shape = [1, channels] + [1] * (x.dim() - 2)
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 under half/bf16, fp64 kept
        xf = x.to(dtype)
        # one all-reduce of [per-channel sums, element count]. A separate all-reduce of the
        # count (a tensor made inside the call, no input) hung both ranks in a checkpointed
        # block under torch.compile (torch 2.13, aot_eager; eager and uncheckpointed were fine)
        local = torch.cat([xf.sum(dims), xf.new_full((1,), x.numel() // channels)])
        summed = _all_reduce_sum(local, self.group)
        count = summed[-1:].detach()
        mean = summed[:-1] / count
        centered = xf - mean.view(shape)
        var = _all_reduce_sum(centered.square().sum(dims), self.group) / count
        y = centered * torch.rsqrt(var + module.eps).view(shape)
        if module.affine:
            y = y * module.weight.to(dtype).view(shape) + module.bias.to(dtype).view(shape)
        if module.training and module.track_running_stats:
            _update_running_stats(module, mean.detach(), var.detach(), count)
        return y.to(x.dtype)


def _update_running_stats(module: nn.Module, mean: torch.Tensor, var: torch.Tensor,
                          count: torch.Tensor) -> None:
    """As `nn.BatchNorm` in training mode: momentum (or the cumulative average when momentum
    is None) over the batch mean and the *unbiased* batch variance."""
    with torch.no_grad():
        module.num_batches_tracked.add_(1)
        factor = (1.0 / float(module.num_batches_tracked) if module.momentum is None
                  else module.momentum)
        unbiased = var * count / (count - 1).clamp(min=1)
        module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype),
                                                  alpha=factor)
        module.running_var.mul_(1 - factor).add_(unbiased.to(module.running_var.dtype),
                                                 alpha=factor)


def batchnorms(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path relative to `module`, BatchNorm) for every BatchNorm in the subtree."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


__all__ = ["SyncBatchNormKernel", "batchnorms"]
