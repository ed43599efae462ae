"""`init_mesh`: one DeviceMesh ("dp", "pp", "tp") that every parallelism reads its group from.

Rank layout follows the convention of Megatron and torchtitan: "tp" is innermost (its ranks are
consecutive, so on GPUs they share a node and its fast links), then "pp", then "dp" outermost
(data parallelism tolerates the slowest links). A rank's coordinate is
`(rank // (pp*tp), rank // tp % pp, rank % tp)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import SchedulingError

MESH_DIMS = ("dp", "pp", "tp")
DEFAULT_TIMEOUT_S = 60
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _device_and_backend() -> tuple[str, str]:
    """NCCL on CUDA, gloo on CPU: the only pairs that run every collective we use."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cuda", "nccl"
    return "cpu", "gloo"


def _check_sizes(dp: int, pp: int, tp: int) -> None:
    for name, v in (("dp", dp), ("pp", pp), ("tp", tp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SchedulingError("", f"init_mesh: {name}={v!r} must be a positive int.",
                                  f"pass e.g. {name}=1.")


def _init_process_group(world: int, backend: str, timeout_s: float) -> None:
    """Join the job torchrun (or any launcher setting its env) started; a 1-rank job needs none.

    A short timeout (not torch's 30 min default) turns a rank that died into an error on its
    peers instead of a hang.
    """
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    timeout = timedelta(seconds=timeout_s)
    if missing:
        if world > 1:
            raise SchedulingError(
                "", f"init_mesh asks for {world} ranks, but this process was not launched by "
                f"torchrun (environment variables {', '.join(missing)} are not set).",
                f"launch with `torchrun --nproc-per-node {world} script.py` (or set dp=pp=tp=1 "
                "for a single process).")
        store = dist.HashStore()
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        return
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timeout)


def init_mesh(dp: int = 1, pp: int = 1, tp: int = 1, *,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Return a DeviceMesh of shape (dp, pp, tp) named ("dp", "pp", "tp") over all ranks.

    Initialises torch.distributed from the torchrun environment when it is not initialised yet
    (NCCL + CUDA when a GPU is there, else gloo + CPU; `timeout_s` for every collective). Every
    rank checks the sizes before any communication, so a wrong size fails on all of them at once
    instead of leaving some waiting.
    """
    _check_sizes(dp, pp, tp)
    want = dp * pp * tp
    device, backend = _device_and_backend()
    if not dist.is_initialized():
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if env_world != want and all(k in os.environ for k in _TORCHRUN_ENV):
            raise _size_error(env_world, dp, pp, tp)
        _init_process_group(want, backend, timeout_s)
    else:
        device = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    world = dist.get_world_size()
    if world != want:
        raise _size_error(world, dp, pp, tp)
    return init_device_mesh(device, (dp, pp, tp), mesh_dim_names=MESH_DIMS)


def _size_error(world: int, dp: int, pp: int, tp: int) -> SchedulingError:
    return SchedulingError(
        "", f"init_mesh(dp={dp}, pp={pp}, tp={tp}) needs {dp * pp * tp} ranks, but the job has "
        f"{world}.", f"choose sizes whose product is {world}, or launch {dp * pp * tp} processes "
        f"(`torchrun --nproc-per-node {dp * pp * tp}`).")


@dataclass(frozen=True)
class MeshInfo:
    """Sizes, this rank's coordinates and the per-dimension groups of a mesh.

    Without a mesh, data and pipeline parallelism are off, and "tp" is the schedule's
    tensor-parallel group (a schedule may be sharded over the default group without a mesh).
    """

    mesh: DeviceMesh | None
    dp: int = 1
    pp: int = 1
    tp: int = 1
    dp_rank: int = 0
    pp_rank: int = 0
    tp_rank: int = 0
    tp_group: object = None

    @staticmethod
    def of(mesh: DeviceMesh | None, tp_group=None) -> MeshInfo:
        if mesh is None:
            from ..distributed import group as _g

            return MeshInfo(None, tp=_g.world_size(tp_group), tp_rank=_g.rank(tp_group),
                            tp_group=tp_group)
        names = mesh.mesh_dim_names or ()
        missing = [d for d in MESH_DIMS if d not in names]
        if missing:
            raise SchedulingError("", f"the mesh has dimensions {names}, missing {missing}.",
                                  "create it with slapo.init_mesh(dp=..., pp=..., tp=...).")
        size = {d: mesh.size(names.index(d)) for d in MESH_DIMS}
        coord = {d: mesh.get_local_rank(d) for d in MESH_DIMS}
        return MeshInfo(mesh, size["dp"], size["pp"], size["tp"],
                        coord["dp"], coord["pp"], coord["tp"], mesh.get_group("tp"))

    def group(self, dim: str):
        """The process group of `dim` (None for a dimension of one rank without a mesh)."""
        if self.mesh is None:
            return self.tp_group if dim == "tp" else None
        return self.mesh.get_group(dim)

    def submesh(self, dim: str) -> DeviceMesh | None:
        return self.mesh[dim] if self.mesh is not None else None

    @property
    def device_type(self) -> str:
        return self.mesh.device_type if self.mesh is not None else "cpu"
