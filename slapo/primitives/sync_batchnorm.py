"""`sync_batchnorm`: BatchNorm statistics over the data-parallel ranks (see
`slapo.op.sync_batchnorm` for the computation and why torch's own `nn.SyncBatchNorm` is not
used)."""

from __future__ import annotations

from .. import module_patch
from ..distributed import group as _g
from ..errors import SchedulingError
from ..op.sync_batchnorm import SyncBatchNormKernel, batchnorms
from .base import Primitive, register_primitive


def _resolve_group(sch, group):
    """The group whose ranks' samples make one batch: the given one, else the "dp" dimension
    of the schedule's mesh. Never guessed from the default group: a schedule's default group
    is its tensor-parallel group, whose ranks hold the *same* samples (counted once per rank,
    the running variance's n / (n - 1) is off) and, under channel TP, *different channels* of
    each BatchNorm (summing them would mix channels). Without torch.distributed there is one
    rank and nothing to synchronise."""
    if group is not None:
        return group
    if not _g.is_initialized():
        return None
    mesh = sch.mesh
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    if "dp" in names:
        return mesh.get_group("dp")
    where = f"the schedule's mesh has no 'dp' dimension ({', '.join(names) or 'unnamed'})" \
        if mesh is not None else "the schedule has no mesh"
    raise SchedulingError(sch.path, f"{where}, so the data-parallel ranks are unknown.",
                          "pass group= (e.g. dist.group.WORLD when every rank is a "
                          "data-parallel replica), or create the schedule with "
                          "mesh=slapo.init_mesh(dp=...).")


@register_primitive
class SyncBatchNormPrimitive(Primitive):
    """Every BatchNorm in this module's subtree takes its training statistics over the ranks
    of `group` (default: the "dp" dimension of the schedule's mesh; pass `dist.group.WORLD`
    when every rank is a data-parallel replica), so data parallelism on n ranks normalises as
    one process does on the whole batch (running statistics too). The modules, their
    parameters and buffers stay as they are; eval mode and a group of one rank run the
    original forward. Works on any device and backend (torch's `nn.SyncBatchNorm` needs CUDA).
    """

    name = "sync_batchnorm"

    @classmethod
    def validate(cls, sch, group=None):
        found = batchnorms(sch.mod)
        if not found:
            raise SchedulingError(sch.path, f"{type(sch.mod).__name__} has no BatchNorm in "
                                  "its subtree.", "call sync_batchnorm on a module that "
                                  "contains BatchNorm layers (e.g. the root).")
        taken = [(f"{sch.path}.{p}".strip("."), m) for p, m in found
                 if module_patch.kernel(m) is not None]
        if taken:
            path, m = taken[0]
            raise SchedulingError(sch.path, f"{path or '<root>'} already runs the kernel "
                                  f"{module_patch.kernel(m).name!r} ({len(taken)} BatchNorm(s) "
                                  "do).", "apply sync_batchnorm once, and before any primitive "
                                  "that replaces a BatchNorm's forward.")
        _resolve_group(sch, group)

    @classmethod
    def apply(cls, sch, group=None):
        kernel = SyncBatchNormKernel(_resolve_group(sch, group))
        for _, m in batchnorms(sch.mod):
            module_patch.set_kernel(m, kernel)
