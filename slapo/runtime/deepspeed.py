"""Optional DeepSpeed target: `build(sch, target="deepspeed", deepspeed_config={...})`.

DeepSpeed is imported only here and only when asked for, so Slapo never depends on it. What
this target covers:
- ZeRO stages 0-3 (and whatever else the config enables, e.g. offload) through
  `deepspeed.initialize`, over the mesh's dp dimension (the whole world when there is no mesh);
- gradient accumulation and clipping are DeepSpeed's (`gradient_accumulation_steps`,
  `gradient_clipping`, filled in from `grad_accum` / `grad_clip` unless the config sets them);
- the same `train_step(batch) -> float` as every other runtime.
Not covered: pipeline parallelism (DeepSpeed's PipelineModule needs a flat layer list) and
tensor parallelism combined with ZeRO (Slapo's TP shards are not registered with DeepSpeed's
model-parallel unit); both raise a SchedulingError.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from .batch import Batch, batch_size, call, check_divisible, slice_batch
from .mesh import MeshInfo
from .train_step import LossFn, StepConfig, compute_loss, reduce_loss


def import_deepspeed():
    """`import deepspeed`, or a SchedulingError saying how to get it."""
    try:
        import deepspeed
    except ImportError as e:
        raise SchedulingError("", f"target='deepspeed' needs the deepspeed package, which does "
                              f"not import here ({e}).",
                              "install it (`DS_BUILD_OPS=0 pip install deepspeed`) or use "
                              "target=None (DDP / FSDP2 / pipeline from torch).") from None
    return deepspeed


def complete_config(base: dict | None, config: StepConfig) -> dict:
    """The user's config completed with what `build` already knows.

    DeepSpeed insists on a batch size at initialisation but only uses it for its own data
    loader and logging; `train_step` splits whatever batch it is given, so 1 is a safe default.
    """
    cfg = dict(base or {})
    cfg.setdefault("gradient_accumulation_steps", config.grad_accum)
    if config.grad_clip is not None:
        cfg.setdefault("gradient_clipping", config.grad_clip)
    cfg.setdefault("zero_optimization", {"stage": 1})
    # our optimizer (e.g. torch.optim.AdamW) is a "client optimizer" to DeepSpeed, which ZeRO
    # refuses unless told that it is intended
    cfg.setdefault("zero_allow_untested_optimizer", True)
    if "train_batch_size" not in cfg:
        cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    return cfg


class DeepSpeedModule(nn.Module):
    """A DeepSpeed engine behind `train_step(batch) -> float`."""

    def __init__(self, engine, info: MeshInfo, config: StepConfig, loss_fn: LossFn | None):
        super().__init__()
        self.engine = engine
        self.info = info
        self.step_config = config
        self.loss_fn = loss_fn

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def local_batch(self, batch: Batch) -> Batch:
        cfg, info = self.step_config, self.info
        check_divisible(batch, {"data-parallel ranks": info.dp if cfg.batch_is_global else 1,
                                "grad_accum": cfg.grad_accum})
        if not cfg.batch_is_global or info.dp == 1:
            return batch
        size = batch_size(batch) // info.dp
        return slice_batch(batch, info.dp_rank * size, (info.dp_rank + 1) * size)

    def train_step(self, batch: Batch) -> float:
        batch = self.local_batch(batch)
        k = self.step_config.grad_accum
        size = batch_size(batch) // k
        total = 0.0
        for i in range(k):  # the engine steps the optimizer at the accumulation boundary
            part = slice_batch(batch, i * size, (i + 1) * size)
            loss = compute_loss(call(self.engine, part), part, self.loss_fn)
            self.engine.backward(loss)
            self.engine.step()
            total += float(loss.detach()) / k
        return reduce_loss(torch.tensor(total), self.info)


def build_deepspeed(sch, info: MeshInfo, config: StepConfig, *, optimizer, optimizer_kwargs,
                    loss_fn, deepspeed_config: dict | None, device, init_weights, seed,
                    data_parallel, pipeline):
    """Hand the scheduled model to `deepspeed.initialize`; returns (module, engine optimizer)."""
    if pipeline is not None or info.pp > 1:
        raise SchedulingError("", "target='deepspeed' does not run Slapo pipelines.",
                              "use target=None for pipeline parallelism.")
    if info.tp > 1:
        raise SchedulingError("", "target='deepspeed' does not combine with Slapo tensor "
                              "parallelism (tp > 1).", "use data_parallel='fsdp' for TP + "
                              "sharded data parallelism.")
    if data_parallel is not None:
        raise SchedulingError("", "target='deepspeed' does its own data parallelism; "
                              f"data_parallel={data_parallel!r} would wrap the model twice.",
                              "leave data_parallel=None and set the ZeRO stage in "
                              "deepspeed_config.")
    ds = import_deepspeed()
    from .build import place_weights

    model = sch.mod
    place_weights(model, device, info, init_weights, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, **(optimizer_kwargs or {})) if optimizer is not None else None
    # With tp = pp = 1 the data-parallel group is the whole world, which is DeepSpeed's default.
    engine, ds_opt, _, _ = ds.initialize(model=model, optimizer=opt, model_parameters=params,
                                         config=complete_config(deepspeed_config, config),
                                         dist_init_required=not dist.is_initialized())
    return DeepSpeedModule(engine, info, config, loss_fn), ds_opt
