"""`ParallelDims` and `init_mesh`: the parallel degrees, checked once, and the one DeviceMesh
("dp", "pp", "tp") that every parallelism reads its group from. `MeshInfo` is a rank's view of
that mesh (degrees, its coordinates, the groups).

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


@dataclass(frozen=True)
class ParallelDims:
    """The job's parallel degrees: the one place they are checked and turned into a mesh.

    `dp * pp * tp` is the number of ranks. Every app (`slapo train`, `--progressive`, `slapo
    tune`'s trials, examples) gets its degrees here and its mesh from `init_mesh`, so a degree is
    validated once, with one message, and no app builds groups by hand (torchtitan's
    `ParallelDims` is the model).
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SchedulingError("", f"parallel degree {name}={v!r} must be a positive "
                                      "int.", f"pass e.g. {name}=1.")

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1) -> ParallelDims:
        """The degrees of a job of `world` ranks: `tp` x `pp` as asked, the rest data parallel."""
        cls(tp=tp, pp=pp)  # checks tp and pp
        if world % (tp * pp):
            raise SchedulingError(
                "", f"tp={tp} x pp={pp} = {tp * pp} ranks per model replica does not divide "
                f"the {world} processes of this job.", f"launch a multiple of {tp * pp} "
                f"processes (`torchrun --nproc-per-node {tp * pp} ...`), or change tp / pp.")
        return cls(dp=world // (tp * pp), pp=pp, tp=tp)

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> ParallelDims:
        """The degrees of a mesh made by `init_mesh` (all 1 without a mesh)."""
        return MeshInfo.of(mesh).dims if mesh is not None else cls()

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh shape, in `MESH_DIMS` order (tp innermost)."""
        return (self.dp, self.pp, self.tp)

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x tp={self.tp}"


DEVICES = ("auto", "cpu", "cuda")


def _device_and_backend(device: str = "auto") -> tuple[str, str]:
    """NCCL on CUDA, gloo on CPU: the only pairs that run every collective we use. "auto": CUDA
    when there is a GPU (and NCCL)."""
    if device not in DEVICES:
        raise SchedulingError("", f"init_mesh: unknown device {device!r}.",
                              f"use one of {', '.join(DEVICES)}.")
    cuda = torch.cuda.is_available() and dist.is_nccl_available()
    if device == "cuda" and not cuda:
        raise SchedulingError("", "init_mesh(device='cuda'): no CUDA device (with NCCL) here.",
                              "use device='cpu' or 'auto'.")
    if device == "cuda" or (device == "auto" and cuda):
        return "cuda", "nccl"
    return "cpu", "gloo"


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


def job_world_size() -> int:
    """Ranks of this job: the process group's, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_mesh(dp: int | None = 1, pp: int = 1, tp: int = 1, *,
              dims: ParallelDims | None = None, device: str = "auto",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Return a DeviceMesh of shape (dp, pp, tp) named ("dp", "pp", "tp") over all ranks.

    The one construction site of meshes and process groups. Pass the degrees, or `dims`
    (a `ParallelDims`); `dp=None` takes the data-parallel degree from the job's size (all ranks
    not used by tp x pp). Initialises torch.distributed from the torchrun environment when it
    is not initialised yet (`device`: "auto" = NCCL + CUDA when a GPU is there, else gloo +
    CPU; `timeout_s` for every collective). Every rank checks the sizes before any
    communication, so a wrong size fails on all of them at once instead of leaving some
    waiting.
    """
    if dims is None:
        dims = ParallelDims.for_world(job_world_size(), tp=tp, pp=pp) if dp is None else \
            ParallelDims(dp, pp, tp)
    want = dims.world
    device_type, backend = _device_and_backend(device)
    if not dist.is_initialized():
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if env_world != want and all(k in os.environ for k in _TORCHRUN_ENV):
            raise _size_error(env_world, dims)
        _init_process_group(want, backend, timeout_s)
    else:
        device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    world = dist.get_world_size()
    if world != want:
        raise _size_error(world, dims)
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)


def _size_error(world: int, dims: ParallelDims) -> SchedulingError:
    n = dims.world
    return SchedulingError(
        "", f"init_mesh({dims}) needs {n} ranks, but the job has {world}.",
        f"choose sizes whose product is {world}, or launch {n} processes "
        f"(`torchrun --nproc-per-node {n}`).")


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

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.dp, self.pp, self.tp)

    def submesh(self, dim: str) -> DeviceMesh | None:
        return self.mesh[dim] if self.mesh is not None else None

    @property
    def device_type(self) -> str:
        return self.mesh.device_type if self.mesh is not None else "cpu"
