"""Live tensor bytes on any device, including CPU (which has no allocator statistics).

Why: PyTorch exposes no peak-memory counter for CPU, and `tracemalloc` cannot see torch's
allocator. A `TorchDispatchMode` sees every tensor an op creates; tracking each new storage until
it is garbage collected gives a deterministic "bytes alive" count independent of the allocator.
Read `current` right after the forward pass (what is kept for backward plus outputs) and `peak`
over forward and backward. Tensors created before entering (parameters, inputs) are not counted.

Limits: compiled (inductor) kernels are invisible to a dispatch mode; the mode then sees eager ops.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only


class LiveTensorBytes(TorchDispatchMode):
    """Track bytes of storages created inside the mode until they are freed.

    Example::

        with LiveTensorBytes() as live:
            loss = model(x).sum()
            after_fwd = live.current
            loss.backward()
        print(after_fwd, live.peak)
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[tuple[str, int], int] = {}

    def _free(self, key: tuple[str, int]) -> None:
        self.current -= self._live.pop(key, 0)

    @staticmethod
    def _key(t: torch.Tensor) -> tuple[str, int] | None:
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        if st.nbytes() == 0 or t.device.type == "meta":
            return None
        return (str(t.device), st.data_ptr())

    def _track(self, t: torch.Tensor, inputs: set[tuple[str, int]]) -> None:
        key = self._key(t)
        # In-place ops and views return an input's storage: that memory existed already.
        if key is None or key in self._live or key in inputs:
            return
        st = t.untyped_storage()
        n = st.nbytes()
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)

    def reset_peak(self) -> None:
        """Start a new peak window from the current live bytes."""
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inputs: set[tuple[str, int]] = set()

        def note(t: torch.Tensor) -> None:
            k = self._key(t)
            if k is not None:
                inputs.add(k)

        tree_map_only(torch.Tensor, note, (args, kwargs))
        out = func(*args, **kwargs)
        tree_map_only(torch.Tensor, lambda t: self._track(t, inputs), out)
        return out
