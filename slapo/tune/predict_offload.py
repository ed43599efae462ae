"""Activation offload (`offload_ratio`, the `offload` primitive) in the GPU cost model.

**Memory** is simulated through the primitive's own bookkeeping. Its CUDA path cannot run in
the fake step (the step's fake tensors are CPU tensors standing for CUDA ones, and the path
needs CUDA streams, events and pinned memory), so for one fake step `OffloadSim.installed`
runs every `OffloadWrapper`'s call as the primitive makes it (its saved-tensor hooks, its
`_Group` chain and its one-copy-per-tensor dedupe, `_Group.pack`) with only the copies swapped:
the pack hook applies the primitive's rule (saved tensors of at least `min_bytes`, no weight
storage) and keeps a host record that MemTracker does not see instead of the tensor, so the
device tensor is freed as soon as nothing else holds it; the primitive's own `_unpack` (its
one-group-ahead prefetch) runs unchanged, with `_prefetch` and `_to_device` allocating the
device copies that MemTracker does see (a prefetch when backward first reads the next layer,
or reaches the module after the last offloaded one, or the loss: the primitive's forward
hooks; a demand copy when read). A prefetched copy is freed with the backward node that last
read it, as the primitive does (its groups hold their tensors weakly, and the last unpack
hands the copy over). A compiled layer (a stand-in) packs the saved tensors of its recorded
partition (`record_with_saved`) at the end of its forward and unpacks them all at the start of
its backward, as AOTAutograd's `save_for_backward` does under the hooks; the triggers are
forward hooks, which run around a stand-in's forward too.

**Time**: every pack, prefetch, demand copy and first read of a prefetched copy is logged with
the step counter's position (`OffloadEvent`), and `exposed_copy_s` replays the log against one
host link (`DeviceConstants.host_bandwidth`) to find how long compute waits for copies
(docs/tune.md, "Activation offload in the GPU cost model").
"""

from __future__ import annotations

import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

KINDS = ("d2h", "prefetch", "demand", "use")


@dataclass(frozen=True)
class OffloadEvent:
    """One copy-related moment of the fake step: `kind` is "d2h" (a saved tensor packed: its
    copy to host is queued on the offload stream), "prefetch" (its copy back queued on the
    offload stream), "demand" (copied back on the compute stream when backward reads it, not
    prefetched) or "use" (backward reads a prefetched tensor). `at`: the step counter's
    (flops, fp8_flops, bytes, kernels) at that moment, the compute done before it."""

    kind: str
    key: int
    nbytes: int
    at: tuple[float, float, float, int]


@dataclass
class _Pinned:
    """The host copy of a packed tensor, as a record (nothing is allocated for it)."""

    key: int
    shape: tuple
    dtype: Any
    nbytes: int


class OffloadSim:
    """The offload primitive's pack/unpack with simulated copies, for one fake step."""

    def __init__(self, counter: Any):
        self.counter = counter  # predict_gpu._StepCounter: positions, and paused allocations
        self.events: list[OffloadEvent] = []
        self._keys = itertools.count()

    def _log(self, kind: str, pinned: _Pinned) -> None:
        c = self.counter
        self.events.append(OffloadEvent(kind, pinned.key, pinned.nbytes,
                                        (float(c.flops), float(c.fp8_flops), float(c.bytes),
                                         int(c.kernels))))

    @contextlib.contextmanager
    def installed(self, model: Any) -> Iterator[OffloadSim]:
        """While active, an offloaded module's forward packs through `_pack` (the wrapper's
        call as the primitive makes it, with weights told apart by storage: fake tensors have
        no data pointers); the primitive's unpack allocates device copies through `_prefetch`
        and `_to_device` below (the primitive's triggers, forward hooks, run as they are)."""
        import torch

        from ..primitives import offload

        original_unpack = offload._unpack

        def call(wrapper: Any, module: Any, fn: Callable, args: tuple, kwargs: dict) -> Any:
            if not torch.is_grad_enabled():
                return fn(*args, **kwargs)
            group = wrapper.new_group()
            weights = {p.untyped_storage()._cdata for p in module.parameters()}
            with torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(wrapper, weights, group, t), unpack):
                return fn(*args, **kwargs)

        def unpack(packed: Any) -> Any:
            copy = packed.copy if isinstance(packed, offload._Saved) else None
            prefetched = copy is not None and copy.back is not None and copy.reads == 0
            out = original_unpack(packed)  # the last read hands the copy over (freed with it)
            if prefetched:
                self._log("use", copy.host)
            return out

        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(offload._Group, "_last", None))
            stack.enter_context(mock.patch.object(offload.OffloadWrapper, "__call__", call))
            stack.enter_context(mock.patch.object(offload, "_unpack", unpack))
            stack.enter_context(mock.patch.object(offload, "_prefetch", self._prefetch))
            stack.enter_context(mock.patch.object(offload, "_to_device", self._to_device))
            self.unpack = unpack
            yield self

    def offloads(self, wrapper: Any, nbytes: int) -> bool:
        """The primitive's rule for a tensor of `nbytes` that is no weight (the fake step's
        tensors stand for CUDA ones: a wrapper offloads them when its devices name cuda)."""
        return "cuda" in wrapper.devices and nbytes >= wrapper.min_bytes

    def _pack(self, wrapper: Any, weights: set, group: Any, t: Any) -> Any:
        nbytes = t.numel() * t.element_size()
        if (not self.offloads(wrapper, nbytes) or t.is_sparse
                or t.untyped_storage()._cdata in weights):
            wrapper.stats.kept += 1
            return t
        return group.pack(t, self._copy_out)  # the primitive's dedupe, a record for the copy

    def _copy_out(self, src: Any) -> Any:
        from ..primitives import offload

        pinned = _Pinned(next(self._keys), tuple(src.shape), src.dtype,
                         src.numel() * src.element_size())
        self._log("d2h", pinned)
        return offload._OnHost(pinned, None)

    def pack_record(self, group: Any, shape: tuple, dtype: Any, nbytes: int) -> Any:
        """A packed tensor: a save of `group` whose host copy is a record."""
        from ..primitives import offload

        pinned = _Pinned(next(self._keys), tuple(shape), dtype, nbytes)
        self._log("d2h", pinned)
        return offload._Saved(group.add(offload._OnHost(pinned, None), nbytes))

    def _device_copy(self, pinned: _Pinned) -> Any:
        import torch

        with self.counter.paused():  # a copy over the host link, not HBM roofline work
            return torch.empty(pinned.shape, dtype=pinned.dtype)

    def _to_device(self, packed: Any) -> Any:
        self._log("demand", packed.host)
        return self._device_copy(packed.host)

    def _prefetch(self, group: Any) -> None:
        group.fetched = True
        for ref in group.items:
            packed = ref()
            if packed is None or packed.back is not None:
                continue
            self._log("prefetch", packed.host)
            packed.back = self._device_copy(packed.host)


# ------------------------------------------------------------------------------------------------
# compiled layers: the saved tensors of the recorded partition
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SavedTensor:
    """One tensor a compiled layer's backward graph takes from its forward: its own bytes
    (what the pack hook copies) and its base tensor (what the device frees)."""

    base: str
    base_bytes: int
    nbytes: int


def record_with_saved(fn: Callable, args: tuple, kwargs: dict) -> tuple[Any, list]:
    """`partition_plan.record_partition`, and the saved tensors of the partition it records
    (each backward input taken from the forward that is no graph input: parameters and the
    layer's inputs are left out, as in `PartitionPlan.saved_bytes`)."""
    from . import partition_plan as pp

    got: list = []
    plan_of = pp._plan

    def plan(pairs: list) -> Any:
        for fw, bw in pairs:
            vals = {n.name: n.meta.get("val") for n in bw.graph.nodes if n.op == "placeholder"}
            for name, (base, base_bytes) in pp._saved_bases(fw, bw).items():
                got.append(SavedTensor(base, base_bytes, pp._val_bytes(vals[name])))
        return plan_of(pairs)

    with mock.patch.object(pp, "_plan", plan):
        recorded = pp.record_partition(fn, args, kwargs)
    return recorded, got


def pack_saved(sim: OffloadSim, wrapper: Any, saved: list[SavedTensor]) -> tuple[list, int]:
    """Pack a compiled layer's saved tensors (at the end of its forward, as AOTAutograd saves
    them): returns the packed ones and the device bytes they free (bases whose every saved
    view was offloaded)."""
    import torch

    group = wrapper.new_group()
    packed, kept_bases = [], set()
    for s in saved:
        if sim.offloads(wrapper, s.nbytes):
            packed.append(sim.pack_record(group, (s.nbytes,), torch.uint8, s.nbytes))
        else:
            wrapper.stats.kept += 1
            kept_bases.add(s.base)
    freed = {s.base: s.base_bytes for s in saved if s.base not in kept_bases}
    return packed, sum(freed.values())


# ------------------------------------------------------------------------------------------------
# time: the copies against one host link
# ------------------------------------------------------------------------------------------------

def exposed_copy_s(events: list[OffloadEvent], at_s: Callable[[tuple], float],
                   host_bandwidth: float) -> float:
    """Seconds the compute stream waits for offload copies in one step.

    `at_s(event.at)`: the compute time before an event. The offload stream is one FIFO queue
    over one host link (the primitive copies out and prefetches on a single side stream): a
    saved tensor's copy to host starts when it was packed and the link is free; nothing in
    forward waits for it. A prefetch (group k-1's tensors, queued when backward first reads
    group k; the last offloaded layer's, when backward reaches the kept layer after it) starts
    after everything queued before it, its copy to host included. Reading a prefetched tensor
    waits for its copy back; reading one that was not prefetched (an offloaded module with no
    module after it to trigger its prefetch) waits for its copy to host, then copies it back on
    the compute stream, ahead of the prefetches still queued but after the copy in flight (no
    preemption). The waits add up, and every later event moves by them."""
    if not events:
        return 0.0
    if not host_bandwidth > 0:
        raise ValueError("the device has no host link bandwidth (host_bandwidth=0): it cannot "
                         "time activation offload. Fix: set DeviceConstants(host_bandwidth=...) "
                         "(bytes/s per direction), or search offload_ratio=0.")
    queue: deque = deque()  # (kind, key, nbytes, queued at)
    done: dict[tuple[str, int], float] = {}
    link = 0.0  # when the link is free of what it has started
    waited = 0.0

    def serve(until: float | None = None, target: tuple | None = None) -> None:
        nonlocal link
        while queue and (target is None or target not in done):
            kind, key, n, t0 = queue[0]
            start = max(link, t0)
            if target is None and start >= until:
                return
            queue.popleft()
            link = start + n / host_bandwidth
            done[(kind, key)] = link

    for ev in events:
        now = at_s(ev.at) + waited
        if ev.kind in ("d2h", "prefetch"):
            queue.append((ev.kind, ev.key, ev.nbytes, now))
        elif ev.kind == "use":
            serve(target=("prefetch", ev.key))
            waited += max(0.0, done[("prefetch", ev.key)] - now)
        elif ev.kind == "demand":
            serve(target=("d2h", ev.key))
            serve(until=now)
            link = max(now, link, done[("d2h", ev.key)]) + ev.nbytes / host_bandwidth
            waited += link - now
        else:
            raise ValueError(f"unknown offload event {ev.kind!r}; kinds: {KINDS}")
    return waited


def offload_wait_s(events: tuple | list, device: Any, efficiency: float = 1.0) -> float:
    """`exposed_copy_s` of a step's events on `device` (a `timing.DeviceConstants`): an
    event's time is the roofline of the compute before it (FLOPs, FP8 FLOPs, bytes and
    launches, as `GPUCostModel.roofline_s` counts them) over `efficiency`."""
    from .timing import roofline_time

    def at_s(at: tuple) -> float:
        flops, fp8, moved, kernels = at
        return (float(roofline_time(flops - fp8, moved, device, fp8_flops=fp8))
                + kernels * device.kernel_launch_s) / efficiency

    return exposed_copy_s(list(events), at_s, device.host_bandwidth)


def offloaded_bytes(events: list[OffloadEvent]) -> int:
    """Bytes copied to host in one step (each copy comes back once)."""
    return sum(ev.nbytes for ev in events if ev.kind == "d2h")
