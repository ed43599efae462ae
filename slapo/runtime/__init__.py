"""Runtimes: turn a schedule into something that trains, on one device or a 3-D mesh.

- `init_mesh(dp, pp, tp)`: the DeviceMesh every parallelism reads its group from;
- `build(sch, ...)`: pipeline (torch.distributed.pipelining), data parallel (DDP / FSDP2) and the
  schedule's tensor parallelism composed into a `TrainModule` with `train_step(batch) -> float`.
"""

from .build import build
from .mesh import ParallelDims, init_mesh
from .train_step import TrainModule

__all__ = ["ParallelDims", "TrainModule", "build", "init_mesh"]
