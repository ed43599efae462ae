"""Give a module new execution behaviour without changing its structure.

Primitives such as `checkpoint`, `fork_rng`, row-parallel `shard` and `decompose` change *how* a
module runs, but must keep *what it is*: the same object, the same submodules, the same parameter
names (so `state_dict` keys, optimizer state and user references stay valid). We do that by
swapping the instance's class for a cached subclass that keeps the original name and runs:

    wrappers[-1]( ... wrappers[0]( kernel or original forward ) ... )

- the *kernel* (at most one) replaces the original forward computation (e.g. a row-parallel
  Linear that reduces before adding its bias);
- *wrappers* (checkpoint, fork_rng, ...) wrap the call, in the order they were applied.

Both are plain objects stored on the instance, so `deepcopy` and `torch.compile` see through them.

The patched class's `forward` keeps the original forward's signature (`__signature__`, and its
name and docstring): callers decide what to pass by reading it. Hugging Face's `generate` passes
`position_ids` (and `logits_to_keep`, an encoder's arguments, ...) only to a forward whose
signature names them; with `(*args, **kwargs)` left-padded prompts were generated with the
wrong positions (issue 29).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch.nn as nn

_PATCHED_CLASSES: dict[type, type] = {}


class ForwardWrapper:
    """Wraps a module's forward. Subclasses implement `__call__(module, fn, args, kwargs)`."""

    name = "wrapper"

    def __call__(self, module: nn.Module, fn: Callable, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def __deepcopy__(self, memo):  # stateless w.r.t. the module; may hold process groups
        return self


class Kernel:
    """Replaces a module's forward computation. Subclasses implement `__call__(module, *a, **k)`."""

    name = "kernel"

    def __call__(self, module: nn.Module, *args, **kwargs) -> Any:
        raise NotImplementedError

    def __deepcopy__(self, memo):
        return self


class _SlapoPatched:
    """Mixin placed first in the MRO of a patched module class."""

    _slapo_patched = True

    def forward(self, *args, **kwargs):
        kernel = self.__dict__.get("_slapo_kernel")
        if kernel is not None:

            def fn(*a, **k):
                return kernel(self, *a, **k)
        else:
            fn = super().forward
        for wrapper in self.__dict__.get("_slapo_wrappers", ()):
            fn = _bind(wrapper, self, fn)
        return fn(*args, **kwargs)


def _bind(wrapper: ForwardWrapper, module: nn.Module, inner: Callable) -> Callable:
    def call(*a, **k):
        return wrapper(module, inner, a, k)

    return call


def _forward_like(original: Callable) -> Callable:
    """The patched `forward` (`_SlapoPatched.forward`) dressed as `original`: its signature,
    name and docstring, so `inspect.signature(module.forward)` is the original's. No
    `__wrapped__`: code that unwraps (dynamo, `inspect.unwrap`) must find the patched call, not
    skip the wrappers and kernel."""

    def forward(self, *args, **kwargs):
        return _SlapoPatched.forward(self, *args, **kwargs)

    for attr in ("__name__", "__qualname__", "__doc__"):
        value = getattr(original, attr, None)
        if value is not None:
            setattr(forward, attr, value)
    try:
        forward.__signature__ = inspect.signature(original)
    except (TypeError, ValueError):  # no signature to read (a builtin): keep the generic one
        pass
    return forward


def _patched_class(cls: type) -> type:
    if getattr(cls, "_slapo_patched", False):
        return cls
    new = _PATCHED_CLASSES.get(cls)
    if new is None:
        new = type(cls.__name__, (_SlapoPatched, cls), {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_slapo_original_class": cls,
            "forward": _forward_like(cls.forward),
        })
        _PATCHED_CLASSES[cls] = new
    return new


def patch(module: nn.Module) -> nn.Module:
    """Swap `module`'s class for its patched twin (idempotent)."""
    module.__class__ = _patched_class(type(module))
    module.__dict__.setdefault("_slapo_wrappers", [])
    return module


def original_class(module: nn.Module) -> type:
    return getattr(type(module), "_slapo_original_class", type(module))


def add_wrapper(module: nn.Module, wrapper: ForwardWrapper) -> None:
    patch(module)
    module._slapo_wrappers = [*module._slapo_wrappers, wrapper]


def wrappers(module: nn.Module) -> list[ForwardWrapper]:
    return list(module.__dict__.get("_slapo_wrappers", ()))


def set_kernel(module: nn.Module, kernel: Kernel | None) -> None:
    patch(module)
    module._slapo_kernel = kernel


def kernel(module: nn.Module) -> Kernel | None:
    return module.__dict__.get("_slapo_kernel")


def module_meta(module: nn.Module, create: bool = False) -> dict:
    """Scheduling facts about a module object (its output layout, applied syncs).

    Kept on the module, not the schedule node: one module may appear at several paths (T5's
    shared embedding is `shared`, `encoder.embed_tokens` and `decoder.embed_tokens`), and a sync
    applied through one path must be seen through the others."""
    if create:
        return module.__dict__.setdefault("_slapo_meta", {})
    return module.__dict__.get("_slapo_meta", {})
