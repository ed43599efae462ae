"""`offload`: keep a module's saved activations in host memory from forward to backward.

Activation memory is what limits batch and sequence length on one GPU. Checkpointing trades it
for recomputation; offloading trades it for PCIe traffic (Mist co-optimises both; Megatron,
DeepSpeed and Unsloth offload activations). Inside the offloaded module's forward, every tensor
autograd saves for backward goes through `torch.autograd.graph.saved_tensors_hooks`:

- **pack** (forward): a tensor on an offloaded device type, of at least `min_bytes`, that is not
  a parameter's storage (weights stay where they are: copying them gains nothing), is copied to
  pinned host memory on a side stream (the copy overlaps the next ops; the caching allocator is
  told the side stream still reads the tensor, `record_stream`), and only the host copy is
  kept. Smaller tensors (a copy's fixed cost outweighs their bytes) are kept as they are.
- **unpack** (backward): the tensor comes back to the device. **Prefetch**: the offloaded
  forwards form a chain in the order they ran (each forward's saved tensors are one `_Group`,
  linked to the group created before it); when backward first unpacks a tensor of group k it
  starts copying every tensor of group k-1 (the layer whose backward comes next) back to the
  device on the offload stream, so that H2D copy overlaps group k's backward. An unpack whose
  tensor was prefetched waits for its copy's event and takes it; one not prefetched (the first
  group backward reaches) is copied back when asked. One group ahead at most: the device holds
  at most two layers' offloaded activations during backward. A group already unpacked is not
  prefetched (pipeline schedules interleave micro-batches' forwards: the chain is by creation,
  so a group's predecessor may belong to another micro-batch; prefetching it early only
  holds its bytes earlier, the numbers are the same). `OffloadStats.prefetched` counts the
  unpacks served by a prefetch.

The numbers are exactly the module's (a copy is a copy). The CUDA path (streams, events,
pinned memory) has not run on a GPU yet: no device was lent when it was written. On CPU there
is no device memory to save, so CPU tensors are kept unless `devices` names "cpu", which tests
use to run the same pack/unpack path exactly. Composes with compiled blocks (the hooks wrap the compiled call and
see the tensors its backward saves) and tensor parallelism (local); not with `checkpoint` on
the same module (a checkpointed module saves only its inputs: choose one per layer, as
`model_schedule`'s `offload_ratio` does, which offloads the layers after the checkpointed ones).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .. import module_patch
from ..errors import SchedulingError
from .base import Primitive, register_primitive

DEVICE_TYPES = ("cuda", "cpu")
MIN_BYTES = 1 << 20  # below ~1 MiB a copy's launch and sync cost more than the bytes it frees


@dataclass
class OffloadStats:
    """What the last forward of an offloaded module moved (read by tests and reports), and how
    many of its tensors its backward found prefetched."""

    tensors: int = 0
    bytes: int = 0
    kept: int = 0
    prefetched: int = 0


@dataclass
class _OnHost:
    host: torch.Tensor
    device: torch.device
    event: object | None = None  # the D2H copy's CUDA event (None on CPU)
    group: _Group | None = None
    back: torch.Tensor | None = None  # the prefetched device copy
    back_event: object | None = None  # its H2D copy's CUDA event (None on CPU)


class _Group:
    """The offloaded tensors of one forward of one module, linked to the group created just
    before it (weakly: a finished step's groups are freed with their graph)."""

    _last: weakref.ref | None = None  # the group created most recently (this process)

    def __init__(self, stats: OffloadStats):
        # weakly: the autograd graph owns the packed tensors, each of which holds its group;
        # a strong list here would make a cycle that keeps every host (pinned) copy, and any
        # prefetched device copy, alive after backward until Python's garbage collector runs
        self.items: list[weakref.ref] = []
        self.stats = stats
        self.started = False  # backward has unpacked one of its tensors
        self.fetched = False  # its tensors were prefetched
        self.prev = _Group._last
        _Group._last = weakref.ref(self)

    def previous(self) -> _Group | None:
        return self.prev() if self.prev is not None else None


@dataclass
class OffloadWrapper(module_patch.ForwardWrapper):
    min_bytes: int = MIN_BYTES
    devices: tuple[str, ...] = ("cuda",)
    stats: OffloadStats = field(default_factory=OffloadStats)
    name = "offload"

    # Under compiled blocks dynamo would trace into this wrapper and break its graph at the
    # weight-storage set (`UntypedStorage.data_ptr`: 5 breaks per layer, measured); this frame
    # runs eager instead, and the layer it calls (`fn`) is still compiled as its own frame, its
    # saved tensors going through the hooks set here (`recursive=False`).
    @torch.compiler.disable(recursive=False)
    def __call__(self, module, fn, args, kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        self.stats = OffloadStats()
        group = _Group(self.stats)
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, weights, group), _unpack):
            return fn(*args, **kwargs)

    def _pack(self, t: torch.Tensor, weights: set[int], group: _Group):
        nbytes = t.numel() * t.element_size()
        if (t.device.type not in self.devices or nbytes < self.min_bytes or t.is_sparse
                or t.untyped_storage().data_ptr() in weights):
            self.stats.kept += 1
            return t
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        packed = _OnHost(t.detach().clone(), t.device) if t.device.type == "cpu" \
            else _to_host(t)
        packed.group = group
        group.items.append(weakref.ref(packed))
        return packed


def _to_host(t: torch.Tensor) -> _OnHost:
    """Copy `t` to pinned host memory on the device's offload stream, after the work that
    produced it; `t`'s memory is not reused before the copy has read it."""
    current = torch.cuda.current_stream(t.device)
    stream = _offload_stream(t.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    t.record_stream(stream)
    return _OnHost(host, t.device, event)


def _unpack(packed):
    if not isinstance(packed, _OnHost):
        return packed
    group = packed.group
    if group is not None and not group.started:
        group.started = True
        before = group.previous()
        if before is not None and not before.started and not before.fetched:
            _prefetch(before)
    if packed.back is not None:  # handed over once: backward owns it from here
        group.stats.prefetched += 1
        back, packed.back = packed.back, None
        if packed.back_event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.back_event)
            back.record_stream(torch.cuda.current_stream(packed.device))
        return back
    return _to_device(packed)


def _to_device(packed: _OnHost) -> torch.Tensor:
    """The host copy back on its device (on CPU: the host copy itself)."""
    if packed.event is None:
        return packed.host
    torch.cuda.current_stream(packed.device).wait_event(packed.event)
    return packed.host.to(packed.device, non_blocking=True)


def _prefetch(group: _Group) -> None:
    """Start copying `group`'s tensors back to their device: on the offload stream, after
    their D2H copies and after the work backward has queued so far; each copy's event is what
    its unpack waits for. On CPU (tests) the "device copy" is a fresh copy of the host one, so
    the same bookkeeping runs."""
    group.fetched = True
    for ref in group.items:
        packed = ref()
        if packed is None:  # already read and freed by backward
            continue
        if packed.event is None:
            packed.back = packed.host.clone()
            continue
        stream = _offload_stream(packed.device)
        stream.wait_stream(torch.cuda.current_stream(packed.device))
        with torch.cuda.stream(stream):
            stream.wait_event(packed.event)
            packed.back = packed.host.to(packed.device, non_blocking=True)
            packed.back_event = torch.cuda.Event()
            packed.back_event.record(stream)


_STREAMS: dict[torch.device, object] = {}


def _offload_stream(device: torch.device):
    """One side stream per device for the D2H copies (created on first use)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def offload_wrapper(module: nn.Module) -> OffloadWrapper | None:
    return next((w for w in module_patch.wrappers(module) if isinstance(w, OffloadWrapper)),
                None)


@register_primitive
class OffloadPrimitive(Primitive):
    """Keep this module's saved activations in host memory between forward and backward.

    Tensors autograd saves inside the module's forward, of at least `min_bytes` and on a device
    type in `devices` (CUDA by default), are copied to pinned host memory on a side stream and
    copied back when backward needs them; weights and small tensors stay. Exact (copies only).
    Not on a checkpointed module (it keeps only its inputs): choose one per module.
    """

    name = "offload"

    @classmethod
    def validate(cls, sch, min_bytes: int = MIN_BYTES, devices=("cuda",)):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise SchedulingError(sch.path, f"min_bytes must be an int >= 0, got {min_bytes!r}.",
                                  f"pass e.g. min_bytes={MIN_BYTES} (1 MiB).")
        if not isinstance(devices, (tuple, list)) or not devices or any(
                d not in DEVICE_TYPES for d in devices):
            raise SchedulingError(sch.path, f"devices must be a non-empty tuple of {DEVICE_TYPES}, "
                                  f"got {devices!r}.", "pass devices=('cuda',).")
        from .checkpoint import CheckpointWrapper

        wrappers = module_patch.wrappers(sch.mod)
        if any(isinstance(w, CheckpointWrapper) for w in wrappers):
            raise SchedulingError(sch.path, "this module is checkpointed: it keeps only its "
                                  "inputs for backward, so there is nothing to offload.",
                                  "offload another module, or drop its checkpoint.")
        if any(isinstance(w, OffloadWrapper) for w in wrappers):
            raise SchedulingError(sch.path, "this module is already offloaded.",
                                  "remove the second offload call.")

    @classmethod
    def apply(cls, sch, min_bytes: int = MIN_BYTES, devices=("cuda",)):
        module_patch.add_wrapper(sch.mod, OffloadWrapper(min_bytes, tuple(devices)))
