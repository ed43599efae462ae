"""`build`: turn a schedule into a model (and optimizer) ready to train, on any parallelism.

The composition order is torchtitan's, each concern one function applied in visible order:

    check arguments (every rank, before any communication)
    -> [pipeline] split into stages from the cuts, keep this rank's
    -> materialise delayed-init weights (only what this rank keeps) / move to the device
    -> [mixed precision] fp8: FP8 GEMMs in the selected linears (after TP sharding);
       autocast per stage forward (pipelines); Precision for the step
    -> data parallel (DDP or FSDP2, with FSDP2's MixedPrecisionPolicy) per model or stage
    -> optimizer over what this rank holds
    -> [pipeline] PipelineStage + schedule
    -> the `Trainer` (`build_trainer`), attached to the user's module (`train_step(batch)`;
       see `built_model.attach`), or with a pipeline held by a `PipelineTrainModule` of this
       rank's stages

Tensor parallelism is already in the schedule (its primitives ran on the mesh's tp group).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..distributed.group import guard_gloo_exit
from ..errors import SchedulingError
from ..init import has_meta_tensors, materialize
from ..schedule import Schedule
from . import pipeline_stages as _stages
from .built_model import OwnForward, PipelineTrainModule, attach, check_trainable, detach
from .context_parallel import check_context_parallel, check_scheduled_for_cp, position_rule
from .data_parallel import apply_data_parallel, check_data_parallel, check_experts
from .fp8 import Float8Config
from .mesh import MeshInfo
from .optimizer_offload import check_optimizer_offload, make_offloaded
from .peft_wrapper import peft_inner_path
from .pipeline_guards import make_stages
from .pipeline_plan import make_schedule
from .pipeline_runner import PipelineRunner
from .pipeline_stages import PipelineStages
from .pipeline_tied import find_tied
from .precision import (
    Precision,
    PrecisionName,
    check_autocast,
    check_fp8_config,
    check_precision,
    module_device_type,
)
from .runner import LocalRunner, LossFn
from .shape_errors import name_shape_errors
from .token_mean import ModelLoss
from .train_step import StepConfig, norm_weight_table, norm_weights
from .trainer import Trainer

TARGETS = (None, "deepspeed")


# ------------------------------------------------------------------------------------------------
# argument checks (identical on every rank, so a bad call fails everywhere and hangs nowhere)
# ------------------------------------------------------------------------------------------------

def _check_schedule(sch) -> None:
    if not isinstance(sch, Schedule):
        raise SchedulingError("", f"build expects a Schedule, got {type(sch).__name__}.",
                              "pass the object returned by slapo.create_schedule(model).")


def _check_optimizer(sch: Schedule, optimizer) -> None:
    if optimizer is not None and not callable(optimizer):
        raise SchedulingError(sch.path, f"optimizer must be a class or callable, got "
                              f"{optimizer!r}.", "pass e.g. torch.optim.AdamW.")


def _check_init_weights(sch: Schedule, init_weights) -> None:
    """`init_weights` is a function (or None for the model's own init); a bool is Slapo 2023's
    spelling, which only the public `slapo.build` translates."""
    if init_weights is not None and (isinstance(init_weights, bool) or not callable(init_weights)):
        raise SchedulingError(sch.path, f"init_weights must be a function or None, got "
                              f"{init_weights!r}.", "pass fn(module[, path]), or None for the "
                              "model's own init (slapo.build also takes 2023's True/False).")


def _check_step_args(grad_accum: int, grad_clip: float | None, target: str | None) -> None:
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise SchedulingError("", f"grad_accum={grad_accum!r} must be a positive int.",
                              "pass e.g. grad_accum=1.")
    if grad_clip is not None and not (isinstance(grad_clip, (int, float)) and grad_clip > 0):
        raise SchedulingError("", f"grad_clip={grad_clip!r} must be a positive number or None.")
    if target not in TARGETS:
        raise SchedulingError("", f"target={target!r} is not supported.",
                              f"use one of {TARGETS}.")


def mesh_info(sch: Schedule, mesh) -> MeshInfo:
    """The mesh to run on (`mesh`, else the schedule's), checked against the schedule's TP group."""
    mesh = mesh if mesh is not None else sch.mesh
    info = MeshInfo.of(mesh, sch.group)
    if mesh is not None and sch.tp_size != info.tp:
        raise SchedulingError(
            sch.path, f"the schedule's tensor-parallel group has {sch.tp_size} rank(s), but "
            f"the mesh's tp dimension has {info.tp}.",
            "create the schedule with slapo.create_schedule(model, mesh=mesh).")
    return info


def _check_precision_target(precision: str, target: str | None) -> None:
    if precision != "fp32" and target == "deepspeed":
        raise SchedulingError("", f"precision={precision!r} with target='deepspeed': DeepSpeed "
                              "manages precision itself.",
                              f"drop precision and put {{'{precision}': {{'enabled': True}}}} "
                              "in deepspeed_config.")


def _run_device_type(sch: Schedule, device, info: MeshInfo) -> str:
    """Where the model will run (the autocast device type), known before anything is moved."""
    if device is not None:
        return torch.device(device).type
    if has_meta_tensors(sch.mod):
        return info.device.type
    return module_device_type(sch.mod, default=info.device.type)


def _job_group(info: MeshInfo):
    """Every rank that takes this optimizer step (the fp16 scaler's inf/NaN vote is reduced
    over it): the whole mesh, or the schedule's TP group without a mesh, or None.
    Creating a group for a mesh smaller than the job is a collective over the job."""
    import torch.distributed as dist

    if info.mesh is None:
        return info.tp_group if info.tp > 1 else None
    if info.mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(ranks=info.mesh.mesh.flatten().tolist())


def make_precision(precision: PrecisionName, device_type: str, info: MeshInfo,
                   fp8=None) -> Precision:
    group = _job_group(info) if precision == "fp16" else None
    return Precision(precision, device_type, group, fp8=fp8)


def _check_pipeline_dp(pipeline: str | None, data_parallel: str | None, info: MeshInfo) -> None:
    """DDP cannot hold a pipeline stage: each stage runs several micro-batch forwards before their
    backwards, and DDP's reducer prepares one gradient reduction per forward (torch's pipelining
    re-prepares for the last one), so it fails on the first step with an internal assert
    ("rebuilt parameter indices size ... 52 vs 26", seen on 4 gloo ranks, torch 2.13)."""
    if pipeline is not None and data_parallel == "ddp" and info.replicas > 1:
        raise SchedulingError("", f"pipeline={pipeline!r} with data_parallel='ddp' is not "
                              "supported: DDP's reducer cannot follow several micro-batch "
                              "forwards per backward.", "use data_parallel='fsdp' with "
                              "pipelines (reshard_after_forward=False keeps weights gathered, "
                              "as DDP does).")


def _check_pipeline_off(sch: Schedule, info: MeshInfo) -> None:
    if info.pp > 1:
        raise SchedulingError(sch.path, f"the mesh has pp={info.pp}, but build was called "
                              "without a pipeline schedule.",
                              "pass pipeline='1F1B' (or another schedule), or use pp=1.")


# ------------------------------------------------------------------------------------------------
# the pieces
# ------------------------------------------------------------------------------------------------

def place_weights(model: nn.Module, device, info: MeshInfo, init_weights, seed: int) -> None:
    """Materialise meta tensors (this rank's shards only) or move to `device`."""
    if has_meta_tensors(model):
        materialize(model, device or info.device, init_fn=init_weights, seed=seed)
    elif device is not None:
        model.to(device)


def make_optimizer(optimizer, params: list[nn.Parameter], optimizer_kwargs: dict | None,
                   offload: bool = False):
    if optimizer is None:
        return None
    if offload:  # state and step in host memory (`optimizer_offload`)
        return make_offloaded(optimizer, params, optimizer_kwargs)
    return optimizer(params, **(optimizer_kwargs or {}))


def _unique_params(modules: list[nn.Module]) -> list[nn.Parameter]:
    """The parameters the optimizer steps: each once, and only trainable ones, so a frozen
    base (LoRA fine-tuning) holds no optimizer state and is never touched by its step. A
    model (or this rank's stages) with nothing trainable keeps all of them, as before: torch's
    optimizers refuse an empty list, and such a step changes nothing anyway."""
    seen, out = set(), []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return [p for p in out if p.requires_grad] or out


def plan_stages(sch: Schedule, *, mesh=None, pipeline: str = "1F1B",
                num_microbatches: int | None = None,
                virtual_stages: int | None = None) -> PipelineStages:
    """Plan `pipeline` on `mesh` (default the schedule's) and split the schedule into its
    stages from the cuts (every check `build` makes of a pipeline, on every rank)."""
    _check_schedule(sch)
    return _stages.plan(sch, mesh_info(sch, mesh), pipeline, num_microbatches, virtual_stages)


# ------------------------------------------------------------------------------------------------
# build
# ------------------------------------------------------------------------------------------------

def build(sch: Schedule, *, optimizer: Callable | None = None,
          init_weights: Callable | None = None, seed: int = 0,
          device: torch.device | str | None = None, optimizer_kwargs: dict | None = None,
          mesh=None, pipeline: str | PipelineStages | None = None,
          num_microbatches: int | None = None,
          virtual_stages: int | None = None, data_parallel: str | None = None,
          reshard_after_forward: bool | int = True, loss_fn: LossFn | None = None,
          grad_clip: float | None = None, grad_accum: int = 1, batch_is_global: bool = True,
          target: str | None = None, deepspeed_config: dict | None = None,
          precision: PrecisionName = "fp32", fp8: Float8Config | None = None,
          optimizer_offload: bool = False
          ) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Return `(model, optimizer)` for a schedule; `model.train_step(batch) -> float` trains.

    The model returned is the schedule's own module object (`sch.mod`, the user's model), its
    class unchanged: same `named_parameters()` and `state_dict()` keys, its own attributes,
    plus the `Trainer`'s `train_step`, `eval_step`, `local_batch`, `optimizer`, `runner`,
    `step_config` and `precision` as instance attributes (`slapo.runtime.built_model`;
    `model(...)` runs through DDP when DDP is on; `copy.deepcopy(model)` is the plain model).
    With a pipeline no rank holds the whole model: the result is a `PipelineTrainModule` of
    this rank's stages. Both are `slapo.TrainModule`s. `target="deepspeed"` returns the
    DeepSpeed engine's wrapper (as 2023 returned the engine). `build_trainer` takes the same
    arguments and returns the `Trainer` itself.

    Weights:
    - Meta (delayed-init) tensors are materialised on `device`, shards only, initialised with
      `init_weights(module[, path])` or the model's own init (see `slapo.init`), seeded by `seed`.
      Weights that are already materialised (e.g. loaded from a checkpoint) are never touched.
    - `device`: move the model there (default: leave it, or the current accelerator for meta).
    - `optimizer`: an optimizer class or a callable `params -> optimizer`, called with the
      parameters this rank holds and `optimizer_kwargs`; `None` returns `None`.

    Parallelism (over `mesh`, default the schedule's; see `slapo.init_mesh`):
    - `pipeline`: a torch.distributed.pipelining schedule name ("GPipe", "1F1B",
      "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"),
      over the mesh's pp dimension, with `pp * virtual_stages` stages from the schedule's cuts
      (`virtual_stages` defaults to 1, or 2 for multi-stage schedules) and `num_microbatches`
      micro-batches per step (default: the number of stages). Or the `PipelineStages` of
      `plan_stages(sch, mesh=, pipeline=, ...)`, when the caller needed the stages first.
    - `data_parallel`: None, "ddp" or "fsdp" (FSDP2 per block and root, over the dp dimension;
      `reshard_after_forward` True = ZeRO-3, False = keep gathered weights until backward).

    The step (`Trainer.train_step`):
    - `batch`: a dict of tensors (keyword arguments) or a tuple (positional). With
      `batch_is_global` (default) every rank passes the same global batch and each dp rank takes
      its 1/dp of the samples; otherwise each rank passes its own local batch.
    - `loss_fn(outputs, batch) -> scalar`; default `outputs.loss` (HF models given labels).
      With a `loss_fn`, batch entries the model's forward does not name (`{"x": images,
      "labels": y}` for a torchvision net) go to `loss_fn` only, with or without a pipeline.
    - `grad_accum` slices per step, `grad_clip` max global gradient 2-norm.
    - The returned loss is the mean over the global batch (exactly, for losses that are means
      over samples of equal weight), as a float on every rank.

    `precision`: "fp32" (default), "bf16" or "fp16" (None is its earlier spelling of "fp32";
    `slapo.runtime.precision.check_precision`; the earlier keyword `mixed_precision=` is
    translated by the public `slapo.build`, not here). Weights and
    optimizer state stay fp32; forward and loss run under `torch.autocast(device_type, dtype)`;
    "fp16" adds a gradient scaler (unscaled before clipping; a step with inf/NaN gradients on
    any rank is skipped on every rank and counted in `model.precision.skipped_steps`). With
    `data_parallel="fsdp"` FSDP2 also gets `MixedPrecisionPolicy(param_dtype=dtype,
    reduce_dtype=float32)`; pipeline stages run their forward under autocast. See
    `slapo.runtime.precision` and docs/runtime.md ("Mixed precision").
    "fp8" is "bf16" plus torchao's FP8 GEMMs in the Linear / Conv1D layers `fp8`
    (a `slapo.runtime.fp8.Float8Config`, default: tensorwise scales, both weight dimensions
    multiples of 16 and >= 64, not the LM head or tied weights) selects; converted after TP
    sharding (scales per shard), emulated on CPU, refused on a GPU without FP8 or without
    torchao (`pip install slapo[fp8]`). `model.precision.fp8_modules` lists what was converted.

    `optimizer_offload=True`: the optimizer's state and step in host memory (pinned with
    CUDA): gradients copied to the host after clipping, the step there, the updated weights
    copied back (`slapo.runtime.optimizer_offload.HostOffloadOptimizer`; `optimizer` must be a
    `torch.optim.Optimizer` class; not with the DeepSpeed target, whose config offloads).

    `target="deepspeed"`: hand the model to a DeepSpeed engine instead (ZeRO stages 1-3 through
    `deepspeed_config`); see `slapo.runtime.deepspeed`.

    This is today's signature only. `slapo.build` (the public name) is the edge adapter
    `slapo.compat.build.build`, which translates Slapo 2023's spellings (`config=`,
    `topology=`, `init_weights=True/False`, 2023 `target` names; docs/migrating.md) and the
    earlier `mixed_precision=`, then calls this function; this layer never sees them.
    """
    given = dict(locals())
    if target == "deepspeed":
        return _build_deepspeed(sch, given)
    trainer = _compose(sch, given)
    return trainer.model, trainer.optimizer


def build_trainer(sch: Schedule, *, optimizer: Callable | None = None,
                  init_weights: Callable | None = None, seed: int = 0,
                  device: torch.device | str | None = None,
                  optimizer_kwargs: dict | None = None, mesh=None,
                  pipeline: str | PipelineStages | None = None,
                  num_microbatches: int | None = None, virtual_stages: int | None = None,
                  data_parallel: str | None = None, reshard_after_forward: bool | int = True,
                  loss_fn: LossFn | None = None, grad_clip: float | None = None,
                  grad_accum: int = 1, batch_is_global: bool = True,
                  precision: PrecisionName = "fp32",
                  fp8: Float8Config | None = None, optimizer_offload: bool = False) -> Trainer:
    """The `Trainer` that `build` makes (same arguments, same composition, without the
    DeepSpeed target and the earlier spellings): `trainer.train_step(batch)`, `trainer.model`
    (what `build` returns), `trainer.optimizer`. For code that drives the step itself
    (`slapo train`, tune trials, the progressive demo)."""
    return _compose(sch, dict(locals(), target=None))


def _compose(sch: Schedule, args: dict[str, Any]) -> Trainer:
    """`build_trainer` on `build`'s keyword arguments (`args`)."""
    precision, info, device_type, config = _checked(sch, args)
    if args["pipeline"] is None:
        _check_pipeline_off(sch, info)
        check_trainable(sch.mod)
    common = {k: args[k] for k in ("optimizer", "optimizer_kwargs", "loss_fn", "device",
                                   "init_weights", "seed", "data_parallel",
                                   "reshard_after_forward", "optimizer_offload")}
    common["precision"] = make_precision(precision, device_type, info, args["fp8"])  # checked
    if args["pipeline"] is None:
        return _build_local(sch, info, config, **common)
    return _build_pipeline(sch, info, config, pipeline=args["pipeline"],
                           num_microbatches=args["num_microbatches"],
                           virtual_stages=args["virtual_stages"], **common)


def _checked(sch: Schedule, args: dict[str, Any]) -> tuple[str, MeshInfo, str, StepConfig]:
    """Every argument check of `build` (`args`: its keyword arguments), identical on every
    rank and before anything changes; returns the precision, the mesh, the device type and
    the step's config."""
    _check_schedule(sch)
    _check_init_weights(sch, args["init_weights"])
    _check_optimizer(sch, args["optimizer"])
    check_optimizer_offload(args.get("optimizer_offload", False), args["optimizer"],
                            args["target"])
    _check_step_args(args["grad_accum"], args["grad_clip"], args["target"])
    precision = check_precision(args["precision"])  # the one check of the name
    _check_precision_target(precision, args["target"])
    info = mesh_info(sch, args["mesh"])
    pipeline = args["pipeline"]
    if isinstance(pipeline, PipelineStages):
        _stages.check_planned(sch, info, pipeline, args["num_microbatches"], args["virtual_stages"])
    check_data_parallel(args["data_parallel"], info)
    check_experts(sch.mod, args["data_parallel"], args["target"])
    _check_pipeline_dp(_stages.pipeline_name(pipeline), args["data_parallel"], info)
    device_type = _run_device_type(sch, args["device"], info)
    check_autocast(precision, device_type)
    args["fp8"] = check_fp8_config(precision, args.get("fp8"), device_type)  # the checked config
    model = _lm_of(sch.mod)
    config = StepConfig(info, args["grad_accum"], args["grad_clip"], 1, args["batch_is_global"],
                        loss=ModelLoss.of(model, args["loss_fn"] is not None))
    if info.cp > 1:
        check_scheduled_for_cp(sch.path, model, info.cp)
        config.loss = check_context_parallel(sch.path, info.cp, config.loss,
                                             args["data_parallel"], args["target"])
        config.cp_positions = position_rule(model)
    name_shape_errors(sch.mod, sch)  # a shape error inside a scheduled module names the shard
    guard_gloo_exit()  # a script that never leaves its gloo group still exits cleanly
    return precision, info, device_type, config


def _lm_of(model: nn.Module) -> nn.Module:
    """The model whose loss the step weights and whose attention `apply` made context-parallel:
    the Hugging Face model inside a LoRA (tuner) `PeftModel`, whose forward hands it the batch
    unchanged (`apply` schedules that model: `model_schedule.lora.model_inside`); `model`
    otherwise. Read on the wrapper, a PEFT model's loss was unknown (the step averaged units,
    not tokens) and a cp mesh refused it as unscheduled. A prompt-learning wrapper adds virtual
    tokens: it stays itself."""
    path = peft_inner_path(model)
    return model.get_submodule(path) if path == "base_model.model" else model


def _build_deepspeed(sch: Schedule, args: dict[str, Any]):
    """`target="deepspeed"`: the same checks, then the model handed to a DeepSpeed engine."""
    from .deepspeed import build_deepspeed

    _, info, _, config = _checked(sch, args)
    return build_deepspeed(sch, info, config, pipeline=_stages.pipeline_name(args["pipeline"]),
                           **{k: args[k] for k in (
                               "optimizer", "optimizer_kwargs", "loss_fn", "deepspeed_config",
                               "device", "init_weights", "seed", "data_parallel")})


def _build_local(sch: Schedule, info: MeshInfo, config: StepConfig, *, optimizer,
                 optimizer_kwargs, loss_fn, device, init_weights, seed, data_parallel,
                 reshard_after_forward, precision: Precision,
                 optimizer_offload: bool = False) -> Trainer:
    """The whole model on every rank (optionally tensor-parallel), optionally data-parallel;
    the trainer is attached to the user's module itself (`built_model.attach`).

    Why the same object and not a wrapper: 2023 code (and any user's) reads the model's
    attributes, parameter names and state-dict keys after build; a wrapper adds a prefix to
    all of them. The DDP wrapper lives in the runner (a plain object), FSDP2 already changed
    the class in place."""
    model = sch.mod
    detach(model)  # built before: its own forward back before DDP wraps it again
    place_weights(model, device, info, init_weights, seed)
    precision.convert([model], model)  # fp8 only: after TP sharding, before DDP/FSDP2
    table = norm_weight_table([model], info)
    wrapped = apply_data_parallel(OwnForward(model) if data_parallel == "ddp" else model,
                                  data_parallel, info,
                                  reshard_after_forward=reshard_after_forward,
                                  mp_policy=precision.fsdp_policy())
    ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
    opt = make_optimizer(optimizer, _unique_params([model]), optimizer_kwargs, optimizer_offload)
    runner = LocalRunner(model, loss_fn, precision, ddp=ddp)
    nw = norm_weights(model, table, dp_sharded=data_parallel == "fsdp")
    trainer = Trainer(model, [model], opt, runner, config, nw, precision)
    attach(model, trainer, ddp)
    return trainer


def _build_pipeline(sch: Schedule, info: MeshInfo, config: StepConfig, *,
                    pipeline: str | PipelineStages,
                    num_microbatches, virtual_stages, optimizer, optimizer_kwargs, loss_fn,
                    device, init_weights, seed, data_parallel, reshard_after_forward,
                    precision: Precision, optimizer_offload: bool = False) -> Trainer:
    """This rank's pipeline stages (each optionally data-parallel) driven by a torch schedule."""
    staged = pipeline if isinstance(pipeline, PipelineStages) else \
        _stages.plan(sch, info, pipeline, num_microbatches, virtual_stages)
    plan, all_stages = staged.plan, staged.stages
    if info.cp > 1 and not getattr(all_stages[0], "cp_inputs", ()):
        raise SchedulingError(sch.path, f"cp={info.cp}: the pipeline stages of "
                              f"{type(sch.mod).__name__} ({type(all_stages[0]).__name__}) are "
                              "not built for context parallelism.", "use cp=1 with this "
                              "model's pipeline (the decoder and encoder stages take the cp "
                              "inputs: GPT-2, OPT, LLaMA, Mistral, Qwen2/3, BERT, RoBERTa).")
    ids = plan.stage_ids(info.pp_rank)
    mine = [all_stages[i] for i in ids]
    tied = find_tied(all_stages, plan, info.pp_rank)  # before weights are replaced
    _place_stage_weights(sch, mine, device, info, init_weights, seed)
    precision.convert(mine, sch.mod)  # fp8 only
    table = norm_weight_table(mine, info, tied)
    wrapped = [precision.wrap_forward(apply_data_parallel(
        m, data_parallel, info, reshard_after_forward=reshard_after_forward,
        mp_policy=precision.fsdp_policy())) for m in mine]
    dev = device or _stage_device(mine, info)
    opt = make_optimizer(optimizer, _unique_params(wrapped), optimizer_kwargs, optimizer_offload)
    runner = PipelineRunner(None, plan, info, ids, mine, loss_fn, tied, precision)
    pstages = make_stages(wrapped, ids, plan, info, torch.device(dev))
    runner.schedule = make_schedule(pstages, plan, runner.schedule_loss)
    config.num_microbatches = plan.num_microbatches
    holder = nn.ModuleList(wrapped)
    nw = norm_weights(holder, table, dp_sharded=data_parallel == "fsdp")
    trainer = Trainer(None, mine, opt, runner, config, nw, precision)
    trainer.model = PipelineTrainModule(wrapped, trainer)
    return trainer


def _place_stage_weights(sch: Schedule, stages: list[nn.Module], device, info: MeshInfo,
                         init_weights, seed: int) -> None:
    """Materialise only what this rank's stages use, exactly as the whole model would be: the
    inits run over the whole (meta) model, so a parent's writes to a stage's tensors (GPT-2's
    scaled `c_proj`) land too; same seeds per original path, tied weights from their first
    owner, the other stages' tensors left on meta."""
    if any(has_meta_tensors(s) for s in stages):
        used = [t for s in stages for t in [*s.parameters(), *s.buffers()]]
        materialize(sch.mod, device or info.device, init_fn=init_weights, seed=seed,
                    only=used)
    elif device is not None:
        for s in stages:
            s.to(device)


def _stage_device(stages: list[nn.Module], info: MeshInfo) -> torch.device:
    for s in stages:
        for p in s.parameters():
            return p.device
    return info.device


__all__ = ["PipelineStages", "build", "build_trainer", "mesh_info", "plan_stages"]
