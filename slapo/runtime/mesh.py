"""The placement: `ParallelDims` (the job's parallel degrees and device, checked once) and the
one DeviceMesh every parallelism reads its group from (`init_mesh`). `MeshInfo` is one rank's
view of that mesh (degrees, its coordinates, the groups).

**One placement object.** `slapo train` (`train/setup.py`) makes one `ParallelDims` per run,
from `--tp`, `--pp-stages`, `--dp-shard`, `--device` and the job's size (`for_world`), and
everything downstream reads its degrees from it or from the mesh it built: `model_schedule.apply`
shards over the mesh's "tp" group (`Schedule.tp_size`), `slapo.build` pipelines over "pp" and
wraps DDP / FSDP2 over "dp". A degree is validated by `check_degree` (a positive int) and
`for_world` (the ranks divide), nowhere else. torchtitan's `ParallelDims` is the model.

**The degrees** (torchtitan's names): `dp_replicate` x `dp_shard` x `cp` x `tp` x `pp` ranks make
the job; `ep` (experts) borrows ranks from the others and adds none.

- `dp_replicate`: data-parallel replicas that each hold the whole model (or stage): what DDP
  runs over (`build(data_parallel="ddp")`).
- `dp_shard`: data-parallel ranks that shard weights, gradients and optimizer state: what FSDP2
  runs over (`build(data_parallel="fsdp")`, `slapo train --dp-shard`).
  Today one of the two is 1 (HSDP, both > 1, is refused): `dp = dp_replicate * dp_shard` is the
  mesh's one "dp" dimension, and whether its ranks replicate or shard is the placement's
  `data_parallel` ("ddp" or "fsdp"). A mesh alone does not say which: `ParallelDims.of(mesh)`
  reports its "dp" ranks as `dp_replicate`.
- `cp`: context (sequence) parallelism: each of `cp` ranks holds 1/cp of every sequence
  (zig-zag chunks) from the embedding to the loss, and attention crosses them
  (`op/context_parallel.py`). Its own mesh dimension, "cp", between "pp" and "tp"
  (torchtitan's). Parameters are **replicated over cp** (cp ranks compute different tokens of
  the same samples), so gradients are averaged over `dp x cp` ranks: `init_mesh` keeps that
  flattened ("dp_cp") view with the mesh, DDP runs over it, and the step's token count and
  loss are reduced over it. With tp, pp, FSDP2 (over dp x cp) and ep (experts averaged over
  dp_rest x cp).
- `ep`: expert parallelism (MoE): each of `ep` ranks holds `E / ep` of every MoE layer's
  experts and tokens travel to their experts by all-to-all. It **borrows the data-parallel
  ranks** (torchtitan borrows dp_shard x cp): `ep` divides `dp`, so `dp_rest x ep x pp x tp`
  is the world with `dp = dp_rest * ep`; ep ranks see different tokens, which is what lets
  the all-to-all carry real work (ranks holding the same tokens, as tp ranks do, would
  only duplicate it). An ep group is `ep` consecutive dp ranks (nearest links after tp's);
  `dp_rest` groups the ranks that hold the same experts. With FSDP2 (dp_shard > 1) the rest
  of the model is sharded over dp and the experts stay ep's; with pipelines an ep group is
  the dp ranks of one stage (and tp index).
- `tp`, `pp`: tensor and pipeline parallelism.

**Mesh layout.** Dimensions `("dp", "pp", "tp")`, outermost first (Megatron's and torchtitan's
convention: "tp" innermost, so its consecutive ranks share a node and its fast links; data
parallelism outermost, since it tolerates the slowest links). A rank's coordinate is
`(rank // (pp*tp), rank // tp % pp, rank % tp)`. With cp > 1 a "cp" dimension sits between
"pp" and "tp" (`ParallelDims.mesh_dims`; `MeshInfo.of` reads `cp`, `cp_rank`, `group("cp")`
and `group("dp_cp")`); `mesh["dp"]`, `mesh["pp"]` and `mesh["tp"]` always exist. With ep > 1 the mesh keeps these dimensions and `init_mesh` also unflattens "dp" into
("dp_rest", "ep") (torch's `DeviceMesh._unflatten`, the same ranks), kept with the mesh and read
by `MeshInfo.of` (`ep`, `ep_rank`, `group("ep")`, `group("dp_rest")`): a mesh without ep is
unchanged.

**The device** is decided in one function, `local_device` ("auto": the backend of an existing
process group, NCCL meaning CUDA, else CUDA when there is a GPU; "cuda" is this rank's current
CUDA device). **The job's size** is read in one function, `job_world_size` (the process group
once it exists, else torchrun's WORLD_SIZE, else 1). **The pipeline schedules** and how many
stages each runs per rank are declared here once (`PP_SCHEDULES`, `stages_per_rank`): they
decide how many stages the model is cut into.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import SchedulingError

MESH_DIMS = ("dp", "pp", "tp")  # the dimensions every mesh has (cp joins them when > 1)
DEFAULT_TIMEOUT_S = 60
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
DEVICES = ("auto", "cpu", "cuda")
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
# Degrees that are fields but not yet implemented: > 1 is refused, naming what will bring them.
_EP_MESH = "_slapo_ep_mesh"  # the ("dp_rest", "ep", "pp", "tp") view `init_mesh` keeps on a mesh
_DP_CP_MESH = "_slapo_dp_cp_mesh"  # the flattened ("dp_cp",) view `init_mesh` keeps with cp > 1
# with ep > 1 and cp > 1: the flattened ("dp_rest_cp",) view, the ranks holding the same experts
_EXPERT_REPLICA_MESH = "_slapo_expert_replica_mesh"

# torch.distributed.pipelining's schedules, by the names `slapo.build(pipeline=...)` and
# `slapo train --pp-schedule` take. The multi-stage ones run 2 stages per rank by default
# (torch's PipelineScheduleMulti), the V ones exactly 2, placed V-shaped.
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
               "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def stages_per_rank(schedule: str | None) -> int:
    """Stages each pp rank runs by default under `schedule` (None: no pipeline, 1): the model
    is cut into `pp * stages_per_rank(schedule)` stages."""
    return 2 if schedule in MULTI_STAGE else 1


def check_degree(name: str, value: Any) -> int:
    """The one check of a parallel degree's value (`ParallelDims` fields, and the `tp` /
    `pp_stages` knobs of `model_schedule.apply`): a positive int. Returns it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SchedulingError("", f"{name} must be a positive int (a parallel degree), got "
                              f"{value!r}.", f"pass e.g. {name}=1.")
    return value


def job_world_size() -> int:
    """Ranks of this job, read here only: the process group's size once it exists (it is the
    truth the collectives run on), else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_device(device: Any) -> str:
    """The one check of a device request (`--device`, `init_mesh(device=)`)."""
    if device not in DEVICES:
        raise SchedulingError("", f"unknown device {device!r}.", f"use one of {', '.join(DEVICES)}.")
    return device


def backend_device_type(backend: str) -> str:
    """The device type a process-group backend runs on: NCCL on CUDA, everything else CPU."""
    return "cuda" if "nccl" in str(backend) else "cpu"


def device_type(device: str = "auto") -> str:
    """Where this rank computes, for a `--device` / `init_mesh(device=)` value: "cpu", "cuda",
    or "auto" (an existing process group's backend decides; without one, CUDA when there is a
    GPU). The one decision; `local_device` makes the torch device from it."""
    check_device(device)
    if device != "auto":
        return device
    if dist.is_available() and dist.is_initialized():
        return backend_device_type(dist.get_backend())
    nccl = not dist.is_available() or dist.is_nccl_available()
    return "cuda" if torch.cuda.is_available() and nccl else "cpu"


def local_device(device: str = "auto") -> torch.device:
    """This rank's torch device: `device_type(device)`, with CUDA's current device index (set
    from LOCAL_RANK by `init_mesh`). Every runtime piece that needs "the device" asks here."""
    kind = device_type(device)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


@dataclass(frozen=True)
class ParallelDims:
    """The placement: the job's parallel degrees and its device, checked once (module docstring).

    `dp_replicate * dp_shard * cp * tp * pp` is the number of ranks (`world`); `dp` is
    `dp_replicate * dp_shard`, the mesh's "dp" dimension. `device`: "auto", "cpu" or "cuda"
    (`local_device()` resolves it). Every app (`slapo train`, `--progressive`, `slapo tune`'s
    trials, examples) gets its degrees here and its mesh from `init_mesh`, so a degree is
    validated once, with one message, and no app builds groups by hand.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in DEGREES:
            check_degree(name, getattr(self, name))
        self._check_ep()
        if self.dp_replicate > 1 and self.dp_shard > 1:
            raise SchedulingError("", f"dp_replicate={self.dp_replicate} x dp_shard="
                                  f"{self.dp_shard}: hybrid sharded data parallelism (HSDP) is "
                                  "not supported yet.", "replicate (DDP) or shard (FSDP2) over "
                                  "all data-parallel ranks.")
        check_device(self.device)

    def _check_ep(self) -> None:
        """ep borrows data-parallel ranks (module docstring): it must divide dp, and the
        combinations not built yet are refused by name."""
        if self.ep == 1:
            return
        if self.dp % self.ep:
            raise SchedulingError("", f"ep={self.ep} expert-parallel ranks are borrowed from the "
                                  f"data-parallel ranks, and ep does not divide dp={self.dp}.",
                                  f"launch dp x pp x tp ranks with dp a multiple of {self.ep} "
                                  "(e.g. `torchrun --nproc-per-node "
                                  f"{self.ep * self.pp * self.tp * self.cp}`), or change ep.")

    @classmethod
    def for_world(cls, world: int, *, tp: int = 1, pp: int = 1, dp_shard: bool = False,
                  ep: int = 1, cp: int = 1, device: str = "auto") -> ParallelDims:
        """The placement of a job of `world` ranks: `cp` x `tp` x `pp` as asked, the rest data
        parallel (sharded, FSDP2, with `dp_shard`; else replicated, DDP), of which `ep`
        consecutive ranks form each expert-parallel group."""
        cls(tp=tp, pp=pp, cp=cp)  # checks tp, pp and cp
        per = cp * tp * pp
        if world % per:
            raise SchedulingError(
                "", f"cp={cp} x tp={tp} x pp={pp} = {per} ranks per model replica does not "
                f"divide the {world} processes of this job.", f"launch a multiple of {per} "
                f"processes (`torchrun --nproc-per-node {per} ...`), or change cp / tp / pp.")
        dp = world // per
        return cls(dp_replicate=1 if dp_shard else dp, dp_shard=dp if dp_shard else 1,
                   cp=cp, tp=tp, pp=pp, ep=ep, device=device)

    @classmethod
    def of(cls, mesh: DeviceMesh | None) -> ParallelDims:
        """The degrees of a mesh made by `init_mesh` (all 1 without a mesh)."""
        return MeshInfo.of(mesh).dims if mesh is not None else cls()

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the mesh's "dp" dimension (`dp_replicate * dp_shard`)."""
        return self.dp_replicate * self.dp_shard

    @property
    def data_parallel(self) -> str | None:
        """What runs over the "dp" ranks: "fsdp" (dp_shard > 1), "ddp" (dp_replicate > 1), or
        None (one data-parallel rank): `slapo.build(data_parallel=...)`."""
        if self.dp_shard > 1:
            return "fsdp"
        return "ddp" if self.dp_replicate * self.cp > 1 else None  # cp ranks average too

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        """The mesh's dimension names, outermost first ("cp" only when cp > 1)."""
        return ("dp", "pp", *(("cp",) if self.cp > 1 else ()), "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh shape, in `mesh_dims` order (tp innermost)."""
        size = {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}
        return tuple(size[d] for d in self.mesh_dims)

    def stages(self, schedule: str | None) -> int:
        """Pipeline stages the model is cut into under `schedule` (1 without a pipeline)."""
        return self.pp * stages_per_rank(schedule) if schedule is not None else 1

    def local_device(self) -> torch.device:
        """This rank's torch device (`local_device(self.device)`)."""
        return local_device(self.device)

    @property
    def dp_rest(self) -> int:
        """Data-parallel ranks holding the same experts (`dp / ep`; `dp` without ep)."""
        return self.dp // self.ep

    def __str__(self) -> str:
        ep = f" (ep={self.ep} of dp)" if self.ep > 1 else ""
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        return f"dp={self.dp}{ep} x pp={self.pp}{cp} x tp={self.tp}"


def _device_and_backend(device: str = "auto") -> tuple[str, str]:
    """NCCL on CUDA, gloo on CPU: the only pairs that run every collective we use (the device
    as `device_type` decides it)."""
    kind = device_type(device)
    if kind == "cuda" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise SchedulingError("", "init_mesh(device='cuda'): no CUDA device (with NCCL) here.",
                              "use device='cpu' or 'auto'.")
    return kind, "nccl" if kind == "cuda" else "gloo"


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


def init_mesh(dp: int | None = 1, pp: int = 1, tp: int = 1, *,
              dims: ParallelDims | None = None, device: str = "auto",
              timeout_s: float = DEFAULT_TIMEOUT_S) -> DeviceMesh:
    """Return a DeviceMesh of shape (dp, pp, tp) named ("dp", "pp", "tp") over all ranks.

    The one construction site of meshes and process groups (each layout's mesh made once per
    process and default group: `_MeshCache`). Pass the degrees, or `dims` (a `ParallelDims`,
    the placement, which carries its own device); `dp=None` takes the data-parallel degree
    from the job's size (all ranks not used by tp x pp). Initialises torch.distributed from the torchrun environment when it
    is not initialised yet (`device`: "auto" = NCCL + CUDA when a GPU is there, else gloo +
    CPU; `timeout_s` for every collective). Every rank checks the sizes before any
    communication, so a wrong size fails on all of them at once instead of leaving some
    waiting.
    """
    if dims is not None and device not in ("auto", dims.device):
        raise SchedulingError("", f"init_mesh(dims=..., device={device!r}): the placement's "
                              f"device is {dims.device!r}.", "give the device in the "
                              "ParallelDims (device=...), not to init_mesh.")
    if dims is None:
        dims = ParallelDims.for_world(job_world_size(), tp=tp, pp=pp, device=device) \
            if dp is None else ParallelDims(dp_replicate=dp, pp=pp, tp=tp, device=device)
    want = dims.world
    kind, backend = _device_and_backend(dims.device)
    if not dist.is_initialized():
        env_world = int(os.environ.get("WORLD_SIZE", "1"))
        if env_world != want and all(k in os.environ for k in _TORCHRUN_ENV):
            raise _size_error(env_world, dims)
        _init_process_group(want, backend, timeout_s)
    else:
        kind = backend_device_type(dist.get_backend())
    world = dist.get_world_size()
    if world != want:
        raise _size_error(world, dims)
    return _MESHES.mesh((kind, dims.shape, dims.mesh_dims, dims.ep, dims.cp),
                        lambda: _new_mesh(kind, dims))


@dataclass
class _MeshCache:
    """The meshes made in this process under its current default group, by layout. DeviceMesh
    makes new process groups at every call and gloo never frees a group's threads, so each
    `slapo train` in one process (the test pool, in-process tune trials) leaked 6 threads: the
    pool hit its thread limit and restarted every ~50 runs. A new default group (the old one
    destroyed) starts an empty cache."""

    group: object = None
    meshes: dict = field(default_factory=dict)

    def mesh(self, layout: tuple, make) -> DeviceMesh:
        group = dist.distributed_c10d._get_default_group()
        if group is not self.group:
            self.group, self.meshes = group, {}
        if layout not in self.meshes:
            self.meshes[layout] = make()
        return self.meshes[layout]


_MESHES = _MeshCache()


def _new_mesh(kind: str, dims: ParallelDims) -> DeviceMesh:
    mesh = init_device_mesh(kind, dims.shape, mesh_dim_names=dims.mesh_dims)
    if dims.ep > 1:  # the same ranks, "dp" seen as ("dp_rest", "ep"): kept with the mesh
        # by index: torch 2.11's _unflatten refuses every dimension given by name (`in` for
        # `not in`; right in 2.13)
        dp = dims.mesh_dims.index("dp")
        ep_mesh = mesh._unflatten(dp, (dims.dp_rest, dims.ep), ("dp_rest", "ep"))
        setattr(mesh, _EP_MESH, ep_mesh)
        if dims.cp > 1:  # the cp ranks hold the same experts too
            setattr(mesh, _EXPERT_REPLICA_MESH, ep_mesh["dp_rest", "cp"]._flatten("dp_rest_cp"))
    if dims.cp > 1:  # the ranks that average gradients (parameters are replicated over cp)
        setattr(mesh, _DP_CP_MESH, mesh["dp", "cp"]._flatten("dp_cp"))
    return mesh


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
    ep: int = 1  # expert-parallel ranks (a division of "dp"; see the module docstring)
    ep_rank: int = 0
    cp: int = 1  # context-parallel ranks (their own "cp" dimension)
    cp_rank: int = 0

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
        ep_mesh = getattr(mesh, _EP_MESH, None)
        ep = (ep_mesh["ep"].size(), ep_mesh.get_local_rank("ep")) if ep_mesh else (1, 0)
        cp = (mesh["cp"].size(), mesh.get_local_rank("cp")) if "cp" in names else (1, 0)
        return MeshInfo(mesh, size["dp"], size["pp"], size["tp"],
                        coord["dp"], coord["pp"], coord["tp"], mesh.get_group("tp"), *ep, *cp)

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters and averaging their gradients (`dp x cp`): the
        step's loss and token count are reduced over them (`group("dp_cp")`)."""
        return self.dp * self.cp

    def expert_replica_group(self):
        """The ranks holding the same experts (their gradients are averaged over them):
        "dp_rest", or the flattened ("dp_rest", "cp") view with cp > 1."""
        if self.cp == 1:
            return self.group("dp_rest")
        return getattr(self.mesh, _EXPERT_REPLICA_MESH).get_group()

    @property
    def expert_replicas(self) -> int:
        """How many ranks hold the same experts: dp / ep x cp."""
        return self.dp // self.ep * self.cp

    def replica_group(self):
        """The process group of the `replicas` ("dp", or "dp_cp" with cp > 1)."""
        return self.group("dp_cp" if self.cp > 1 else "dp")

    def group(self, dim: str):
        """The process group of `dim` (None for a dimension of one rank without a mesh);
        "ep" and "dp_rest" exist on a mesh `init_mesh` made with ep > 1, "cp" and "dp_cp"
        with cp > 1."""
        if self.mesh is None:
            return self.tp_group if dim == "tp" else None
        if dim == "dp_cp":
            flat = getattr(self.mesh, _DP_CP_MESH, None)
            if flat is None:
                raise SchedulingError("", "the mesh has no 'dp_cp' view (cp=1).",
                                      "create it with slapo.init_mesh(dims=ParallelDims("
                                      "..., cp=N)).")
            return flat.get_group()
        if dim in ("ep", "dp_rest"):
            ep_mesh = getattr(self.mesh, _EP_MESH, None)
            if ep_mesh is None:
                raise SchedulingError("", f"the mesh has no {dim!r} dimension (ep=1).",
                                      "create it with slapo.init_mesh(dims=ParallelDims("
                                      "..., ep=N)).")
            return ep_mesh.get_group(dim)
        return self.mesh.get_group(dim)

    @property
    def dims(self) -> ParallelDims:
        """The mesh's degrees; its "dp" ranks count as `dp_replicate` (a mesh does not say
        whether they replicate or shard: `build(data_parallel=)` does)."""
        return ParallelDims(dp_replicate=self.dp, cp=self.cp, pp=self.pp, tp=self.tp,
                            ep=self.ep, device=self.device_type)

    def submesh(self, dim: str) -> DeviceMesh | None:
        return self.mesh[dim] if self.mesh is not None else None

    def replica_submesh(self) -> DeviceMesh | None:
        """The mesh of the `replicas` (FSDP2 shards over it): "dp", or the flattened
        ("dp_cp",) view with cp > 1."""
        if self.mesh is None or self.cp == 1:
            return self.submesh("dp")
        return getattr(self.mesh, _DP_CP_MESH)

    @property
    def device_type(self) -> str:
        return self.mesh.device_type if self.mesh is not None else "cpu"

    @property
    def device(self) -> torch.device:
        """This rank's torch device on the mesh (`local_device` of its device type; CPU
        without a mesh)."""
        return local_device(self.device_type)
