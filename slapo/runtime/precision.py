"""Mixed precision for the training step: one `Precision` object owns autocast and loss scaling.

One vocabulary from `slapo train --precision` to autocast: the name is `precision`, its values
are `PRECISIONS` ("fp32", "bf16", "fp16"), `check_precision` is the one check (and the one place
where None, the older spelling of "fp32", is translated), and `Precision(precision)` is the one
object that acts on it. `build(sch, ..., precision="bf16")` checks the name once and hands one
`Precision` to the step loop (`Trainer.train_step`) and its runner; nothing else knows about
dtypes. (`build(mixed_precision=...)`, `Verify(mixed_precision=...)` and
`progressive.run(mixed_precision=...)` take the earlier keyword at the public edge:
`precision_arg`.)

- **Master weights and optimizer state stay fp32.** Parameters are never cast; the optimizer
  sees the fp32 parameters and fp32 gradients.
- **Forward and loss run under `torch.autocast(device_type, dtype)`**: matmuls in bf16/fp16 on
  fp32 weights cast on the fly (cached once per forward), reductions such as softmax, layer norm
  and cross-entropy kept in fp32 by autocast's op lists. Backward runs *outside* autocast (as
  PyTorch recommends); autograd replays the dtypes the forward chose.
- **The loss** is taken in fp32 (`loss.float()`) before backward, so a model that returns a bf16
  loss trains exactly like one returning fp32 (HF upcasts its logits for the loss anyway).
- **fp16** adds a gradient scaler: the loss is multiplied by the scale before backward,
  gradients are unscaled before clipping, the optimizer step is skipped when any gradient on any
  rank is inf/NaN, and the scale is updated. Skipped steps are counted (`skipped_steps`,
  `last_step_skipped`). The scaler is torch's `ShardedGradScaler` over the whole mesh when there
  is more than one rank, so every rank (TP shards, pipeline stages, FSDP shards: different
  gradients) takes the same skip decision and keeps the same scale; `torch.amp.GradScaler`
  otherwise.
- **FSDP2**: `fsdp_policy()` gives `MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32)`,
  so the all-gather moves half the bytes and gradients are reduce-scattered in fp32 into fp32
  shards. Autocast still wraps the forward: with bf16 parameters its weight casts are no-ops,
  but it keeps the ops on its fp32 list (softmax, layer/RMS norm on CUDA, losses) in fp32, which
  the policy alone would run in bf16. The two together therefore match the plain (DDP or
  one-process) autocast run within bf16 roundoff; the remaining difference is that weights outside
  autocast's low-precision list (norm weights, embeddings, biases added outside a matmul) are
  rounded to bf16 by the all-gather.
- **Pipelines**: `wrap_forward(stage)` runs each stage's forward under autocast (stage forwards
  are called by torch's schedule, not by us), and the pipeline's loss runs under `autocast()`.
  torch's metadata inference calls the same (wrapped) forward, so the inferred activation
  dtypes are the ones the real micro-batches have.

**fp8** is bf16 as above plus FP8 GEMMs in the Linear / Conv1D layers that gain: `build` checks
it (`check_fp8`: torchao imports, the device has FP8 or is the CPU, emulated) with the rest of its
arguments and converts after weights are placed and before data parallelism wraps them
(`Precision.convert`, after TP sharding, so scales are per shard); see `runtime/fp8.py`.

fp16 on CPU: torch's CPU autocast supports float16 (2.13; checked at build time by entering
autocast once: a device/dtype pair autocast does not support is refused with a clear error
rather than silently running fp32). It is slow on CPUs without native fp16, but correct, so it
is allowed; bf16 is the recommended CPU (and H100) precision.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from .mesh import local_device

PrecisionName = Literal["fp32", "bf16", "fp16", "fp8"]  # the type of a checked precision name
PRECISIONS: tuple[str, ...] = get_args(PrecisionName)  # the one list: --precision, build, tune
# autocast's dtype (fp32: no autocast); fp8 is bf16 autocast plus FP8 GEMMs (runtime/fp8.py)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


class PrecisionError(SchedulingError):
    """A precision name outside `PRECISIONS`; `value` is what was given."""

    def __init__(self, value: object, arg: str):
        self.value = value
        super().__init__("", f"{arg}={value!r} is not supported.",
                         "use 'fp32' (the default), 'bf16', 'fp16' or 'fp8'.")


def check_precision(value: object, arg: str = "precision") -> PrecisionName:
    """The one check of a precision name: return it ("fp32", "bf16", "fp16", "fp8"), None read as
    "fp32" (its earlier spelling); anything else raises `PrecisionError` naming `arg`.

    `build` calls it first thing, on every rank, so a bad value fails before anything is
    placed, wrapped or communicated; `TrainConfig.check` calls it for `--precision`."""
    if value is None:
        return "fp32"
    if isinstance(value, str) and value in PRECISIONS:
        return value
    raise PrecisionError(value, arg)


def precision_arg(precision: str | None, mixed_precision: str | None) -> PrecisionName:
    """The precision a public entry point was given: `precision=`, or `mixed_precision=` (the
    earlier keyword, accepted at the edge only); both given (and different) is refused."""
    if mixed_precision is None:
        return check_precision(precision)
    if precision not in (None, "fp32"):
        raise SchedulingError("", f"precision={precision!r} and mixed_precision="
                              f"{mixed_precision!r} both given.", "pass precision= only "
                              "(mixed_precision is its earlier name).")
    return check_precision(mixed_precision, "mixed_precision")


def check_autocast(precision: str, device_type: str) -> None:
    """Refuse a (device, dtype) pair that autocast would silently ignore (it only warns)."""
    if precision == "fp32":
        return
    try:
        available = torch.amp.is_autocast_available(device_type)
    except RuntimeError:  # not a device type at all
        available = False
    if not available:
        raise SchedulingError("", f"precision={precision!r}: torch has no autocast for device "
                              f"type {device_type!r}.", "use a cpu or cuda device, or "
                              "precision='fp32'.")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast(device_type, dtype=DTYPES[precision]):
            enabled = torch.is_autocast_enabled(device_type)
    if not enabled or any("not supported" in str(w.message) for w in caught):
        raise SchedulingError("", f"precision={precision!r}: this torch's {device_type} "
                              f"autocast does not support {DTYPES[precision]}.",
                              "use 'bf16' (supported on CPU and recent GPUs).")


def check_fp8_config(precision: str, fp8: object, device_type: str):
    """`build`'s `fp8=` against its precision: the checked `Float8Config` for "fp8" (torchao
    imported, the device able: `runtime.fp8.check_fp8`), None otherwise (an `fp8=` given
    with another precision is refused: it would silently do nothing)."""
    if precision == "fp8":
        from .fp8 import check_fp8

        return check_fp8(fp8, device_type)
    if fp8 is not None:
        raise SchedulingError("", f"fp8={fp8!r} given with precision={precision!r}.",
                              "pass precision='fp8' with it, or drop fp8=.")
    return None


def module_device_type(*modules: nn.Module, default: str = "cpu") -> str:
    """The device type of the first parameter (or buffer) found: where autocast must act."""
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if t.device.type != "meta":
                return t.device.type
    return default


class Precision:
    """Autocast context and (fp16) loss scaling for one trained model; see the module doc.

    `name`: a checked precision (`check_precision`): "fp32" (every method is a no-op
    pass-through), "bf16" or "fp16". `group`: the process group every rank of the job is in
    (the scaler's inf/NaN check is reduced over it); None for one process.
    """

    def __init__(self, name: PrecisionName = "fp32", device_type: str = "cpu", group=None,
                 fp8=None):
        self.name = name
        self.device_type = device_type
        self.fp8 = fp8  # fp8: the checked `Float8Config` (`check_fp8`); None otherwise
        self.fp8_modules: list[str] = []  # fp8: the paths `convert` gave FP8 GEMMs
        self.dtype = None if name == "fp32" else DTYPES[name]  # fp32: no autocast
        self.scaler = self._make_scaler(group) if name == "fp16" else None
        self.skipped_steps = 0
        self.last_step_skipped = False

    def _make_scaler(self, group):
        if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device_type, process_group=group)
        return torch.amp.GradScaler(self.device_type)

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device_type={self.device_type!r})"

    # ---- the model ------------------------------------------------------------------------
    def convert(self, modules: list[nn.Module], root: nn.Module) -> list[str]:
        """fp8: give the selected GEMMs of `modules` (the model, or this rank's pipeline
        stages; `root` the whole model) torchao's FP8 matmul; a no-op for other precisions.
        `build` calls it after the weights are placed (and TP sharded), before DDP/FSDP2."""
        if self.fp8 is not None:
            from .fp8 import convert

            self.fp8_modules = convert(modules, root, self.fp8, self.device_type)
        return self.fp8_modules

    # ---- forward --------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward/loss context: autocast to `dtype`, or nothing for fp32."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def wrap_forward(self, module: nn.Module) -> nn.Module:
        """Run `module.forward` under `autocast()` from now on (same module object, so DDP /
        FSDP2 / pipeline code that checks its type keeps working); returns the module."""
        if self.dtype is None:
            return module
        inner = module.forward

        @functools.wraps(inner)
        def forward(*args, **kwargs):
            with self.autocast():
                return inner(*args, **kwargs)

        module.forward = forward
        return module

    def fsdp_policy(self):
        """FSDP2's MixedPrecisionPolicy for this precision (None for fp32: FSDP's default)."""
        if self.dtype is None:
            return None
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    # ---- backward and step ----------------------------------------------------------------
    def loss_for_backward(self, loss: torch.Tensor) -> torch.Tensor:
        """The tensor to call `.backward()` on: the loss in fp32, times the scale for fp16.
        (For fp32 and an fp32 loss this is `loss` itself, so nothing changes.)"""
        if self.dtype is None:
            return loss
        loss = loss.float()
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def begin_step(self) -> None:
        """Make sure the scaler's scale exists on this rank, also where no loss is computed
        (pipeline ranks without the last stage), so every rank can unscale and update."""
        if self.scaler is not None and self.scaler._scale is None:
            self.scaler.scale(torch.zeros((), device=local_device(self.device_type)))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide gradients by the scale (fp16), before clipping sees them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`optimizer.step()`, or for fp16 the scaler's step and update; False if skipped.

        A step is skipped exactly when the scaler backs off (found inf/NaN on some rank), which
        is when its scale decreases."""
        if self.scaler is None:
            optimizer.step()
            self.last_step_skipped = False
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.last_step_skipped = self.scaler.get_scale() < before
        self.skipped_steps += int(self.last_step_skipped)
        return not self.last_step_skipped

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The scaler's state (scale, growth tracker) and the skip count; JSON-able."""
        state: dict = {"precision": self.name, "skipped_steps": self.skipped_steps}
        if self.scaler is not None:
            state["scaler"] = {k: (float(v) if isinstance(v, float) else v)
                               for k, v in self.scaler.state_dict().items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(dict(state["scaler"]))


__all__ = ["DTYPES", "PRECISIONS", "Precision", "PrecisionError", "PrecisionName", "check_autocast",
           "check_fp8_config", "check_precision", "module_device_type", "precision_arg"]
