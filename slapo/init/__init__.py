"""Delayed initialisation: build on the meta device, shard, then materialise only local shards.

    with slapo.init_empty_weights():
        model = BertModel(config)          # no memory allocated
    sch = slapo.create_schedule(model)
    ... shard ...
    model, _ = slapo.build(sch, seed=0)    # each rank allocates and initialises its shards

A rank never allocates a sharded tensor at its full shape. Per module, `materialize`:

1. runs the module's init on full-size stand-ins that hold no memory (`record.StandIn`: the
   init sees the original shapes), recording the in-place ops it applies to each tensor with
   their resolved scalars (`record.py`: random fills, constants, copies, elementwise and index
   writes);
2. allocates each tensor at its local (shard) size and replays those ops on it (`replay.py`):
   deterministic ops cut to the shard's rows/columns, random fills drawn from per-block streams
   seeded from (seed, module path, tensor name, op index, block index), so a value depends only
   on its position in the full tensor;
3. a tensor whose init the recorder cannot replay exactly (e.g. `orthogonal_`, which reads
   another tensor) takes the previous path instead, for that tensor only: full size on this rank,
   init under the module's seed `module_seed(seed, path)`, keep the slice; an
   `InitFallbackWarning` names it once.

Either way the shards merged across ranks equal the unsharded delayed build (tp=1) bit for bit,
for any TP degree and rank, on a given device type (CPU and CUDA generators draw different
numbers). The values are Slapo's own, not those of an eager `Model(config)` under the same
seed, but every tensor gets its module's init: the same distributions with the same resolved
parameters and the same deterministic parts (zero biases, padding rows, ones for norms).

Initialisation per module, first that applies: `init_fn(module)` / `init_fn(module, path)`, the
Hugging Face model's `_init_weights(module)`, `module.reset_parameters()`; tensors none of them
touch stay zero. An init writes only the module's own tensors (a write to a child's tensor, which
is still meta, is dropped, as before). Weights that are already materialised are never touched.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import zlib
from collections.abc import Callable

import torch
import torch.nn as nn

from .. import sharding
from . import replay
from .record import Recorder, StandIn


@contextlib.contextmanager
def init_empty_weights(enable: bool = True, include_buffers: bool = False):
    """Create modules on the meta device (shapes only, no memory).

    `enable=False` is a no-op context (Slapo 2023's `init_empty_weights(enable=delay_init)`).
    `include_buffers` is accepted for the 2023 signature: buffers always go to meta here and
    `build` materialises them like parameters."""
    if not enable:
        yield
        return
    with torch.device("meta"):
        yield


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def module_seed(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63 - 1)


def _hf_root(model: nn.Module):
    for m in model.modules():
        if hasattr(m, "_init_weights") and hasattr(m, "config"):
            return m
    return None


def _init_callable(model: nn.Module, init_fn: Callable | None):
    if init_fn is not None:
        n = len(inspect.signature(init_fn).parameters)
        return (lambda m, p: init_fn(m, p)) if n >= 2 else (lambda m, p: init_fn(m))
    hf = _hf_root(model)

    def default(m: nn.Module, path: str) -> None:
        if hf is not None:
            hf._init_weights(m)
        elif hasattr(m, "reset_parameters"):
            m.reset_parameters()

    return default


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str = "cpu", *,
                init_fn: Callable | None = None, seed: int = 0) -> nn.Module:
    """Allocate and initialise every meta tensor of `model` on `device`; a shard is allocated
    at its local size only (see the module docstring). Tensors shared by several modules stay
    shared and are initialised at their first owner."""
    init = _init_callable(model, init_fn)
    device = torch.device(device)
    gen = torch.Generator(device=device)
    done: dict[int, torch.Tensor] = {}  # id(meta tensor) -> materialised (keeps ties tied)
    for path, mod in model.named_modules(remove_duplicate=False):
        metas = _pending(mod, done)
        if metas:
            _materialize_module(mod, path, metas, init, device, seed, gen, done)
    return model


def _slots(mod: nn.Module, kind: str) -> dict:
    return mod._parameters if kind == "p" else mod._buffers


def _pending(mod: nn.Module, done: dict[int, torch.Tensor]) -> list[tuple[str, torch.Tensor, str]]:
    """The module's own meta tensors still to initialise, as (name, tensor, "p" | "b"); tensors
    already materialised under another owner are re-pointed to it."""
    metas = []
    for kind in ("p", "b"):
        slots = _slots(mod, kind)
        for n, t in list(slots.items()):
            if t is None or t.device.type != "meta":
                continue
            if id(t) in done:
                slots[n] = done[id(t)]
            else:
                metas.append((n, t, kind))
    return metas


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    spec = sharding.shard_spec(t)
    return tuple(spec.orig_shape) if spec else tuple(t.shape)


def _wrap(value: torch.Tensor, like: torch.Tensor, kind: str) -> torch.Tensor:
    return nn.Parameter(value, requires_grad=like.requires_grad) if kind == "p" else value


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    """The global RNG at `seed` for the duration, restored after (the init's own draws)."""
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        yield


def _materialize_module(mod: nn.Module, path: str, metas, init, device: torch.device,
                        seed: int, gen: torch.Generator, done: dict) -> None:
    """Record the init on full-size stand-ins, replay it on each local shard; tensors it
    cannot replay take the full-size path (`_full_then_slice`)."""
    recorder = Recorder(device)
    full = {n: _wrap(recorder.stand_in(n, _full_shape(t), t.dtype), t, k) for n, t, k in metas}
    for n, _t, k in metas:
        _slots(mod, k)[n] = full[n]
    with _seeded(device, module_seed(seed, path)), _shielded(mod, recorder):
        rec = recorder.run(lambda: init(mod, path))
    values = {}
    for n, t, k in metas:
        lay = replay.layout(_full_shape(t), sharding.shard_spec(t))
        if _slots(mod, k)[n] is not full[n]:
            rec.fail(n, "the init replaced the tensor instead of writing into it")
        elif lay.local_shape != tuple(t.shape):
            rec.fail(n, f"its shard layout {lay} does not give the local shape {tuple(t.shape)}")
        if n not in rec.failed:
            local = torch.zeros(t.shape, dtype=t.dtype, device=device)
            values[n] = replay.replay(rec.ops.get(n, []), local, lay, seed, f"{path}:{n}", gen)
    failed = [(n, t, k) for n, t, k in metas if n in rec.failed]
    if failed:
        with _shielded(mod, recorder):
            values.update(_full_then_slice(mod, path, failed, rec.failed, init, device, seed))
    for n, t, k in metas:
        new = _wrap(values[n], t, k)
        carry_records(t, new)
        _slots(mod, k)[n] = new
        done[id(t)] = new


@contextlib.contextmanager
def _shielded(mod: nn.Module, recorder: Recorder):
    """Already materialised tensors of the module (e.g. loaded from a checkpoint while its
    neighbours stay meta) sit out the init: untracked stand-ins take their slots meanwhile, so
    the init's writes to them go nowhere."""
    kept = []
    for kind in ("p", "b"):
        slots = _slots(mod, kind)
        for n, t in list(slots.items()):
            if t is not None and t.device.type != "meta" and not isinstance(t, StandIn):
                kept.append((slots, n, t))
                slots[n] = _wrap(recorder.stand_in(None, _full_shape(t), t.dtype), t, kind)
    try:
        yield
    finally:
        for slots, n, t in kept:
            slots[n] = t


def _full_then_slice(mod: nn.Module, path: str, failed, reasons: dict[str, str], init,
                     device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The pre-replay path, for tensors the recorder could not replay: allocate them at full
    size, run the init under the module's seed, keep this rank's slice. The module's other
    tensors are stand-ins meanwhile, so the init leaves them alone."""
    for n, t, k in failed:
        _warn_fallback(mod, path, n, _full_shape(t), reasons[n])
        _slots(mod, k)[n] = _wrap(torch.zeros(_full_shape(t), dtype=t.dtype, device=device), t, k)
    with _seeded(device, module_seed(seed, path)):
        init(mod, path)
    out = {}
    for n, t, k in failed:
        value = _slots(mod, k)[n].detach()
        spec = sharding.shard_spec(t)
        if spec is not None:
            value = sharding.local_slice(value, spec.axis, spec.world_size, spec.rank,
                                         spec.blocks).clone()
        out[n] = value
    return out


def carry_records(old: torch.Tensor, new: torch.Tensor) -> None:
    """Shard spec and Slapo's tags travel from the meta tensor to its materialised value."""
    spec = sharding.shard_spec(old)
    if spec is not None:
        new._slapo_shard = spec
    tags = getattr(old, "_slapo_tags", None)
    if tags:
        new._slapo_tags = dict(tags)
        for key, v in tags.items():
            setattr(new, key, v)


class InitFallbackWarning(UserWarning):
    """A tensor was initialised at full size and then sliced: its init does something the
    shard replay cannot reproduce exactly (the message says what)."""


_WARNED: set[tuple[str, str, str]] = set()


def _warn_fallback(mod: nn.Module, path: str, name: str, shape, reason: str) -> None:
    """Once per (module class, tensor, reason): a 48-layer model warns once, not 48 times."""
    key = (type(mod).__name__, name, reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    where = f"{path}.{name}" if path else name
    warnings.warn(f"delayed init: {where} {tuple(shape)} (and {key[0]}.{name} elsewhere) was "
                  f"allocated at full size and then sliced, because {reason}. Give the module "
                  "an init made of random fills, constants and elementwise ops (or "
                  "slapo.build(init_weights=...)) to initialise the shard alone.",
                  InitFallbackWarning, stacklevel=6)


def reset_init_warnings() -> None:
    """Forget which fallbacks were reported (tests)."""
    _WARNED.clear()
