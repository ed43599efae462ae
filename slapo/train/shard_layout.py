"""How a run checkpoint holds tensor-parallel shards, alone and inside FSDP2 shards.

DCP saves a DTensor as the chunk each rank holds of one global tensor, so every TP-sharded
entry of the state dict (parameters and their optimizer moments) is handed to it as a DTensor
of the *full* tensor. A plain TP shard would look like a replica (same name, same shape on every
rank) and DCP would keep one rank's slice.

Layouts, for a tensor of original shape G sharded over T tensor-parallel ranks along `axis`,
in `blocks` equal parts (fused q|k|v: each block sharded on its own, local pieces concatenated):

- **TP only** (the rank holds a plain local tensor): a DTensor over the TP group, `Shard(axis)`;
  with blocks the axis is split into (blocks, rest) first, so the local piece is one box.
- **TP inside FSDP2** (`--dp-shard`: FSDP2 shards the TP-local tensor L along dim k over D
  data-parallel ranks, chunk by chunk as `torch.chunk` does): a DTensor over the (dp, tp) mesh
  of G *reshaped* so that both splits are plain `Shard`s:
  - k is not the TP axis: dp is `Shard(k)` of G (with blocks: of G with the axis split);
  - k is the TP axis, one block: the axis becomes (T, rest), tp `Shard` on T, dp on rest;
  - k is the TP axis, blocks divisible by D: the axis becomes (blocks, T, rest), dp on blocks.
  Every view is a reshape of G, never a permutation, so `slapo export` (and any DCP reader)
  gets G back with `reshape`. torch's `_StridedShard` would express the second case on G
  itself, but it is private and the third case has no DTensor form at all.
  - Otherwise (a fused 1-D bias, blocks not divisible by D) the dp ranks all-gather L (one
    tensor of 1/T of the parameter) and save it like a TP-only shard, replicated over dp (DCP
    writes it once); on load each rank copies back its chunk.

Loading reads into the same DTensors: their local tensors are views of the model's and the
optimizer's own tensors (or, for the gathered case, a buffer copied back), so `restore` hands
`set_state_dict` the values in the layout the model holds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import sharding

__all__ = ["Layout", "shard_specs"]


def shard_specs(model: nn.Module) -> dict[str, sharding.ShardSpec]:
    """{state-dict name: ShardSpec} of every tensor sharded over more than one TP rank (tied
    tensors under every name), and of every expert-parallel parameter (`--ep`: this rank's
    experts, rows of the whole `[E, ...]` tensor over the ep group, `op.moe.expert_shard_spec`).
    Saved as DTensors of the whole tensor like a TP shard, so a checkpoint holds every expert
    once under its global name and offset, whatever the ep: it resumes on any ep (or none) and
    `slapo export` reads it in one process."""
    from ..op.moe import expert_shard_spec

    specs = {}
    for name, t in [*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)]:
        spec = sharding.shard_spec(t) or expert_shard_spec(t)
        if spec is not None and spec.world_size > 1:
            specs[name] = spec
    return specs


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()


def _split_axis(shape: list[int], axis: int, parts: list[int]) -> list[int]:
    return [*shape[:axis], *parts, *shape[axis + 1:]]


def fsdp_view(spec: sharding.ShardSpec, dp_dim: int, dp_size: int
              ) -> tuple[list[int], int, int] | None:
    """(shape of the reshaped full tensor, its tp dim, its dp dim) for a TP shard that FSDP2
    splits along `dp_dim` of the TP-local tensor over `dp_size` ranks; None when no reshape of
    the full tensor makes both splits plain (see the module docstring)."""
    shape, a, b, t = list(spec.orig_shape), spec.axis, spec.blocks, spec.world_size
    if shape[a] % (b * t):
        return None  # uneven TP split: no box per rank
    if dp_dim != a:
        if b == 1:
            return shape, a, dp_dim
        return _split_axis(shape, a, [b, shape[a] // b]), a + 1, dp_dim + (dp_dim > a)
    m = shape[a] // (b * t)
    if b == 1:
        return _split_axis(shape, a, [t, m]), a, a + 1
    if b % dp_size == 0:
        return _split_axis(shape, a, [b, t, m]), a + 1, a
    return None


class Layout:
    """Turns a state dict's TP-sharded entries into DTensors of the full tensor for DCP
    (`to_saved`) and the loaded values back into what the model holds (`restore`).

    A collective when an entry needs the gathered form: every rank converts the same entries
    in the same order (the state dict's), as DCP itself requires."""

    def __init__(self) -> None:
        self._meshes: dict[tuple, Any] = {}
        self._restore: dict[int, Callable[[], torch.Tensor]] = {}

    # ---- meshes ---------------------------------------------------------------------------
    def _tp_mesh(self, spec: sharding.ShardSpec, device: str):
        from torch.distributed.device_mesh import DeviceMesh

        key = ("tp", id(spec.group))
        if key not in self._meshes:
            self._meshes[key] = DeviceMesh.from_group(spec.group or dist.group.WORLD, device)
        return self._meshes[key]

    def _dp_tp_mesh(self, dp_mesh, spec: sharding.ShardSpec, device: str):
        """The 2-D (dp, tp) mesh of this rank's FSDP2 group and TP group. Its rank grid comes
        from the dp peers themselves (each reports its TP group), so it needs no assumption on
        how the job's mesh orders its dimensions."""
        from torch.distributed.device_mesh import DeviceMesh

        dp_group = dp_mesh.get_group()
        tp_group = spec.group or dist.group.WORLD
        key = ("dp_tp", id(dp_group), id(tp_group))
        if key not in self._meshes:
            mine = dist.get_process_group_ranks(tp_group)
            rows: list[list[int] | None] = [None] * dist.get_world_size(dp_group)
            dist.all_gather_object(rows, mine, group=dp_group)
            self._meshes[key] = DeviceMesh.from_group(
                [dp_group, tp_group], device, mesh=torch.tensor(rows),
                mesh_dim_names=("dp", "tp"))
        return self._meshes[key]

    # ---- save -----------------------------------------------------------------------------
    def to_saved(self, value: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
        """The DTensor of the full tensor whose local chunk is `value` (a view of it, or for
        the gathered case a gathered copy); remembers how to restore it."""
        if not _is_dtensor(value):
            saved = self._tp_dtensor(value, spec)
            self._restore[id(saved)] = lambda: _tp_local(saved, spec)
            return saved
        return self._fsdp_saved(value, spec)

    def _tp_dtensor(self, local: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        shape, axis = list(spec.orig_shape), spec.axis
        if spec.blocks > 1:
            shape = _split_axis(shape, axis, [spec.blocks, shape[axis] // spec.blocks])
            local = local.unflatten(axis, (spec.blocks, -1))
            axis += 1
        mesh = self._tp_mesh(spec, local.device.type)
        return DTensor.from_local(local, mesh, [Shard(axis)], run_check=False,
                                  shape=torch.Size(shape), stride=_contiguous_stride(shape))

    def _fsdp_saved(self, value: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Shard

        (placement,) = value.placements  # FSDP2 on a 1-D dp mesh: Shard(k)
        dp_mesh, dp_dim = value.device_mesh, placement.dim
        local = value.to_local()
        view = fsdp_view(spec, dp_dim, dp_mesh.size())
        if view is None:
            return self._gathered(value, spec, dp_dim)
        shape, tp_at, dp_at = view
        tp_local_shape = list(value.shape)  # the TP-local tensor L that FSDP2 shards
        local_shape = list(shape)
        local_shape[tp_at] //= spec.world_size
        local_shape[dp_at] = local.shape[dp_dim] * shape[dp_at] // tp_local_shape[dp_dim]
        mesh = self._dp_tp_mesh(dp_mesh, spec, local.device.type)
        placements = [Shard(dp_at), Shard(tp_at)]
        saved = DTensor.from_local(local.view(local_shape), mesh, placements, run_check=False,
                                   shape=torch.Size(shape), stride=_contiguous_stride(shape))
        self._restore[id(saved)] = lambda: value
        return saved

    def _gathered(self, value: torch.Tensor, spec: sharding.ShardSpec, dp_dim: int
                  ) -> torch.Tensor:
        """The TP-local tensor gathered over dp, saved as a TP-only shard; restore copies this
        rank's FSDP2 chunk back."""
        full = value.full_tensor().detach()  # a fresh all-gather output
        saved = self._tp_dtensor(full, spec)
        mesh = value.device_mesh

        def restore() -> torch.Tensor:
            chunks = torch.chunk(full, mesh.size(), dim=dp_dim)
            rank = mesh.get_local_rank()
            local = value.to_local()
            if rank < len(chunks):
                local.copy_(chunks[rank].reshape(local.shape))
            return value

        self._restore[id(saved)] = restore
        return saved

    # ---- load -----------------------------------------------------------------------------
    def restore(self, saved: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
        """What the model holds for an entry `to_saved` made, with the loaded values."""
        return self._restore[id(saved)]()


def _tp_local(saved: torch.Tensor, spec: sharding.ShardSpec) -> torch.Tensor:
    local = saved.to_local()
    return local.flatten(spec.axis, spec.axis + 1) if spec.blocks > 1 else local


def convert(state: dict[str, Any], specs: dict[str, sharding.ShardSpec],
            fn: Callable[[torch.Tensor, sharding.ShardSpec], torch.Tensor]) -> dict[str, Any]:
    """Apply fn(tensor, spec) to every model entry and optimizer moment of a sharded tensor.

    `state`: {"model": model state dict, "optim": optimizer state dict}, the optimizer's either
    flat (`state.<fqn>.<name>` keys: torch's `flatten_optimizer_state_dict`) or nested
    (`{"state": {fqn: {name: value}}, "param_groups": [...]}`)."""
    def moment(value: Any, spec: sharding.ShardSpec | None) -> Any:
        sharded = spec is not None and isinstance(value, torch.Tensor) and value.dim() > 0
        return fn(value, spec) if sharded else value  # not the scalar `step`

    model_sd = {k: fn(v, specs[k]) if k in specs else v for k, v in state["model"].items()}
    optim = state["optim"]
    if "state" not in optim or not isinstance(optim["state"], dict):  # flat
        out = {}
        for key, value in optim.items():
            fqn = key[len("state."):].rsplit(".", 1)[0] if key.startswith("state.") else None
            out[key] = moment(value, specs.get(fqn)) if fqn is not None else value
        return {"model": model_sd, "optim": out}
    nested = {fqn: {k: moment(v, specs.get(fqn)) for k, v in entry.items()}
              for fqn, entry in optim["state"].items()}
    return {"model": model_sd, "optim": {**optim, "state": nested}}
