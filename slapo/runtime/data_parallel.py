"""Data parallelism over the mesh's "dp" dimension: DDP, or FSDP2 (`fully_shard`, ZeRO-3 style).

Both wrap whatever module they are given: the whole model, or one pipeline stage. Tensor-parallel
parameters are plain local shards (see `slapo.sharding`), so to DDP and FSDP2 they are ordinary
tensors: each TP rank data-parallelises its own shard with the ranks holding the same shard,
which is exactly the dp group of the mesh. FSDP2 thus shards the TP shard further along dim 0
(a 2-D dp x tp layout) without knowing about TP. Its new DTensor parameters get the TP shard
specs of the ones they replace, so checkpoints and consolidation still see the TP layout.

FSDP2 changes the module's class in place; DDP returns a wrapper, which `build` keeps in the
step's runner (`LocalRunner.ddp`), never as a child of the model it returns, so the model's
parameter names and state-dict keys stay its own (see `slapo.runtime.built_model`).

Expert-parallel parameters (`op.moe.ExpertParallelExperts`, ep borrowing the dp ranks) are not
replicas: each ep rank holds other experts, so DDP skips them, FSDP2 leaves them unsharded
(`ignored_params`: they are already split over ep, and torchtitan's further dp_shard split of
experts is not built) and `ExpertGradMean` averages them (see there) under both. No data
parallelism and DeepSpeed with expert-parallel parameters are refused by `check_experts`;
gradient clipping counts each expert once: `train_step.clip_grad_norm`.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import sharding
from ..errors import SchedulingError
from ..module_patch import original_class
from .mesh import MeshInfo

DATA_PARALLEL = ("ddp", "fsdp")


def check_data_parallel(kind: str | None, info: MeshInfo) -> None:
    if kind is not None and kind not in DATA_PARALLEL:
        raise SchedulingError("", f"data_parallel={kind!r} is not supported.",
                              f"use None or one of {DATA_PARALLEL}.")
    if kind is not None and info.mesh is None:
        raise SchedulingError("", f"data_parallel={kind!r} needs a device mesh.",
                              "create the schedule with mesh=slapo.init_mesh(dp=...).")


def fsdp_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (see `_block_list`), outermost first.

    Each becomes one FSDP unit, so only one block's full parameters exist at a time; this is the
    per-transformer-layer wrapping torchtitan uses, found without naming the model's attributes.
    Nested lists (a block's own ModuleList) are left to their enclosing unit.
    """
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for mod in model.modules():
        if id(mod) in inside or not _block_list(mod):
            continue
        for sub in mod:
            if _holds_parameters(sub):
                blocks.append(sub)
                inside.update(id(m) for m in sub.modules())
    return blocks


def _block_list(mod: nn.Module) -> bool:
    """A ModuleList (HF's layers), or an nn.Sequential of blocks: its parameter-holding
    children all of one class, each itself made of modules (a ResNet stage `layer1` =
    Bottleneck, Bottleneck, ...; a stage of a single block counts too). Without the second kind
    a CNN had one FSDP unit, the root, so every weight was gathered at once (no memory saved in
    the forward). A Sequential of layers (a downsample's conv + BN, an MLP's Linear, ReLU,
    Linear) is not a list of blocks."""
    if isinstance(mod, nn.ModuleList):
        return True
    if not isinstance(mod, nn.Sequential):
        return False
    held = [m for m in mod if _holds_parameters(m)]
    return bool(held) and len({original_class(m) for m in held}) == 1 and all(
        any(True for _ in m.children()) for m in held)  # checkpointed blocks still match


def _holds_parameters(mod: nn.Module) -> bool:
    return any(True for _ in mod.parameters())


def apply_fsdp(model: nn.Module, info: MeshInfo, *, reshard_after_forward: bool | int = True,
               mp_policy=None) -> nn.Module:
    """`fully_shard` each block, then the root (which takes the remaining parameters).

    `reshard_after_forward=True` frees each block's gathered parameters after its forward and
    gathers them again for backward (ZeRO-3); False keeps them until backward (ZeRO-2-like:
    less communication, more memory). The root is never resharded after forward, since backward
    starts with it.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dp_mesh = info.replica_submesh()  # dp, or dp x cp: cp ranks hold the same parameters
    kwargs = {"mesh": dp_mesh, "mp_policy": mp_policy or MixedPrecisionPolicy()}
    experts = _expert_params(model)
    if experts:  # ep's, not FSDP2's: left whole on this rank, averaged by their own hook
        kwargs["ignored_params"] = {p for _, p in experts}
        _EXPERT_MEANS[model] = ExpertGradMean([p for _, p in experts], info)
    before = _parameters(model)
    for block in fsdp_blocks(model):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)
    for (mod, name), old in before.items():  # FSDP2's new DTensor parameters keep TP specs
        new = mod._parameters.get(name)
        if new is not None and new is not old:
            sharding.copy_records(old, new)
    return model


def _parameters(model: nn.Module) -> dict[tuple[nn.Module, str], nn.Parameter]:
    return {(mod, name): p for mod in model.modules() for name, p in mod._parameters.items()
            if p is not None}


def _expert_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    from ..op.moe import expert_shard

    return [(n, p) for n, p in model.named_parameters()
            if (s := expert_shard(p)) is not None and s.ep > 1]


def check_experts(model: nn.Module, kind: str | None, target: str | None) -> None:
    """Expert-parallel parameters train under DDP only (module docstring); checked before
    `build` changes anything. (Gradient clipping sums their squared norms over the ep group:
    `train_step.clip_grad_norm`.)"""
    experts = _expert_params(model)
    if not experts:
        return
    name = experts[0][0]
    if target is not None or kind not in DATA_PARALLEL:
        how = f"target={target!r}" if target is not None else f"data_parallel={kind!r}"
        raise SchedulingError(name, f"expert-parallel parameters with {how}: expert "
                              "parallelism borrows the data-parallel ranks and averages its "
                              "experts' gradients beside DDP or FSDP2; the other combinations "
                              "are not supported yet.",
                              "build with data_parallel='ddp' or 'fsdp'.")


class ExpertGradMean:
    """Makes each expert-parallel gradient the one a single process computes on the global
    batch, with one bucketed all-reduce per optimizer step.

    An expert's gradient already sums the losses of its whole ep group (the all-to-all's
    backward brings every token's gradient to its expert): S_i for ep group i, where one
    process has G = sum_i S_i / dp. So each backward scales the incoming gradient by 1/ep
    (local, no communication), and the backward DDP synchronises (not those under `no_sync`,
    i.e. the last micro-batch of gradient accumulation) ends with one all-reduce *mean* of the
    accumulated gradients over "dp_rest" (the dp/ep ranks holding the same experts; with cp,
    "dp_rest" x "cp": the cp ranks hold them too, each ep group's S_i then the sum over its
    ranks' chunks): mean_i(S_i / ep) = G. A mean, like DDP's, so re-averaging a part already averaged (a user
    loop that synchronises several backwards before a step) leaves it unchanged.

    Why not a per-parameter all-reduce in the gradient hook: that ran one unbucketed,
    synchronous collective per expert tensor on every micro-batch."""

    def __init__(self, params: list[nn.Parameter], info: MeshInfo):
        self.params = params
        self.ep, self.group = info.ep, info.expert_replica_group()
        self.replicas = info.expert_replicas  # ranks holding the same experts (x cp)
        self.ddp = None  # set by apply_ddp once the wrapper exists: its no_sync flag
        self.sync = True  # FSDP2's flag, set with its own (`set_expert_sync`)
        self._queued_for = None  # the backward (graph task) whose end reduces
        for p in params:
            old = _EXPERT_HOOKS.pop(p, None)
            if old is not None:
                old.remove()
            _EXPERT_HOOKS[p] = p.register_hook(self._scale)

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        syncing = self.sync if self.ddp is None else self.ddp.require_backward_grad_sync
        if self.replicas > 1 and syncing:
            task = torch._C._current_graph_task_id()
            if task != self._queued_for:  # first expert gradient of this backward
                self._queued_for = task
                torch.autograd.Variable._execution_engine.queue_callback(self.reduce)
        return grad / self.ep

    def reduce(self) -> None:
        """All-reduce mean of the accumulated expert gradients, in one flat bucket."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        self._queued_for = None
        for p in self.params:
            if p.grad is None:  # a rank whose experts got no gradient still joins the sum
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat /= self.replicas
        for g, mean in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(mean)


# the gradient hook of each expert parameter (a second `build` replaces it, never adds one)
_EXPERT_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# an FSDP2 model's ExpertGradMean, whose sync flag follows FSDP2's (`set_expert_sync`)
_EXPERT_MEANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_expert_sync(model: nn.Module, sync: bool) -> None:
    """Under FSDP2, whether this backward reduces the experts too: set with FSDP2's own
    `set_requires_gradient_sync` (gradient accumulation reduces on the last slice only)."""
    mean = _EXPERT_MEANS.get(model)
    if mean is not None:
        mean.sync = sync


def apply_ddp(model: nn.Module, info: MeshInfo) -> nn.Module:
    """Wrap in DistributedDataParallel over the dp group (dp x cp with context parallelism:
    cp ranks hold the same parameters; gradients averaged in buckets);
    expert-parallel parameters are left out and averaged by their own hook (module
    docstring)."""
    from torch.nn.parallel import DistributedDataParallel

    if not any(p.requires_grad for p in model.parameters()):
        return model  # nothing to synchronise; DDP refuses such modules
    experts = _expert_params(model)
    if experts:
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored + [n for n, _ in experts])
        mean = ExpertGradMean([p for _, p in experts], info)
    device_ids = None
    if info.device_type == "cuda":
        device_ids = [next(model.parameters()).device.index]
    ddp = DistributedDataParallel(model, process_group=info.replica_group(),
                                  device_ids=device_ids)
    if experts:
        mean.ddp = ddp
    return ddp


def apply_data_parallel(model: nn.Module, kind: str | None, info: MeshInfo, *,
                        reshard_after_forward: bool | int = True, mp_policy=None) -> nn.Module:
    """Apply `kind` ("ddp", "fsdp" or None) over the dp dimension; a no-op when dp == 1 and DDP.

    `mp_policy`: FSDP2's MixedPrecisionPolicy (`Precision.fsdp_policy()`); DDP needs none (it
    all-reduces the fp32 gradients of the fp32 parameters; autocast lives in the forward)."""
    if kind is None:
        return model
    if kind == "ddp":
        return apply_ddp(model, info)
    return apply_fsdp(model, info, reshard_after_forward=reshard_after_forward,
                      mp_policy=mp_policy)
