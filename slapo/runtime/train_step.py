"""`TrainModule.train_step(batch) -> float`: one optimizer step, the same call for every parallelism.

`slapo.build` returns the user's own module made trainable in place (`make_trainable`: its class
becomes a generated subclass of (`TrainModule`, its class), the state lives in a plain
`TrainState`), or with a pipeline a `PipelineTrainModule` of this rank's stages.

The step is the same sequence whatever `build` composed:

    slice this dp rank's samples -> zero grads -> for each accumulation slice: runner.forward_backward
    -> runner.finish_grads (e.g. sum tied weights across pipeline stages) -> unscale (fp16)
    -> clip -> optimizer.step (fp16: skipped on inf/NaN) -> the loss, averaged over samples, as a
    float on every rank

An HF language model's own loss is averaged over the supervised tokens of the whole global
batch, not over slices, ranks or micro-batches (`slapo.runtime.token_mean`), so masked-LM and
padded batches train like one process however the batch is split.

Only the *runner* differs: `LocalRunner` runs the module (plain, DDP or FSDP2) on the slice;
`slapo.runtime.pipeline_runner.PipelineRunner` runs a torch.distributed.pipelining schedule. Both get
the step's `Precision` (`slapo.runtime.precision`): forward and loss under its `autocast()`,
backward on its `loss_for_backward(loss)`; the step's unscale and optimizer step are the
TrainModule's, so precision is decided in one place.

`time_steps(model, batches)` times that same step for the apps that measure it (tune trials,
`slapo train --progressive`), so what is tuned and demonstrated is what `slapo train` runs.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from ..errors import SchedulingError
from .batch import (
    Batch,
    as_batch,
    batch_size,
    call,
    check_divisible,
    slice_batch,
    split_batch,
)
from .mesh import MeshInfo
from .precision import Precision
from .token_mean import ModelLoss, Weights, token_mean

LossFn = Callable[[Any, Batch], torch.Tensor]


def compute_loss(outputs: Any, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """`loss_fn(outputs, batch)`, or the model's own `outputs.loss` (HF models given labels)."""
    if loss_fn is not None:
        loss = loss_fn(outputs, batch)
    else:
        loss = getattr(outputs, "loss", None)
        if loss is None:
            raise SchedulingError("", "the model's output has no `.loss` (an HF model computes "
                                  "it only when the batch holds `labels`).",
                                  "put `labels` in the batch, or pass build(..., loss_fn=fn) "
                                  "with fn(outputs, batch) -> scalar.")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise SchedulingError("", f"the loss must be a scalar tensor, got {type(loss).__name__}"
                              f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}.",
                              "return e.g. loss.mean() from loss_fn.")
    return loss.reshape(())


def forward_loss(module: nn.Module, batch: Batch, loss_fn: LossFn | None) -> torch.Tensor:
    """The module's forward on the batch, then `compute_loss` (with a `loss_fn`, batch entries
    the forward does not name go to the loss function only: `batch.call`)."""
    return compute_loss(call(module, batch, loss_fn_given=loss_fn is not None), batch, loss_fn)


class Runner(Protocol):
    """Forward and backward of one slice of the batch; gradients accumulate in `.grad`."""

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        """Backward of the slice's loss x its weight (`scale`, or each unit's `tokens.weight`);
        return that weighted loss, detached (zero on ranks that do not compute it)."""

    def finish_grads(self) -> None:
        """Complete gradients after the last slice (before clipping)."""


class LocalRunner:
    """The whole model on every rank of a dp group: plain, DistributedDataParallel or FSDP2."""

    def __init__(self, module: nn.Module, loss_fn: LossFn | None,
                 precision: Precision | None = None):
        self.module = module
        self.loss_fn = loss_fn
        self.precision = precision or Precision()

    def _no_sync(self, sync: bool):
        if not sync and isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()  # skip the all-reduce of this slice's gradients
        return nullcontext()

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        if isinstance(self.module, FSDPModule):  # reduce-scatter only on the last slice
            self.module.set_requires_gradient_sync(sync_grads)
        weight = scale if tokens is None else tokens.weight(batch)
        batch = batch if tokens is None else tokens.guard(batch)
        with self._no_sync(sync_grads):
            with self.precision.autocast():  # forward and loss; backward outside autocast
                loss = forward_loss(self.module, batch, self.loss_fn)
            grad_loss = self.precision.loss_for_backward(loss)  # fp32 (x the fp16 scale)
            (grad_loss * weight if tokens is not None or scale != 1 else grad_loss).backward()
        return loss.detach().double() * weight

    def finish_grads(self) -> None:
        pass

    def evaluate(self, batch: Batch, tokens: Weights | None = None) -> torch.Tensor:
        """Forward and loss only, in eval mode, under the training precision (x the batch's
        token weight when given)."""
        model = self.module
        was_training = model.training
        model.eval()
        weight = None if tokens is None else tokens.weight(batch)
        batch = batch if tokens is None else tokens.guard(batch)
        try:
            with self.precision.autocast():
                loss = forward_loss(model, batch, self.loss_fn).detach()
        finally:
            model.train(was_training)
        return loss if weight is None else loss.double() * weight


@dataclass
class NormWeights:
    """How often each parameter's squared gradient norm is counted across the mesh, so that the
    clipped norm is the single-process one: `weights[i]` = 1 / (number of tp and pp ranks holding
    the same values of `params[i]`); `dp_sharded` when local values are disjoint over dp (FSDP2)."""

    params: list[nn.Parameter]
    weights: list[float]
    dp_sharded: bool = False


def clip_grad_norm(nw: NormWeights, max_norm: float, info: MeshInfo) -> torch.Tensor:
    """Scale gradients so that their global 2-norm is at most `max_norm`; return that norm.

    Weighted local squared norms are summed over tp, pp and (FSDP2) dp, so every rank computes
    the norm of the full single-process gradient and applies the same factor.
    """
    total = torch.zeros((), dtype=torch.float64, device=_device(info))
    grads = []
    for p, w in zip(nw.params, nw.weights, strict=True):
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        grads.append(g)
        total += w * g.detach().double().pow(2).sum().to(total.device)
    for dim in ("tp", "pp") + (("dp",) if nw.dp_sharded else ()):
        if getattr(info, dim) > 1:
            dist.all_reduce(total, group=info.group(dim))
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return norm.float()


def reduce_loss(loss: torch.Tensor, info: MeshInfo) -> float:
    """The step's loss on every rank: summed over pp (only the rank with the last stage has a
    non-zero value), averaged over dp."""
    value = loss.detach().double().reshape(1).to(_device(info))
    if info.pp > 1:
        dist.all_reduce(value, group=info.group("pp"))
    if info.dp > 1:
        dist.all_reduce(value, group=info.group("dp"))
        value /= info.dp
    return float(value.item())


def _device(info: MeshInfo) -> torch.device:
    if info.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class StepConfig:
    """What `build` decided about the step (see its docstring)."""

    info: MeshInfo
    grad_accum: int = 1
    grad_clip: float | None = None
    num_microbatches: int = 1
    batch_is_global: bool = True
    # what the step knows of the loss (label shift, `num_items_in_batch`, a user loss_fn):
    # `token_mean.ModelLoss`; the default, nothing known, keeps the mean over units
    loss: ModelLoss = ModelLoss()

    def units(self) -> int:
        """How many units (accumulation slices x micro-batches, on every dp rank) one step's
        loss is made of."""
        return self.grad_accum * self.num_microbatches * self.info.dp


@dataclass
class TrainState:
    """Everything `train_step` needs besides the model's own modules.

    A plain object (not a Module) kept in the model's `__dict__`: the runner holds the DDP
    wrapper, whose `.module` is the model itself, so registering it as a child would list every
    parameter twice and make the module tree a cycle. `inside_wrapper` counts the DDP forwards
    in flight (see `TrainModule.__call__`)."""

    optimizer: torch.optim.Optimizer | None
    runner: Runner
    step_config: StepConfig
    norm_weights: NormWeights
    precision: Precision
    wrapper: nn.Module | None = None  # the DDP wrapper `model(...)` runs through, if any
    inside_wrapper: int = 0


# Names a built model gains; `build` refuses a model that already uses any of them.
TRAIN_ATTRIBUTES = ("train_step", "eval_step", "local_batch", "optimizer", "runner",
                    "step_config", "precision", "_slapo_train")


class TrainModule:
    """What `build` returns: the model, able to train itself with `model.train_step(batch)`.

    Without a pipeline the returned object IS the user's module (`slapo.build` swaps its class
    for a generated subclass of (TrainModule, its class), see `make_trainable`): `isinstance`
    with the model's class holds, `named_parameters()` / `state_dict()` have the model's own
    keys, attributes are the model's. It also has `train_step`, `optimizer`, `runner`,
    `step_config`, `precision` and `local_batch`. With a pipeline no rank holds the whole
    model, so `build` returns a `PipelineTrainModule` (this rank's stages) instead; both are
    instances of `TrainModule`.

    `model(...)` runs the forward the way `train_step` does: through DistributedDataParallel
    when DDP is on (so a hand-written loop's `backward()` all-reduces gradients, as with a
    DDP-wrapped model; every dp rank must call it), as FSDP2's sharded forward under FSDP2
    (which changed the class in place). It runs without autocast, like the model's own forward.
    """

    @property
    def _slapo(self) -> TrainState:
        return self.__dict__["_slapo_train"]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._slapo.optimizer

    @property
    def runner(self) -> Runner:
        """Runs forward and backward of one slice (`runner.module`: the DDP/FSDP2 module)."""
        return self._slapo.runner

    @property
    def step_config(self) -> StepConfig:
        return self._slapo.step_config

    @property
    def precision(self) -> Precision:
        return self._slapo.precision

    # ---- the model --------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        """Through the DDP wrapper, unless DDP itself is calling (its forward calls us)."""
        state = self.__dict__.get("_slapo_train")
        if state is None or state.wrapper is None or state.inside_wrapper:
            return super().__call__(*args, **kwargs)
        return state.wrapper(*args, **kwargs)

    def __deepcopy__(self, memo):
        """A copy is the plain module (the training state, with its optimizer, DDP wrapper and
        process groups, is not copyable): the model's class and values, without `train_step`."""
        cls = type(self)
        if not hasattr(cls, "_slapo_base"):
            raise SchedulingError("", f"a {cls.__name__} cannot be copied.",
                                  "copy the model before slapo.build.")
        state = self.__dict__.pop("_slapo_train")
        self.__class__ = cls._slapo_base
        try:
            return copy.deepcopy(self, memo)
        finally:
            self.__class__ = cls
            self.__dict__["_slapo_train"] = state

    # ---- the step ---------------------------------------------------------------------------
    def local_batch(self, batch: Batch) -> Batch:
        """This dp rank's samples when the same global batch is given on every rank."""
        cfg = self.step_config
        info = cfg.info
        factors = {"data-parallel ranks": info.dp if cfg.batch_is_global else 1,
                   "grad_accum": cfg.grad_accum, "num_microbatches": cfg.num_microbatches}
        check_divisible(batch, {k: v for k, v in factors.items() if v > 1})
        if not cfg.batch_is_global or info.dp == 1:
            return batch
        size = batch_size(batch) // info.dp
        return slice_batch(batch, info.dp_rank * size, (info.dp_rank + 1) * size)

    def train_step(self, batch: Batch) -> float:
        """Forward, backward, (unscale, clip), optimizer step; the batch's mean loss on every
        rank. With fp16 the step may be skipped (inf/NaN gradients on some rank): see
        `self.precision.last_step_skipped` / `.skipped_steps`; the loss is returned either way."""
        state = self._slapo
        if state.optimizer is None:
            raise SchedulingError("", "train_step needs an optimizer.",
                                  "pass build(sch, optimizer=torch.optim.AdamW, ...).")
        cfg = state.step_config
        batch = self.local_batch(as_batch(batch))  # any Mapping (HF BatchEncoding) -> dict
        state.optimizer.zero_grad(set_to_none=True)
        state.precision.begin_step()
        k = cfg.grad_accum
        parts = split_batch(batch, k) if k > 1 else [batch]
        tokens = token_mean(cfg.loss, parts, cfg.info, cfg.units())
        loss = None  # stays on the loss's device: no host sync before the optimizer step
        for i, part in enumerate(parts):
            part_loss = state.runner.forward_backward(part, 1.0 / k, sync_grads=i == k - 1,
                                                      tokens=tokens).double()
            loss = part_loss if loss is None else loss + part_loss
        state.runner.finish_grads()
        state.precision.unscale_(state.optimizer)
        if cfg.grad_clip is not None:
            clip_grad_norm(state.norm_weights, cfg.grad_clip, cfg.info)
        state.precision.step(state.optimizer)
        return reduce_loss(loss, cfg.info)

    @torch.no_grad()
    def eval_step(self, batch: Batch) -> float:
        """The batch's mean loss, forward only, in eval mode (no dropout), under the training
        precision, on every rank; takes the same batch as `train_step` (global or local) and
        changes nothing. Works with a pipeline too (the schedule's forward-only `eval`): the
        one way `slapo train` computes its val loss. Collective: every rank calls it."""
        state = self._slapo
        cfg = state.step_config
        batch = self.local_batch(as_batch(batch))
        tokens = token_mean(cfg.loss, [batch], cfg.info,
                            cfg.num_microbatches * cfg.info.dp)
        return reduce_loss(state.runner.evaluate(batch, tokens), cfg.info)


# ------------------------------------------------------------------------------------------------
# the user's module becomes trainable in place
# ------------------------------------------------------------------------------------------------

_TRAIN_CLASSES: dict[type, type] = {}


def _user_class(cls: type) -> type:
    """The user's class behind Slapo's patch class and FSDP2's generated `FSDP<Name>`."""
    original = getattr(cls, "_slapo_original_class", None)
    if original is not None:
        return original
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def _train_class(cls: type) -> type:
    """The cached subclass (TrainModule, cls). It keeps the user's `__name__` (repr, HF's
    `save_pretrained` writes it into `config.architectures`); `__qualname__` says what it is."""
    new = _TRAIN_CLASSES.get(cls)
    if new is None:
        user = _user_class(cls)
        attrs = {"__module__": user.__module__, "__qualname__": f"TrainModuleOf{user.__name__}",
                 "_slapo_base": cls, "_slapo_original_class": user}
        if hasattr(cls, "save_pretrained"):  # HF models: write whole tensors (runtime/save.py)
            attrs["save_pretrained"] = _save_pretrained
        new = type(user.__name__, (TrainModule, cls), attrs)
        _TRAIN_CLASSES[cls] = new
    return new


def _save_pretrained(self, save_directory, *args, **kwargs):
    """Hugging Face's `save_pretrained`, with whole tensors: a TP-sharded or FSDP2 model is
    gathered first (a collective: call it on every rank; rank 0 writes). See runtime/save.py."""
    from .save import save_pretrained_whole

    base = type(self)._slapo_base.save_pretrained
    return save_pretrained_whole(self, lambda *a, **k: base(self, *a, **k), save_directory,
                                 *args, **kwargs)


def check_trainable(module: nn.Module) -> None:
    """Refuse (before anything changes) a model that already has a name `build` adds."""
    if isinstance(module, TrainModule):
        return  # built before: its training state is replaced
    own = set(module.__dict__) | set(module._modules) | set(module._parameters) | set(
        module._buffers)
    taken = [n for n in TRAIN_ATTRIBUTES if n in own or hasattr(type(module), n)]
    if taken:
        raise SchedulingError("", f"{type(module).__name__} already has "
                              f"{', '.join(map(repr, taken))}, which slapo.build adds to the "
                              "model it returns.", "rename that attribute of the model.")


def _count_wrapper_calls(wrapper: nn.Module, state: TrainState) -> None:
    """Mark DDP's forwards, so that `model(...)` inside them runs the module itself."""

    def enter(module, args):
        state.inside_wrapper += 1

    def leave(module, args, output):
        state.inside_wrapper -= 1

    wrapper.register_forward_pre_hook(enter)
    wrapper.register_forward_hook(leave, always_call=True)


def make_trainable(module: nn.Module, state: TrainState) -> TrainModule:
    """Give `module` (the same object) `train_step` and the rest, by swapping its class for
    `TrainModuleOf<Name>`; call `check_trainable` first. Idempotent on a built module."""
    if state.wrapper is not None:
        _count_wrapper_calls(state.wrapper, state)
    module.__dict__["_slapo_train"] = state
    if not isinstance(module, TrainModule):
        module.__class__ = _train_class(type(module))
    return module


class PipelineTrainModule(TrainModule, nn.Module):
    """What `build` returns with a pipeline: this rank's stages, which no `model(...)` can run
    (no rank holds the whole model; 2023 returned DeepSpeed's pipeline engine for the same
    reason). `train_step` runs the pipeline schedule; `stages` are this rank's stage modules
    (each keeps the full model's parameter names); `state_dict` is their union."""

    def __init__(self, stages: Iterable[nn.Module], state: TrainState):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.__dict__["_slapo_train"] = state

    def forward(self, *args, **kwargs):
        raise SchedulingError("", "this model is split into pipeline stages, so no rank can "
                              "run the whole forward.", "use model.train_step(batch).")

    def save_pretrained(self, *args, **kwargs):
        from .save import refuse_pipeline_save

        refuse_pipeline_save()

    def _units(self) -> list[nn.Module]:
        """This rank's stages without a DDP wrapper."""
        return [u.module if isinstance(u, DistributedDataParallel) else u for u in self.stages]

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The union of this rank's stages' state dicts under the full model's keys (no
        `stages.` prefix), so a checkpoint loads into the bare model. FSDP2 values are
        DTensors."""
        out = destination if destination is not None else {}
        for unit in self._units():
            unit.state_dict(destination=out, prefix=prefix, keep_vars=keep_vars)
        return out

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load original-key state dicts: each stage takes the keys it holds (keys of other
        ranks' stages are expected and ignored)."""
        missing: list[str] = []
        for unit in self._units():
            own = unit.state_dict(keep_vars=True).keys()
            result = unit.load_state_dict({k: v for k, v in state_dict.items() if k in own},
                                          strict=False, assign=assign)
            missing += result.missing_keys
        if strict and missing:
            raise RuntimeError(f"missing keys for this rank's pipeline stages: {missing}")
        return nn.modules.module._IncompatibleKeys(missing, [])


# ------------------------------------------------------------------------------------------------
# timing: the one place a caller measures `train_step` (tune trials, the progressive demo)
# ------------------------------------------------------------------------------------------------

@dataclass
class StepTimes:
    """Wall seconds and loss of each `train_step` that `time_steps` ran, in order."""

    seconds: list[float]
    losses: list[float]

    def fastest(self, skip: int = 0) -> float:
        """The least disturbed estimate of a step's cost: on a shared machine other jobs only
        ever add time, so the minimum after `skip` warm-up steps (NaN when none is left)."""
        rest = self.seconds[skip:]
        return min(rest) if rest else float("nan")


def _synchronize(model: nn.Module) -> None:
    """Wait for the accelerator, so the clock covers the work the step queued."""
    for p in model.parameters():
        if p.device.type == "cuda":
            torch.cuda.synchronize(p.device)
        return


def _barrier(enabled: bool) -> None:
    if enabled and dist.is_available() and dist.is_initialized():
        dist.barrier()


def time_steps(model: TrainModule, batches: Iterable[Batch], *,
               barrier: bool = False) -> StepTimes:
    """Run `model.train_step(batch)` for each batch; return each step's seconds and loss.

    Why a helper: tune trials and `slapo train --progressive` time exactly the step `slapo
    train` runs, and time it the same way: the device is synchronised before each clock read
    (queued kernels count). `barrier=True` aligns the ranks before and after each step, so
    every rank reports the slowest rank's time (a tensor-parallel step is a collective; a rank
    that started late would otherwise look slow)."""
    seconds, losses = [], []
    for batch in batches:
        _barrier(barrier)
        _synchronize(model)
        t0 = time.perf_counter()
        loss = model.train_step(batch)
        _synchronize(model)
        _barrier(barrier)
        seconds.append(time.perf_counter() - t0)
        losses.append(loss)
    return StepTimes(seconds, losses)
