"""Runtimes: turn a schedule into something that trains, on one device or a 3-D mesh.

- `init_mesh(dp, pp, tp)`: the DeviceMesh every parallelism reads its group from;
- `build(sch, ...)`: pipeline (torch.distributed.pipelining), data parallel (DDP / FSDP2) and the
  schedule's tensor parallelism composed into a `Trainer`, attached to the model it returns (a
  `TrainModule` with `train_step(batch) -> float`); `build_trainer(sch, ...)` returns the
  `Trainer` itself.
"""

from .build import build, build_trainer
from .built_model import TrainModule
from .mesh import ParallelDims, init_mesh
from .trainer import Trainer

__all__ = ["ParallelDims", "TrainModule", "Trainer", "build", "build_trainer", "init_mesh"]
