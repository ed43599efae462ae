"""What `slapo.build` returns, and how `model.train_step` reaches the `Trainer`.

Without a pipeline `build` returns the user's own module with its class unchanged: `attach`
puts the trainer's `train_step`, `eval_step`, `local_batch`, `optimizer`, `runner`,
`step_config` and `precision` in the instance's `__dict__` (instance attributes, not a
subclass), and three instance overrides where the model needs them:

- `forward`, only under DDP: `model(...)` runs through the DDP wrapper (a hand-written loop's
  `backward()` then all-reduces, as with a DDP-wrapped model). The wrapper holds `OwnForward`,
  which calls the module's own forward, so nothing re-enters and the module's hooks run once.
  The override keeps the own forward's signature (`__wrapped__`), which HF's `generate` reads;
- `save_pretrained` (HF models): whole tensors, gathered from TP/FSDP2 shards (`save.py`);
- `__deepcopy__`: `copy.deepcopy` looks it up on the instance; the copy is the plain module
  (the trainer, with its optimizer, DDP wrapper and process groups, is not copyable).

Why not a generated subclass (the class swap this replaced): `type(model)` stays the user's
class, which `type(m) is Cls` checks, HF's `config.architectures` and torch's own class swap
(FSDP2's `FSDP<Name>`, whose prefix HF strips) see; nothing is generated at run time, and what
build added is in `vars(model)`, removed again by `detach`.

With a pipeline no rank holds the whole model: `PipelineTrainModule` (Slapo's class) holds this
rank's stages and the trainer. `TrainModule` is the protocol both satisfy.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import SchedulingError
from .batch import Batch
from .precision import Precision
from .runner import Runner
from .save import refuse_pipeline_save, save_pretrained_whole
from .train_step import StepConfig
from .trainer import Trainer

# Names a built model gains; `build` refuses a model that already uses any of them.
TRAIN_ATTRIBUTES = ("train_step", "eval_step", "local_batch", "optimizer", "runner",
                    "step_config", "precision", "_slapo_built")
_RECORD = "_slapo_built"


@runtime_checkable
class TrainModule(Protocol):
    """What `slapo.build` returns: `isinstance(model, slapo.TrainModule)` holds for the user's
    module after build and for a `PipelineTrainModule`; the methods are the `Trainer`'s."""

    optimizer: torch.optim.Optimizer | None
    runner: Runner
    step_config: StepConfig
    precision: Precision

    def train_step(self, batch: Batch) -> float: ...

    def eval_step(self, batch: Batch) -> float: ...

    def local_batch(self, batch: Batch) -> Batch: ...


# ------------------------------------------------------------------------------------------------
# the user's module: the trainer attached as instance attributes
# ------------------------------------------------------------------------------------------------

@dataclass
class _Attachment:
    """What `attach` put in a module's `__dict__` (`added`) and the module's own instance
    values it shadowed (`shadowed`, e.g. a user's instance `forward`), so `detach` restores
    the module exactly."""

    trainer: Trainer
    added: dict[str, Any]
    shadowed: dict[str, Any]


def check_trainable(module: nn.Module) -> None:
    """Refuse (before anything changes) a model that already has a name `build` adds."""
    if _RECORD in module.__dict__:
        return  # built before: `attach` replaces its training attributes
    own = set(module.__dict__) | set(module._modules) | set(module._parameters) | set(
        module._buffers)
    taken = [n for n in TRAIN_ATTRIBUTES if n in own or hasattr(type(module), n)]
    if taken:
        raise SchedulingError("", f"{type(module).__name__} already has "
                              f"{', '.join(map(repr, taken))}, which slapo.build adds to the "
                              "model it returns.", "rename that attribute of the model.")


def detach(module: nn.Module) -> _Attachment | None:
    """Take a built module's training attributes off (its own values back); None if unbuilt."""
    record = module.__dict__.pop(_RECORD, None)
    if record is not None:
        for name in record.added:
            module.__dict__.pop(name, None)
        module.__dict__.update(record.shadowed)
    return record


def _reattach(module: nn.Module, record: _Attachment) -> None:
    module.__dict__.update(record.added)
    module.__dict__[_RECORD] = record


def attach(module: nn.Module, trainer: Trainer,
           ddp: DistributedDataParallel | None = None) -> nn.Module:
    """Give `module` (the same object, the same class) the trainer's methods and state; under
    DDP `ddp` is the wrapper (of `OwnForward(module)`) that `module(...)` runs through. Call
    `check_trainable` first; a module built before is detached first."""
    detach(module)
    added: dict[str, Any] = {
        "train_step": trainer.train_step, "eval_step": trainer.eval_step,
        "local_batch": trainer.local_batch, "optimizer": trainer.optimizer,
        "runner": trainer.runner, "step_config": trainer.step_config,
        "precision": trainer.precision,
        "__deepcopy__": functools.partial(_plain_deepcopy, module),
    }
    if ddp is not None:
        added["forward"] = _through(ddp, module.forward)
    if hasattr(type(module), "save_pretrained"):
        added["save_pretrained"] = _whole_tensors(module, module.save_pretrained)
    shadowed = {k: module.__dict__[k] for k in added if k in module.__dict__}
    _reattach(module, _Attachment(trainer, added, shadowed))
    return module


def _through(ddp: DistributedDataParallel, own_forward: Callable) -> Callable:
    """`module.forward` under DDP: the wrapper's forward (which calls `own_forward` through
    `OwnForward`), with `own_forward`'s signature and docstring."""

    @functools.wraps(own_forward)
    def forward(*args, **kwargs):
        return ddp(*args, **kwargs)

    return forward


def _whole_tensors(module: nn.Module, own_save: Callable) -> Callable:
    """Hugging Face's `save_pretrained`, with whole tensors: a TP-sharded or FSDP2 model is
    gathered first (a collective: call it on every rank; rank 0 writes). See runtime/save.py."""

    @functools.wraps(own_save)
    def save_pretrained(save_directory, *args, **kwargs):
        return save_pretrained_whole(module, own_save, save_directory, *args, **kwargs)

    return save_pretrained


def _plain_deepcopy(module: nn.Module, memo: dict) -> nn.Module:
    """`copy.deepcopy(model)`: the module as it was before build (its class and values,
    without the training attributes), by the default copy of the detached module."""
    record = detach(module)
    try:
        return copy.deepcopy(module, memo)
    finally:
        if record is not None:
            _reattach(module, record)


class OwnForward(nn.Module):
    """What DDP wraps for a whole model: the model as its only child, and the model's own
    forward. `model(...)` runs the model's hooks, then (its instance `forward`) the DDP
    wrapper, which calls this: the own forward, not `model(...)` again."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.__dict__["_own_forward"] = module.forward  # bound before `attach`
        ignored = getattr(module, "_ddp_params_and_buffers_to_ignore", None)
        if ignored:  # DDP reads the names it skips on the module it wraps: ours are prefixed
            self._ddp_params_and_buffers_to_ignore = [f"module.{n}" for n in ignored]

    def forward(self, *args, **kwargs):
        return self._own_forward(*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# a pipeline: Slapo's own module of this rank's stages
# ------------------------------------------------------------------------------------------------

class PipelineTrainModule(nn.Module):
    """What `build` returns with a pipeline: this rank's stages, which no `model(...)` can run
    (no rank holds the whole model; 2023 returned DeepSpeed's pipeline engine for the same
    reason). `train_step` runs the pipeline schedule (the `Trainer`'s); `stages` are this
    rank's stage modules (each keeps the full model's parameter names); `state_dict` is their
    union."""

    def __init__(self, stages: list[nn.Module], trainer: Trainer):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.__dict__["_trainer"] = trainer  # a plain object: never a child module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._trainer.optimizer

    @property
    def runner(self) -> Runner:
        return self._trainer.runner

    @property
    def step_config(self) -> StepConfig:
        return self._trainer.step_config

    @property
    def precision(self) -> Precision:
        return self._trainer.precision

    def train_step(self, batch: Batch) -> float:
        return self._trainer.train_step(batch)

    def eval_step(self, batch: Batch) -> float:
        return self._trainer.eval_step(batch)

    def local_batch(self, batch: Batch) -> Batch:
        return self._trainer.local_batch(batch)

    def forward(self, *args, **kwargs):
        raise SchedulingError("", "this model is split into pipeline stages, so no rank can "
                              "run the whole forward.", "use model.train_step(batch).")

    def save_pretrained(self, *args, **kwargs):
        refuse_pipeline_save()

    def __deepcopy__(self, memo):
        raise SchedulingError("", "a PipelineTrainModule (this rank's pipeline stages, with "
                              "their schedule and process groups) cannot be copied.",
                              "copy the model before slapo.build.")

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
