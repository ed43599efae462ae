"""Sharded training checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `OUT/checkpoints/step_000010/`:
- DCP files: the model and optimizer state dicts (HF keys; each rank writes its own shards),
- `rng_rank{r}.pt`: every RNG stream of rank r (torch, CUDA, python, numpy, slapo's TP stream),
- `trainer.json`: step, loss history, data-sampler state and the run's config (rank 0).

A checkpoint is written to `step_000010.tmp/` and renamed when every rank has finished, so a
process killed mid-save never leaves a directory that `latest` would pick.

Tensor-parallel parameters are local shards (see `slapo.sharding`), identical in name and shape
on every rank; DCP would take them for replicas and keep one. They are handed to DCP as DTensors
over their TP group, so each rank's shard is saved (and could be resharded on load).
"""

from __future__ import annotations

import contextlib
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from .. import sharding

CHECKPOINTS = "checkpoints"
TRAINER_FILE = "trainer.json"


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step_{step:06d}"


def latest(out: Path) -> Path | None:
    """The complete checkpoint with the highest step in `out`, or None."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_")
            and p.name[5:].isdigit() and (p / TRAINER_FILE).is_file()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that
    is exactly our single-process case, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---- RNG --------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    from ..distributed.rng import get_rng_tracker

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "slapo_tracker": get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from ..distributed.rng import get_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    get_rng_tracker().set_states(state["slapo_tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# ---- TP shards as DTensors --------------------------------------------------------------------
def _shard_specs(model: nn.Module) -> dict[str, sharding.ShardSpec]:
    specs = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),  # tied: every name
                    *model.named_buffers(remove_duplicate=False)]:
        spec = sharding.shard_spec(t)
        if spec is not None and spec.world_size > 1:
            specs[name] = spec
    return specs


def _to_dtensor(local: torch.Tensor, spec: sharding.ShardSpec, meshes: dict) -> torch.Tensor:
    """View a local shard as a DTensor of the full tensor over the TP group. A shard of a fused
    parameter (`blocks` > 1: the local piece is one slice of each block) becomes a regular shard
    after splitting the axis into (blocks, rest)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    key = id(spec.group)
    if key not in meshes:
        device = "cuda" if local.is_cuda else "cpu"
        meshes[key] = DeviceMesh.from_group(spec.group or dist.group.WORLD, device)
    shape, axis = list(spec.orig_shape), spec.axis
    if spec.blocks > 1:
        shape[axis:axis + 1] = [spec.blocks, shape[axis] // spec.blocks]
        local = local.unflatten(axis, (spec.blocks, -1))
        axis += 1
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, meshes[key], [Shard(axis)], run_check=False,
                              shape=torch.Size(shape), stride=stride)


def _from_dtensor(value: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
    local = value.to_local()
    return local.flatten(spec.axis, spec.axis + 1) if spec.blocks > 1 else local


def _wrap(state: dict[str, Any], specs: dict[str, sharding.ShardSpec], fn) -> dict[str, Any]:
    """Apply fn(tensor, spec) to every model entry and optimizer moment of a sharded tensor."""
    model_sd = {k: fn(v, specs[k]) if k in specs else v for k, v in state["model"].items()}
    optim_state = {}
    for fqn, entry in state["optim"].get("state", {}).items():
        spec = specs.get(fqn)
        optim_state[fqn] = {k: fn(v, spec) if spec is not None and isinstance(v, torch.Tensor)
                            and v.dim() > 0 else v for k, v in entry.items()}
    return {"model": model_sd, "optim": {**state["optim"], "state": optim_state}}


# ---- save / load ------------------------------------------------------------------------------
def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict, bool]:
    """{"model", "optim"} state dicts to hand DCP, the shard specs, and whether the model part
    is partial. Only the parameters this rank trains (those in its optimizer) are included: with
    a pipeline, a rank also holds other stages' untrained copies, which must not be saved."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = {name for name, p in model.named_parameters(remove_duplicate=False)
               if id(p) not in owned}
    model_sd = {k: v for k, v in model_sd.items() if k not in foreign}
    specs = _shard_specs(model)
    state = {"model": model_sd, "optim": optim_sd}
    if specs:
        meshes: dict = {}
        state = _wrap(state, specs, lambda t, s: _to_dtensor(t, s, meshes))
    return state, specs, bool(foreign)


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer: dict[str, Any], rank: int) -> None:
    """Collective: every rank calls it. `trainer` (JSON-able) is written by rank 0."""
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)
    _barrier()
    state, _, _ = _state(model, optimizer)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        (tmp / TRAINER_FILE).write_text(json.dumps(trainer))
        if path.exists():
            shutil.rmtree(path)
        tmp.rename(path)
    _barrier()


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
         ) -> dict[str, Any]:
    """Load weights, optimizer state and this rank's RNG streams; return the trainer state."""
    if not (path / TRAINER_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete slapo train checkpoint (no "
                                f"{TRAINER_FILE}); pass a directory like OUT/{CHECKPOINTS}/"
                                "step_000010, or --resume latest.")
    state, specs, partial = _state(model, optimizer)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    if specs:
        state = _wrap(state, specs, _from_dtensor)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=not partial))
    rng_file = path / f"rng_rank{rank}.pt"
    if not rng_file.is_file():
        raise FileNotFoundError(f"{rng_file} is missing: resume with the same number of "
                                "processes that wrote the checkpoint.")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads((path / TRAINER_FILE).read_text())
