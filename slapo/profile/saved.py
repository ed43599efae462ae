"""Count the bytes autograd keeps for the backward pass.

Why this way: every memory claim of a schedule (checkpointing, Tempo layers, fused ops) is a claim
about what autograd *saves*. `torch.autograd.graph.saved_tensors_hooks` sees exactly those tensors,
on every device, without depending on the allocator. Two tensors that share a storage (a view and
its base, or an output that the next layer also saves) cost memory once, so bytes are de-duplicated
by storage. Parameters are not activations and are excluded.

A storage is counted only while it is alive: a saved tensor whose graph was freed before the end of
the region (a discarded branch) is not held for backward and is dropped from the total.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class SavedRecord:
    """One storage saved for backward: its size and the module that saved it first."""

    nbytes: int
    module: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    ref: Callable[[], Any]

    @property
    def alive(self) -> bool:
        return self.ref() is not None


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, storage pointer) identifying the memory behind `t`; None for empty/meta tensors."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
        return None
    if st.nbytes() == 0 or t.device.type == "meta":
        return None
    return (str(t.device), st.data_ptr())


def storage_keys(objs: Iterable[Any]) -> set[tuple[str, int]]:
    """Storage keys of tensors, and of every parameter and buffer of modules, in `objs`."""
    keys: set[tuple[str, int]] = set()
    for obj in objs:
        tensors: Iterable[torch.Tensor]
        if isinstance(obj, nn.Module):
            tensors = list(obj.parameters()) + list(obj.buffers())
        elif isinstance(obj, torch.Tensor):
            tensors = [obj]
        else:
            continue
        for t in tensors:
            k = storage_key(t)
            if k is not None:
                keys.add(k)
    return keys


class SavedTensorRecorder:
    """Context manager recording every tensor saved for backward inside it.

    `current_module` is a zero-argument callable naming the module that is running (the profiler
    passes its module stack); `exclude` holds storage keys never to count (parameters).
    Nested `saved_tensors_hooks` (e.g. non-reentrant checkpoint) take precedence inside their
    region, so a checkpointed block shows up only as the inputs checkpoint stashes, which is what
    it really keeps.
    """

    def __init__(
        self,
        exclude: set[tuple[str, int]] | None = None,
        current_module: Callable[[], str] | None = None,
    ):
        self.exclude = exclude or set()
        self.current_module = current_module or (lambda: "")
        self.records: dict[tuple[str, int], SavedRecord] = {}
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        k = storage_key(t)
        if k is not None and k not in self.exclude and k not in self.records:
            st = t.untyped_storage()
            self.records[k] = SavedRecord(
                nbytes=st.nbytes(),
                module=self.current_module(),
                dtype=t.dtype,
                shape=tuple(t.shape),
                ref=weakref.ref(st),
            )
        # A detached alias: same storage, but no reference back to the graph. Returning `t` itself
        # would make output -> grad_fn -> saved output a cycle that only the gc frees.
        return t.detach()

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedTensorRecorder:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
        self._hooks = None

    def alive(self) -> list[SavedRecord]:
        """Records whose storage still exists (i.e. is still held for backward)."""
        return [r for r in self.records.values() if r.alive]

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.alive())

    def per_module(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.alive():
            out[r.module] = out.get(r.module, 0) + r.nbytes
        return out


def saved_bytes(
    fn: Callable[..., Any], *args: Any, exclude: Iterable[Any] = (), **kwargs: Any
) -> int:
    """Bytes that one call `fn(*args, **kwargs)` leaves saved for backward.

    De-duplicated by storage. Parameters and buffers of `fn` (when it is a module, or a bound
    method of one), of module arguments and of everything in `exclude` (modules or tensors) are not
    counted. Input tensors the call saves *are* counted (pass them in `exclude` to drop them).
    The call runs with autograd enabled; its output is kept alive until the count is taken.
    """
    modules = [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Module)]
    owners: list[Any] = [fn, getattr(fn, "__self__", None), *modules, *exclude]
    rec = SavedTensorRecorder(exclude=storage_keys(owners))
    with torch.enable_grad(), rec:
        out = fn(*args, **kwargs)
    total = rec.total_bytes
    del out
    return total
