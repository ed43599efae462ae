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
- **one copy per saved tensor** (per forward of the module): autograd hands the hook one
  tensor per save, so a tensor two ops save (the input of q, k and v projections: each matmul
  saves it, through a fresh 2-D view) would cross the link twice each way and sit on the host
  twice. A save whose memory was already copied in this forward reuses that copy: the key is
  the storage, the memory span the tensor covers, its dtype and its `_version` (autograd does
  not check versions of hooked tensors, so a tensor modified in place between two saves must
  be copied again: each save gets the values it saw), and the entry holds only while that
  storage lives (a weak reference to it), so a freed storage whose address comes back is
  never taken for the old one. A tensor no bigger than its span (dense, or expanded)
  is copied as that span and every save rebuilds its own view of it (`as_strided` with its
  size and strides: a transposed view and its contiguous source share one copy and each
  unpacks as itself); a tensor with gaps (a strided slice) is copied compactly, shared only by
  saves of the identical view. Distinct spans of one storage (a slice and its whole) are
  separate copies; a tensor saved in two offloaded modules is copied by each.
- **unpack** (backward): the tensor comes back to the device. **Prefetch**: the offloaded
  forwards form a chain in the order they ran (each forward's saved tensors are one `_Group`,
  linked to the group created before it); when backward first unpacks a tensor of group k it
  starts copying every tensor of group k-1 (the layer whose backward comes next) back to the
  device on the offload stream, so that H2D copy overlaps group k's backward. An unpack whose
  tensor was prefetched waits for its copy's event and takes it; one not prefetched is copied
  back when asked (`OffloadStats.demanded`). A copy shared by several saves stays on the
  device until the last of them has read it. One group ahead at most: the device holds at most
  two layers' offloaded activations during backward. A group already unpacked is not
  prefetched (pipeline schedules interleave micro-batches' forwards: the chain is by creation,
  so a group's predecessor may belong to another micro-batch; prefetching it early only holds
  its bytes earlier, the numbers are the same).
- **the first group backward reaches** (the last offloaded forward) has no group after it to
  start its prefetch, so something that runs after it does (forward hooks: the modules'
  forwards stay as they are for tracing, kernels and compilation). (1) Offloading a module of
  an ordered container (`nn.ModuleList`, `nn.Sequential`: a layer list) makes the module
  after it the trigger (`prefetch_after`): when backward reaches it (the gradient of its
  output is computed), the offloaded module's last forward starts coming back and overlaps
  that module's whole backward, as behind an offloaded successor; `model_schedule`'s
  `offload_ratio` places it on the layer after the offloaded ones across containers too
  (T5's first decoder block after the encoder's last). (2) The model's last layer has no
  layer after it: when `offload_ratio` reaches it, the schedule root's output is the trigger
  (`prefetch_at_backward_start`), so its copy starts with the loss's backward and overlaps
  the head's (norm, LM head, loss). Why not keep the last layer resident instead (TE's CPU
  offload and torchtune keep the last layer or the output layer): both hold its bytes on the
  device from the start of backward on, where the step's peak usually is; the prefetch also
  frees them for the head's forward, pays the layer's two copies (which the head's backward
  hides on a fast host link and does not on PCIe, where offloading every layer is bound by
  the link anyway: docs/tune.md), and leaves `offload_ratio` meaning round-half-up(r * L)
  layers (the tuner's space, the benchmark rows and ALBERT's one shared layer unchanged).
  Under a pipeline the root's forward does not run (the stages are new modules) and a
  hand-written schedule gets (1) within a container only: that first group is copied back
  when backward reads it (`OffloadStats.demanded`); `prefetch_first_reached` places the
  trigger by hand.

The numbers are exactly the module's (a copy is a copy). The CUDA path (streams, events,
pinned memory) has not run on a GPU yet: no device was lent when it was written. On CPU there
is no device memory to save, so CPU tensors are kept unless `devices` names "cpu", which tests
use to run the same pack/unpack path exactly. Composes with compiled blocks (the hooks wrap the
compiled call and see the tensors its backward saves) and tensor parallelism (local); not with
`checkpoint` on the same module (a checkpointed module saves only its inputs: choose one per
layer, as `model_schedule`'s `offload_ratio` does, which offloads the layers after the
checkpointed ones).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from .. import module_patch
from ..errors import SchedulingError
from .base import Primitive, register_primitive

DEVICE_TYPES = ("cuda", "cpu")
MIN_BYTES = 1 << 20  # below ~1 MiB a copy's launch and sync cost more than the bytes it frees


@dataclass
class OffloadStats:
    """What the last forward of an offloaded module moved (read by tests and reports), and
    how its backward got its copies back. `tensors`/`bytes`: host copies made and their
    bytes (each crosses the link once each way); `deduped`: saves served by a copy this
    forward had already made; `prefetched`: copies backward found prefetched; `demanded`:
    copies back to the device made when backward read a tensor not prefetched (one per copy:
    its other saves read the same one; a retained graph's second backward makes more)."""

    tensors: int = 0
    bytes: int = 0
    kept: int = 0
    deduped: int = 0
    prefetched: int = 0
    demanded: int = 0


@dataclass(eq=False)
class _OnHost:
    """One host copy, shared by the saves of one tensor (`saves`)."""

    host: Any
    device: torch.device | None
    event: object | None = None  # the D2H copy's CUDA event (None on CPU)
    group: _Group | None = None
    back: torch.Tensor | None = None  # on the device: prefetched, or read by a save of several
    back_event: object | None = None  # its H2D copy's CUDA event (None on CPU or on demand)
    saves: int = 1
    reads: int = 0


@dataclass(eq=False)
class _Saved:
    """What one save packs to: its copy, and the view to rebuild (size, strides) when the copy
    is the tensor's memory span (None: the copy is the tensor itself)."""

    copy: _OnHost
    view: tuple | None = None

    @property
    def host(self) -> Any:
        return self.copy.host

    def rebuild(self, device_copy: torch.Tensor) -> torch.Tensor:
        if self.view is None:
            return device_copy
        return device_copy.as_strided(*self.view, 0)


def _storage(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (also for fake tensors, which have no data pointer)."""
    return t.untyped_storage()._cdata


def _layout(t: torch.Tensor) -> tuple[tuple, tuple | None, int | None]:
    """The dedupe key of a save, the view to rebuild from a span copy, and that span's length
    in elements (None: copy `t` compactly). Strides are never negative, so `t`'s lowest element
    is at its storage offset and its span is 1 + sum((size - 1) * stride)."""
    size, stride = tuple(t.shape), tuple(t.stride())
    where = (_storage(t), t.storage_offset(), t.dtype, t._version)  # _storage first: _find
    span = 1 + sum((n - 1) * s for n, s in zip(size, stride)) if t.numel() else 0
    if span <= t.numel():
        return (*where, "span", span), (size, stride), span
    return (*where, "compact", size, stride), None, None


class _Group:
    """The offloaded tensors of one forward of one module, linked to the group created just
    before it (weakly: a finished step's groups are freed with their graph)."""

    _last: weakref.ref | None = None  # the group created most recently (this process)

    def __init__(self, stats: OffloadStats):
        # weakly: the autograd graph owns the packed tensors, each of which holds its group;
        # a strong list here would make a cycle that keeps every host (pinned) copy, and any
        # prefetched device copy, alive after backward until Python's garbage collector runs
        self.items: list[weakref.ref] = []
        self.keys: dict[tuple, tuple[weakref.ref, weakref.ref]] = {}  # (storage, copy)
        self.stats = stats
        self.started = False  # backward has unpacked one of its tensors
        self.fetched = False  # its tensors were prefetched
        self.prev = _Group._last
        _Group._last = weakref.ref(self)

    def previous(self) -> _Group | None:
        return self.prev() if self.prev is not None else None

    def pack(self, t: torch.Tensor, copy_out: Callable[[torch.Tensor], _OnHost],
             dedupe: bool = True) -> _Saved:
        """`t` as a save of this group: the copy this forward already made of its memory, or a
        new one (`copy_out` of the span, or of `t`)."""
        if not dedupe:
            return _Saved(self.add(copy_out(t.detach()), t.numel() * t.element_size()))
        key, view, span = _layout(t)
        found = self._find(key)
        if found is not None:
            found.saves += 1
            self.stats.deduped += 1
            return _Saved(found, view)
        src = t.detach()
        if view is not None:
            src = src.as_strided((span,), (1,), t.storage_offset())
        copy = self.add(copy_out(src), src.numel() * src.element_size())
        # torch keeps one Python object per live storage: while it lives, no other storage
        # has its identity (a freed storage's address may come back for another one)
        self.keys[key] = (weakref.ref(t.untyped_storage()), weakref.ref(copy))
        return _Saved(copy, view)

    def _find(self, key: tuple) -> _OnHost | None:
        entry = self.keys.get(key)
        if entry is None:
            return None
        storage, copy = entry[0](), entry[1]()
        if storage is None or copy is None or storage._cdata != key[0]:
            return None
        return copy

    def add(self, copy: _OnHost, nbytes: int) -> _OnHost:
        """Count `copy` (of `nbytes`) as one of this group's: prefetched with it, freed with it."""
        copy.group = self
        self.items.append(weakref.ref(copy))
        self.stats.tensors += 1
        self.stats.bytes += nbytes
        return copy


@dataclass
class OffloadWrapper(module_patch.ForwardWrapper):
    min_bytes: int = MIN_BYTES
    devices: tuple[str, ...] = ("cuda",)
    stats: OffloadStats = field(default_factory=OffloadStats)
    last_group: weakref.ref | None = field(default=None, repr=False, compare=False)
    name = "offload"

    # Under compiled blocks dynamo would trace into this wrapper and break its graph at the
    # weight-storage set (`UntypedStorage.data_ptr`: 5 breaks per layer, measured); this frame
    # runs eager instead, and the layer it calls (`fn`) is still compiled as its own frame, its
    # saved tensors going through the hooks set here (`recursive=False`).
    @torch.compiler.disable(recursive=False)
    def __call__(self, module, fn, args, kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        group = self.new_group()
        weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(t, weights, group), _unpack):
            return fn(*args, **kwargs)

    def new_group(self) -> _Group:
        """A fresh group (and stats) for one forward; the trigger of its prefetch
        (`prefetch_after`, `prefetch_at_backward_start`) reads it as `last_group`."""
        self.stats = OffloadStats()
        group = _Group(self.stats)
        self.last_group = weakref.ref(group)
        return group

    def _pack(self, t: torch.Tensor, weights: set[int], group: _Group):
        nbytes = t.numel() * t.element_size()
        if (t.device.type not in self.devices or nbytes < self.min_bytes
                or t.layout is not torch.strided or t.untyped_storage().data_ptr() in weights):
            self.stats.kept += 1
            return t
        # tensor subclasses are copied as themselves, never rebuilt as views of a plain span
        return group.pack(t, _to_host, dedupe=type(t) is torch.Tensor)


# ---- the first group backward reaches: prefetched by what runs after it ---------------------

_AFTER = "_slapo_offload_after"  # on a module: the OffloadWrapper whose prefetch it triggers
_AT_START = "_slapo_offload_at_backward_start"  # on a root: wrappers prefetched at its output
_SEEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # root -> groups before forward


def prefetch_after(module: nn.Module, offloaded: OffloadWrapper) -> None:
    """When backward reaches `module` (the module that runs after the offloaded one: the
    gradient of its output is computed), start prefetching `offloaded`'s last forward, so the
    copy overlaps `module`'s backward. A forward hook (not a wrapper: the module's forward is
    unchanged for tracing, kernels and compilation; `replace` carries hooks over) holding its
    wrapper; one offloaded module per trigger."""
    if module.__dict__.get(_AFTER) is None:
        module.__dict__[_AFTER] = offloaded
        module.register_forward_hook(functools.partial(_after_offloaded, offloaded))


def prefetch_at_backward_start(root: nn.Module, offloaded: OffloadWrapper) -> None:
    """When backward reaches `root`'s output (the loss: backward's start), start prefetching
    `offloaded`'s forward of that step: for the model's last layer, whose backward comes right
    after the head's (module doc)."""
    waiting = root.__dict__.get(_AT_START)
    if waiting is None:
        waiting = root.__dict__[_AT_START] = []
        root.register_forward_pre_hook(functools.partial(_root_starts, waiting))
        root.register_forward_hook(functools.partial(_root_ends, waiting))
    if all(w is not offloaded for w in waiting):
        waiting.append(offloaded)


def prefetch_trigger(module: nn.Module) -> OffloadWrapper | None:
    """The offloaded module's wrapper whose prefetch `module` triggers (`prefetch_after`)."""
    return module.__dict__.get(_AFTER)


@torch.compiler.disable  # run eager after a compiled layer's graph (measured: no graph break)
def _after_offloaded(offloaded: OffloadWrapper, _module: nn.Module, _args: Any,
                     out: Any) -> None:
    if torch.is_grad_enabled():
        prefetch_when_reached(offloaded.last_group, out)


@torch.compiler.disable
def _root_starts(waiting: list, root: nn.Module, _args: Any) -> None:
    _SEEN[root] = [w.last_group for w in waiting]


@torch.compiler.disable
def _root_ends(waiting: list, root: nn.Module, _args: Any, out: Any) -> None:
    before = _SEEN.pop(root, None)
    if not torch.is_grad_enabled() or before is None:
        return
    for w, old in zip(waiting, before):
        if w.last_group is not None and w.last_group is not old:  # a group of this forward
            prefetch_when_reached(w.last_group, out)


def prefetch_when_reached(group: weakref.ref | None, out: Any) -> None:
    """Prefetch `group` when backward computes the gradient of a tensor of `out` (the first
    one it reaches), unless its backward started already or it was prefetched."""
    if group is None:
        return

    def reached(_grad):
        g = group()
        if g is not None and not g.started and not g.fetched:
            _prefetch(g)

    for t in _tensors(out):
        if t.requires_grad:
            t.register_hook(reached)


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a module's output (a tensor, or tuples, lists and dicts of them: HF's
    ModelOutput is a dict)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, Mapping):
        out = list(out.values())
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


def _to_host(t: torch.Tensor) -> _OnHost:
    """Copy `t` to pinned host memory on the device's offload stream, after the work that
    produced it; `t`'s memory is not reused before the copy has read it. On CPU (tests) the
    "host copy" is a clone, so the same bookkeeping runs."""
    if t.device.type == "cpu":
        return _OnHost(t.clone(), t.device)
    current = torch.cuda.current_stream(t.device)
    stream = _offload_stream(t.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    t.record_stream(stream)
    return _OnHost(host, t.device, event)


def _unpack(packed):
    if not isinstance(packed, _Saved):
        return packed
    copy = packed.copy
    group = copy.group
    if group is not None and not group.started:
        group.started = True
        before = group.previous()
        if before is not None and not before.started and not before.fetched:
            _prefetch(before)
    return packed.rebuild(_take(copy))


def _take(copy: _OnHost) -> torch.Tensor:
    """The device copy of `copy` for one read: the prefetched one (after its event), or one
    made now; kept on `copy` while other saves of it have still to read it, handed over to
    backward (freed with its reader) by the last (a retained graph's next backward copies it
    again from the host, once). A save backward never reads (a branch `autograd.grad` prunes)
    leaves the copy on `copy` until the graph is freed: held longer, never wrong."""
    copy.reads += 1
    stats = copy.group.stats if copy.group is not None else OffloadStats()
    if copy.back is not None:
        back = copy.back
        if copy.reads == 1:
            stats.prefetched += 1
        if copy.back_event is not None:
            torch.cuda.current_stream(copy.device).wait_event(copy.back_event)
            back.record_stream(torch.cuda.current_stream(copy.device))
    else:
        stats.demanded += 1
        back = _to_device(copy)
    if copy.reads % copy.saves == 0:
        copy.back, copy.back_event = None, None
    else:
        copy.back = back
    return back


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
        if packed is None or packed.back is not None:  # freed by backward, or already back
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


def _next_in_order(sch) -> nn.Module | None:
    """The module after `sch`'s in its parent, when the parent runs its children in order
    (`nn.ModuleList` by convention, `nn.Sequential` by definition); else None."""
    parent = sch.parent.mod if sch.parent is not None else None
    if not isinstance(parent, (nn.ModuleList, nn.Sequential)):
        return None
    names = list(parent._modules)
    at = names.index(sch.name) + 1
    nxt = parent._modules[names[at]] if at < len(names) else None
    return nxt if nxt is not sch.mod else None


@register_primitive
class OffloadPrimitive(Primitive):
    """Keep this module's saved activations in host memory between forward and backward.

    Tensors autograd saves inside the module's forward, of at least `min_bytes` and on a device
    type in `devices` (CUDA by default), are copied to pinned host memory on a side stream
    (once per distinct tensor) and copied back when backward needs them; weights and small
    tensors stay. Exact (copies only). The next module of its layer list, if any, becomes the
    trigger of its prefetch in backward. Not on a checkpointed module (it keeps only its
    inputs): choose one per module.
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
        wrapper = OffloadWrapper(min_bytes, tuple(devices))
        module_patch.add_wrapper(sch.mod, wrapper)
        nxt = _next_in_order(sch)
        if nxt is not None:
            prefetch_after(nxt, wrapper)


def prefetch_first_reached(last: Any, following: Any | None) -> None:
    """`last` (a schedule node, offloaded) is the offloaded module backward reaches first: its
    prefetch starts when backward reaches `following` (the node that runs after it), or, with
    None (`last` is the model's last layer), when backward starts at the schedule root's
    output. For `model_schedule`, which knows the layers' order across containers (T5's
    encoder blocks, then its decoder's)."""
    wrapper = offload_wrapper(last.mod)
    if wrapper is None:
        raise SchedulingError(last.path, "this module is not offloaded: there is no prefetch "
                              "to start.", "call offload() on it first.")
    if following is not None:
        prefetch_after(following.mod, wrapper)
    elif last.root.mod is not last.mod:
        prefetch_at_backward_start(last.root.mod, wrapper)
