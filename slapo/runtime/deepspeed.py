"""Optional DeepSpeed target: `build(sch, target="deepspeed", deepspeed_config={...})`.

DeepSpeed is imported only here and only when asked for, so Slapo never depends on it. What
this target covers (each item runs in `tests/test_deepspeed.py` on 2 gloo ranks, DeepSpeed's
CPU accelerator, against a one-process plain-PyTorch AdamW run):
- ZeRO stages 1, 2 and 3 through `deepspeed.initialize` (stage 0 and whatever else the config
  enables, e.g. offload, are passed through untested), data-parallel over the whole world;
- gradient accumulation and clipping are DeepSpeed's (`gradient_accumulation_steps`,
  `gradient_clipping`, filled in from `grad_accum` / `grad_clip`; a config that says otherwise
  is refused rather than silently ignored);
- bf16 (`{"bf16": {"enabled": True}}`: bf16 weights and activations, fp32 master weights in the
  ZeRO optimizer); fp16 wherever DeepSpeed's accelerator supports it (not its CPU accelerator:
  refused with a SchedulingError, as is bf16 on an accelerator without it);
- the same `train_step(batch) -> float` as every other runtime, and `state_dict()` under the
  model's own keys (gathered from the ZeRO-3 partitions).
Not covered: pipeline parallelism (DeepSpeed's PipelineModule needs a flat layer list) and
tensor parallelism combined with ZeRO (Slapo's TP shards are not registered with DeepSpeed's
model-parallel unit); both raise a SchedulingError before anything is changed.

Launching: DeepSpeed reads `LOCAL_RANK` (torchrun and the deepspeed launcher set it) and, when
torch.distributed is not initialised yet, the torchrun variables; a process without them is
refused up front (DeepSpeed would otherwise try MPI discovery or assert). On a machine with a GPU
DeepSpeed picks its CUDA accelerator and moves the model there; to run on CPU (gloo) set
`DS_ACCELERATOR=cpu` before the first `import deepspeed`. A mismatch between DeepSpeed's
accelerator and the mesh's / `device`'s type is refused.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from .batch import Batch, batch_size, check_divisible, slice_batch
from .mesh import MeshInfo
from .runner import LossFn, forward_loss
from .token_mean import token_mean_over, weighted
from .train_step import StepConfig

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_LOCAL_RANK_ENV = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")


def import_deepspeed():
    """`import deepspeed`, or a SchedulingError saying how to get it."""
    try:
        import deepspeed
    except ImportError as e:
        raise SchedulingError("", f"target='deepspeed' needs the deepspeed package, which does "
                              f"not import here ({e}).",
                              "install it (`DS_BUILD_OPS=0 pip install deepspeed`, or "
                              "`pip install slapo[deepspeed]`) or use target=None (DDP / FSDP2 "
                              "/ pipeline from torch).") from None
    return deepspeed


# ------------------------------------------------------------------------------------------------
# checks (all before the model is touched)
# ------------------------------------------------------------------------------------------------

def check_supported(info: MeshInfo, data_parallel, pipeline) -> None:
    """Refuse what this target cannot run; needs no deepspeed, so it holds without it."""
    if pipeline is not None or info.pp > 1:
        raise SchedulingError("", "target='deepspeed' does not run Slapo pipelines.",
                              "use target=None for pipeline parallelism.")
    if info.tp > 1:
        where = ("the mesh's tp dimension" if info.mesh is not None else "the schedule's "
                 "tensor-parallel group (create_schedule without a mesh takes the whole world)")
        raise SchedulingError("", f"target='deepspeed' does not combine with Slapo tensor "
                              f"parallelism: {where} has {info.tp} ranks.",
                              "create the schedule with mesh=slapo.init_mesh(dp=<world size>) "
                              "(tp=1), or use data_parallel='fsdp' with target=None for TP + "
                              "sharded data parallelism.")
    if data_parallel is not None:
        raise SchedulingError("", "target='deepspeed' does its own data parallelism; "
                              f"data_parallel={data_parallel!r} would wrap the model twice.",
                              "leave data_parallel=None and set the ZeRO stage in "
                              "deepspeed_config.")
    if info.mesh is not None and dist.is_initialized() and info.dp != dist.get_world_size():
        raise SchedulingError("", f"the mesh's dp dimension has {info.dp} ranks but the job "
                              f"has {dist.get_world_size()}; DeepSpeed's data parallelism "
                              "spans the whole world.",
                              "use init_mesh(dp=<world size>) with target='deepspeed'.")


def check_launch_env() -> None:
    """DeepSpeed asserts on a missing `LOCAL_RANK` and tries MPI discovery (mpi4py) when the
    torchrun variables are missing and torch.distributed is not initialised yet."""
    missing = [] if any(k in os.environ for k in _LOCAL_RANK_ENV) else ["LOCAL_RANK"]
    if not dist.is_initialized():
        missing += [k for k in _LAUNCH_ENV if k not in os.environ]
    if missing:
        raise SchedulingError("", f"target='deepspeed' needs the launcher's environment "
                              f"variables {', '.join(missing)}, which are not set.",
                              "launch with `torchrun` or the `deepspeed` launcher (a single "
                              "process too: `torchrun --nproc-per-node 1 script.py`), or set "
                              "them yourself.")


def _enabled(cfg: dict, key: str) -> bool:
    section = cfg.get(key)
    return isinstance(section, dict) and bool(section.get("enabled", False))


def check_accelerator(cfg: dict, info: MeshInfo, device) -> None:
    """DeepSpeed moves the model to its accelerator's device and refuses dtypes that it does not
    support only deep inside `initialize`; say both here, before anything moves."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    kind = torch.device(acc.device_name()).type
    wanted = {"the mesh": info.device_type if info.mesh is not None else None,
              "device": torch.device(device).type if device is not None else None}
    for what, t in wanted.items():
        if t is not None and t != kind:
            raise SchedulingError("", f"DeepSpeed's accelerator runs on {kind!r}, but {what} "
                                  f"is on {t!r}.", "set DS_ACCELERATOR=cpu (or cuda) before "
                                  "deepspeed is first imported, to match the mesh / device.")
    supported = {"fp16": acc.is_fp16_supported(), "bf16": acc.is_bf16_supported()}
    for key, ok in supported.items():
        if _enabled(cfg, key) and not ok:
            raise SchedulingError("", f"deepspeed_config enables {key}, which DeepSpeed's "
                                  f"{kind!r} accelerator does not support.",
                                  "use bf16 (supported on CPU) or fp32, or run on a GPU.")


def check_optimizer(cfg: dict, optimizer) -> None:
    """ZeRO stages 1 and 2 shard optimizer state, so DeepSpeed asserts without an optimizer
    (stage 0 and 3 build an inference engine); say so before anything moves."""
    stage = (cfg.get("zero_optimization") or {}).get("stage", 0)
    if optimizer is None and "optimizer" not in cfg and stage in (1, 2):
        raise SchedulingError("", f"ZeRO stage {stage} needs an optimizer, and none was given.",
                              "pass build(..., optimizer=torch.optim.AdamW) or an 'optimizer' "
                              "section in deepspeed_config.")


def complete_config(base: dict | None, config: StepConfig) -> dict:
    """The user's config completed with what `build` already knows.

    Without `grad_clip` and without `gradient_clipping` in the config, clipping is off (0.0),
    as on every other target: DeepSpeed would otherwise clip at its own default of 1.0.
    DeepSpeed insists on a batch size at initialisation but only uses it for its own data
    loader and logging; `train_step` splits whatever batch it is given, so 1 is a safe default.
    `grad_accum` / `grad_clip` that contradict the config are refused: `train_step` slices the
    batch by the config's accumulation count, so a silent choice would change the step.
    """
    cfg = dict(base or {})
    _merge(cfg, "gradient_accumulation_steps", config.grad_accum, default=1)
    if config.grad_clip is not None:
        _merge(cfg, "gradient_clipping", config.grad_clip, default=None)
    else:  # DeepSpeed's own default clips at 1.0; build's grad_clip=None means no clipping
        cfg.setdefault("gradient_clipping", 0.0)
    zero = cfg["zero_optimization"] = dict(cfg.get("zero_optimization") or {"stage": 1})
    if zero.get("stage") == 3:
        # ZeRO-3's "memory-efficient linear" replaces torch.nn.functional.linear for the whole
        # process and never puts it back (DeepSpeed says so): every model built afterwards in
        # the process runs DeepSpeed's autograd function instead, and on torch 2.11 a compiled
        # tensor-parallel BERT then trained to a 10% different loss. Off unless the user's
        # config asks for it: it is a memory saving of ZeRO-3's, not needed for its results.
        zero.setdefault("memory_efficient_linear", False)
    # our optimizer (e.g. torch.optim.AdamW) is a "client optimizer" to DeepSpeed, which ZeRO
    # refuses unless told that it is intended
    cfg.setdefault("zero_allow_untested_optimizer", True)
    if "train_batch_size" not in cfg:
        cfg.setdefault("train_micro_batch_size_per_gpu", 1)
    return cfg


def _merge(cfg: dict, key: str, value, default) -> None:
    """Set `key` from `build`'s argument unless the config has it; a config value that differs
    from an argument the user changed from its default is a contradiction."""
    if key not in cfg:
        cfg[key] = value
    elif value != default and cfg[key] != value:
        raise SchedulingError("", f"deepspeed_config[{key!r}]={cfg[key]!r} contradicts the "
                              f"build argument ({value!r}).", "set it in one place only.")


# ------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------

class DeepSpeedModule(nn.Module):
    """A DeepSpeed engine behind `train_step(batch) -> float` (see `Trainer` for the
    contract). Data parallelism is DeepSpeed's, over the whole world: with `batch_is_global`
    each rank takes its 1/world of the samples; the returned loss is the global mean."""

    def __init__(self, engine, config: StepConfig, loss_fn: LossFn | None):
        super().__init__()
        self.engine = engine
        self.step_config = config
        self.loss_fn = loss_fn
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @property
    def model(self) -> nn.Module:
        return self.engine.module

    @property
    def optimizer(self):
        return self.engine.optimizer

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks come from the model (`model.config`), as on the
        module other targets return, then from the engine: a 2023 script's `model.backward(loss)`,
        `model.step()`, `model.save_checkpoint(...)` are DeepSpeed's own."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            engine = self.__dict__.get("_modules", {}).get("engine")
            if engine is None:
                raise
            try:
                return getattr(engine.module, name)
            except AttributeError:
                return getattr(engine, name)

    # ---- the step -------------------------------------------------------------------------
    def accumulation_steps(self) -> int:
        return int(self.engine.gradient_accumulation_steps())

    def local_batch(self, batch: Batch) -> Batch:
        cfg = self.step_config
        check_divisible(batch, {"data-parallel ranks": self.world if cfg.batch_is_global else 1,
                                "grad_accum": self.accumulation_steps()})
        if not cfg.batch_is_global or self.world == 1:
            return batch
        size = batch_size(batch) // self.world
        return slice_batch(batch, self.rank * size, (self.rank + 1) * size)

    def train_step(self, batch: Batch) -> float:
        """One optimizer step: `k` engine micro-steps (DeepSpeed scales each backward by 1/k
        and steps the optimizer, with its clipping, at the accumulation boundary)."""
        if self.engine.optimizer is None:
            raise SchedulingError("", "train_step needs an optimizer, and the DeepSpeed engine "
                                  "has none.", "pass build(..., optimizer=torch.optim.AdamW) "
                                  "or an 'optimizer' section in deepspeed_config.")
        batch = self.local_batch(batch)
        k = self.accumulation_steps()
        size = batch_size(batch) // k
        parts = [slice_batch(batch, i * size, (i + 1) * size) for i in range(k)]
        tokens = token_mean_over(self.step_config.loss, parts, self.world, None,
                                 torch.device(self.engine.device))
        total = 0.0
        for part in parts:
            # DeepSpeed scales each backward by 1/k: x k gives the part its token weight
            weight = None if tokens is None else tokens.weight(part)
            part = part if tokens is None else tokens.guard(part)
            loss = forward_loss(self.engine, part, self.loss_fn)
            self.engine.backward(loss if weight is None else weighted(loss, weight * k))
            self.engine.step()
            total += float(loss.detach()) / k if weight is None else \
                float(loss.detach().double() * weight)
        return self._mean_over_ranks(total)

    def _mean_over_ranks(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.engine.device)
        dist.all_reduce(t)
        return float(t.item()) / self.world

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's weights under its own keys (no `engine.module.` prefix), full tensors
        (ZeRO-3 partitions are gathered: a collective, call it on every rank). In the engine's
        dtype (bf16 with bf16 enabled); the fp32 master weights and optimizer state are in
        `engine.save_checkpoint`."""
        out = destination if destination is not None else {}
        module = self.engine.module
        if self.engine.zero_optimization_stage() == 3:
            from deepspeed.runtime.zero import GatheredParameters

            with GatheredParameters(list(module.parameters()), modifier_rank=None):
                for k, v in module.state_dict(prefix=prefix).items():
                    out[k] = v.detach().clone()
            return out
        return module.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Refused: ZeRO keeps its own fp32 master copy (partitioned), so weights loaded into the
        module would be overwritten by the next step."""
        raise SchedulingError("", "load_state_dict on a DeepSpeed model would not reach ZeRO's "
                              "master weights.", "load the weights into the model before "
                              "slapo.build, or use model.engine.load_checkpoint(dir).")


# ------------------------------------------------------------------------------------------------
# build
# ------------------------------------------------------------------------------------------------

def forget_stale_groups() -> None:
    """Drop DeepSpeed's cached clone of the world group when it belongs to a destroyed process
    group: DeepSpeed caches it module-wide (`deepspeed.utils.groups._WORLD_GROUP`), so a second
    `build` in a process that re-initialised torch.distributed (tests, notebooks) failed with
    "Group ... is not registered" (DeepSpeed 0.19.8). Private name: guarded, a no-op if gone."""
    from deepspeed.utils import groups

    cached = getattr(groups, "_WORLD_GROUP", None)
    if cached is None:
        return
    if dist.is_initialized():
        try:
            dist.get_process_group_ranks(cached)
            return
        except (ValueError, RuntimeError):
            pass
    groups._WORLD_GROUP = None


def build_deepspeed(sch, info: MeshInfo, config: StepConfig, *, optimizer, optimizer_kwargs,
                    loss_fn, deepspeed_config: dict | None, device, init_weights, seed,
                    data_parallel, pipeline):
    """Hand the scheduled model to `deepspeed.initialize`; returns (module, engine optimizer).

    Every check runs before the model is materialised, moved or cast."""
    check_supported(info, data_parallel, pipeline)
    ds = import_deepspeed()
    check_launch_env()
    cfg = complete_config(deepspeed_config, config)
    check_optimizer(cfg, optimizer)
    check_accelerator(cfg, info, device)
    from .build import place_weights

    model = sch.mod
    place_weights(model, device, info, init_weights, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer(params, **(optimizer_kwargs or {})) if optimizer is not None else None
    forget_stale_groups()
    # With tp = pp = 1 the data-parallel group is the whole world, which is DeepSpeed's default.
    with _no_inference_shm_build():
        engine, ds_opt, _, _ = ds.initialize(model=model, optimizer=opt, model_parameters=params,
                                             config=cfg,
                                             dist_init_required=not dist.is_initialized())
    return DeepSpeedModule(engine, config, loss_fn), ds_opt


@contextlib.contextmanager
def _no_inference_shm_build():
    """On DeepSpeed's CPU accelerator, skip the JIT build of its shared-memory all-reduce.

    DeepSpeed's comm backend compiles `deepspeed_shm_comm` (C++, ninja) when it is first made:
    about 2 minutes on 2 cores, again for every new install path (a fresh virtualenv, CI),
    with every rank of the job waiting on the build lock. The op serves only
    `inference_all_reduce` (DeepSpeed's inference kernels); training all-reduces through
    torch.distributed either way, so a training run gains nothing from it. On CUDA nothing
    is changed."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    comm_torch = importlib.import_module("deepspeed.comm.torch")  # not ds.comm.torch: torch
    if get_accelerator().device_name() != "cpu" or not hasattr(comm_torch, "build_shm_op"):
        yield
        return
    built = comm_torch.build_shm_op
    comm_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        comm_torch.build_shm_op = built
