"""Record the init a model's constructor writes into its meta tensors, for `materialize`.

Why: under `init_empty_weights()` a constructor's own init runs on meta tensors, i.e. computes
nothing. Hugging Face models re-run theirs (`_init_weights`), but a plain `nn.Module` often
initialises in `__init__` only: torchvision's ResNet (Kaiming-normal fan-out convolutions,
zero-init residual BatchNorms), nanoGPT (`self.apply(self._init_weights)` and the scaled
`c_proj` init). `materialize` would otherwise fall back to each module's `reset_parameters`,
and the delayed model would train from another init than the one its author wrote, silently.

While `init_empty_weights()` is active, a dispatch mode sees every in-place write into a meta
tensor (with the resolved scalars: a Kaiming std, a fill value) and keeps it per storage, in
the same form as `record.Recorder` (so `replay` cuts it to a shard); parameters and buffers
registered meanwhile are remembered, and on exit each one that was written gets its writes as
`tensor._slapo_init` (a `ConstructorInit`). `shard` and `deepcopy_model` carry the record.
What cannot be replayed exactly (a write computed from another meta tensor; torch's
`trunc_normal_`, `orthogonal_`, `sparse_` and `dirac_`, which return early on meta tensors and
are watched by name) marks the tensor's record failed with the reason.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .record import Op, _storage_key, _tensors, replayable

# torch.nn.init functions that return early on a meta tensor (no op reaches dispatch)
SILENT_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@dataclass
class ConstructorInit:
    """What the constructor wrote into one tensor (full-shape coordinates), or why not."""

    ops: list[Op] = field(default_factory=list)
    failed: str | None = None


class _Watch(TorchDispatchMode):
    """Passes every op through; records in-place writes into meta tensors per storage."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, ConstructorInit] = {}
        self.shapes: dict[int, tuple[int, ...]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in _tensors(value):
                if t.device.type == "meta":
                    self._record(t, func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, target: torch.Tensor, func, args, kwargs) -> None:
        key = _storage_key(target)
        base = target._base if target._base is not None else target
        shape = self.shapes.setdefault(key, tuple(base.shape))
        rec = self.records.setdefault(key, ConstructorInit())
        if rec.failed is None:
            op, rec.failed = replayable(func, target, target, shape, args, kwargs)
            if op is not None:
                rec.ops.append(op)

    def fail(self, t: torch.Tensor, reason: str) -> None:
        rec = self.records.setdefault(_storage_key(t), ConstructorInit())
        rec.failed = rec.failed or reason


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Active inside `init_empty_weights()`: see the module docstring."""
    watch = _Watch()
    registered: list[weakref.ref] = []

    def remember(module, name, tensor):
        if tensor is not None:
            registered.append(weakref.ref(tensor))

    hooks = [nn.modules.module.register_module_parameter_registration_hook(remember),
             nn.modules.module.register_module_buffer_registration_hook(remember)]
    saved = {n: getattr(nn.init, n) for n in SILENT_ON_META}
    for name, fn in saved.items():
        setattr(nn.init, name, _watched(fn, name, watch))
    try:
        with watch:
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
        for h in hooks:
            h.remove()
        for ref in registered:
            t = ref()
            if t is not None and t.device.type == "meta":
                rec = watch.records.get(_storage_key(t))
                if rec is not None and (rec.ops or rec.failed):
                    t._slapo_init = rec


def _watched(fn, name: str, watch: _Watch):
    def run(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.device.type == "meta":
            watch.fail(tensor, f"torch.nn.init.{name} does nothing on a meta tensor, so the "
                               "constructor's values cannot be recorded")
        return fn(tensor, *args, **kwargs)

    run.__wrapped__ = fn
    return run


def constructor_init(t: torch.Tensor) -> ConstructorInit | None:
    return getattr(t, "_slapo_init", None)
