"""Delayed initialisation: build on the meta device, shard, then materialise only local shards.

    with slapo.init_empty_weights():
        model = BertModel(config)          # no memory allocated
    sch = slapo.create_schedule(model)
    ... shard ...
    model, _ = slapo.build(sch, seed=0)    # each rank allocates and initialises its shards

A rank never allocates a sharded tensor at its full shape. `materialize`:

1. puts a full-size stand-in that holds no memory (`record.StandIn`: an init sees the original
   shapes) in the slot of every pending meta tensor of the model at once, then runs the inits
   in Hugging Face's order (`smart_apply`, a post-order: children first, parent last) on every
   module with a pending tensor in its subtree, recording the in-place ops each init applies to
   any of those tensors with their resolved scalars (`record.py`: random fills, constants,
   copies, elementwise and index writes). A tensor's ops accumulate over its owner's init and
   then its ancestors', so a parent's write lands on top (a later `normal_` replaces an earlier
   fill, a later `mul_` composes): GPT-2's 1/sqrt(2 * n_layer) rescaling of `c_proj` from the
   attention/MLP module, T5's per-projection stds from `T5Attention` / `T5DenseActDense`;
2. allocates each tensor once, at its local (shard) size, and replays its ops on it
   (`replay.py`), from the last one that overwrites the whole tensor: deterministic ops cut to
   the shard's rows/columns, random fills drawn from per-block streams seeded from (seed, owner
   path, tensor name, op index, block index), so a value depends only on its position in the
   full tensor;
3. a tensor whose init the recorder cannot replay exactly (e.g. `orthogonal_`, which reads
   another tensor) takes the previous path instead, for that tensor only: full size on this
   rank, the inits of its owner and ancestors rerun in the same order, each under its module's
   seed `module_seed(seed, path)`, keep the slice; an `InitFallbackWarning` names it once. (An
   init that raises on stand-ins sends every tensor below its module down this path.)

Either way the shards merged across ranks equal the unsharded delayed build (tp=1) bit for bit,
for any TP degree and rank, on a given device type (CPU and CUDA generators draw different
numbers); a pipeline rank (`only=` its stages' tensors) gets the same values as the whole
model. The values are Slapo's own, not those of an eager `Model(config)` under the same
seed, but every tensor gets the init an eager model gives it: the same distributions with the
same resolved parameters and the same deterministic parts (zero biases, padding rows, ones for
norms), parents' writes included (tests/test_init_parent_order.py compares every family).

The init of each module, first that applies: `init_fn(module)` / `init_fn(module, path)`
(called on every module of the post-order, parents included), the `_init_weights(module)` of
the module's nearest Hugging Face ancestor (or of the model's first HF module), then
`module.reset_parameters()`; tensors none of them touch stay zero. HF's `_is_hf_initialized`
flags are neither read nor set: a flag says nothing about a tensor that is still meta. A tensor
tied under several names (an LM head tied to the embedding) is initialised once, through its
first owner's slot: writes through its other names are dropped, as HF drops the head's own init
when `post_init` ties it to the embedding. Weights that are already materialised are never
touched (a stand-in takes their slot while the inits run). An init in a plain module's
constructor (torchvision's ResNet, nanoGPT) runs on meta, i.e. computes nothing, but
`init_empty_weights()` records what it writes (`construct.py`), and those writes are replayed
instead of `reset_parameters()` (unless `init_fn` is given; Hugging Face models keep
`_init_weights`).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
import zlib
from collections.abc import Callable, Iterable

import torch
import torch.nn as nn

from .. import sharding
from . import construct, replay, scope
from .record import Recorder, Recording
from .scope import Step, Target


@contextlib.contextmanager
def init_empty_weights():
    """Create modules on the meta device (shapes only, no memory); buffers go to meta too and
    `build` materialises them like parameters. The writes a constructor makes into its tensors
    meanwhile are recorded (`construct.py`), so `materialize` gives a plain module the init
    its constructor wrote. (`slapo.init_empty_weights` also takes Slapo 2023's `enable=` and
    `include_buffers=`: `slapo.compat.build.init_empty_weights`.)"""
    with torch.device("meta"), construct.recording():
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


Init = Callable[[Step], None]


def _init_callable(model: nn.Module, init_fn: Callable | None) -> Init:
    """The init of one post-order step: `init_fn(module[, path])` when given; else the
    `_init_weights` of the module's nearest Hugging Face ancestor (or itself), as HF's
    `smart_apply` dispatches composite models, falling back to the model's first HF module
    for modules outside any (a wrapper's own head); else `module.reset_parameters()`.

    `_init_weights` is called directly, not through `_initialize_weights`: a module's
    `_is_hf_initialized` flag says nothing about a tensor that is still meta, and setting it
    would stop the fallback's second run."""
    if init_fn is not None:
        n = len(inspect.signature(init_fn).parameters)
        return (lambda s: init_fn(s.module, s.path)) if n >= 2 else (lambda s: init_fn(s.module))
    first = _hf_root(model)

    def default(step: Step) -> None:
        hf = step.hf or first
        if hf is not None:
            hf._init_weights(step.module)
        elif hasattr(step.module, "reset_parameters"):
            step.module.reset_parameters()

    return default


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str = "cpu", *,
                init_fn: Callable | None = None, seed: int = 0,
                only: Iterable[torch.Tensor] | None = None) -> nn.Module:
    """Allocate and initialise every meta tensor of `model` on `device` (see the module
    docstring); a shard is allocated at its local size only.

    `only`: materialise just these meta tensors (a pipeline rank's stages), leaving the rest
    on meta; the inits still run over the whole `model`, so a tensor gets its ancestors'
    writes exactly as in a full materialisation. Tensors shared by several modules stay
    shared, initialised at their first owner."""
    keep = None if only is None else {id(t) for t in only}
    todo = scope.targets(model, keep)
    if not todo:
        return model
    device = torch.device(device)
    init = _init_callable(model, init_fn)
    recorder = Recorder(device)
    # the init's own temporaries (a rotary table) go to `device`, not to an enclosing
    # `init_empty_weights()`'s meta
    with torch.device(device), scope.staged(model, todo, recorder):
        order = _steps(model, todo)
        _record(order, todo, init, recorder, device, seed)
        if init_fn is None and _hf_root(model) is None:
            _constructor_writes(todo, recorder.rec)
        values = _values(order, todo, init, recorder.rec, device, seed)
    new = {}
    for t in todo:
        new[id(t.meta)] = scope.wrap(values[t.key], t.meta, t.kind)
        carry_records(t.meta, new[id(t.meta)])
    scope.repoint(model, new)
    return model


def _steps(model: nn.Module, todo: list[Target]) -> list[Step]:
    """The post-order init calls that can write a target: each module holding one, and its
    ancestors."""
    owners = {id(t.mod) for t in todo}
    return scope.covering(scope.post_order(model), lambda m: id(m) in owners)


def _record(order: list[Step], todo: list[Target], init: Init, recorder: Recorder,
            device: torch.device, seed: int) -> None:
    """Run every step's init on the stand-ins, each under its module's seed, children first:
    each tensor's ops accumulate over its owner's init and then its ancestors'."""
    under = _keys_under(order, todo)
    for step in order:
        with _seeded(device, module_seed(seed, step.path)):
            recorder.run(lambda step=step: init(step), under[id(step.module)])


def _constructor_writes(todo: list[Target], rec: Recording) -> None:
    """A plain module's tensors take what its constructor wrote (`construct.py`) instead of
    their modules' `reset_parameters`: the constructor's writes include that reset (a Linear
    runs it in `__init__`) and whatever the author applied after it. Hugging Face models keep
    their `_init_weights` path, and a user `init_fn` wins over both. A constructor write that
    cannot be replayed leaves the tensor on the `reset_parameters` path, with a warning."""
    for t in todo:
        ctor = construct.constructor_init(t.meta)
        if ctor is None:
            continue
        if ctor.failed is not None:
            _warn_constructor(t, ctor.failed)
            continue
        rec.ops[t.key] = list(ctor.ops)
        rec.failed.pop(t.key, None)


def _keys_under(order: list[Step], todo: list[Target]) -> dict[int, list[str]]:
    """id(module) -> keys of the targets in its subtree (what its init can write)."""
    own: dict[int, list[str]] = {}
    for t in todo:
        own.setdefault(id(t.mod), []).append(t.key)
    out: dict[int, list[str]] = {}
    for step in order:  # post-order: children first
        keys = list(own.get(id(step.module), []))
        for child in step.module._modules.values():
            if child is not None:
                keys += out.get(id(child), [])
        out[id(step.module)] = keys
    return out


def _values(order: list[Step], todo: list[Target], init: Init, rec: Recording,
            device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """key -> this rank's value of each target: the recorded ops replayed on the local shard,
    or the full-size fallback for the tensors the replay cannot reproduce."""
    gen = torch.Generator(device=device)
    values = {}
    for t in todo:
        value = _replayed(t, rec, device, seed, gen)
        if value is not None:
            values[t.key] = value
    failed = [t for t in todo if t.key in rec.failed]
    if failed:
        values.update(_full_then_slice(order, failed, rec.failed, init, device, seed))
    return values


def _replayed(t: Target, rec: Recording, device: torch.device, seed: int,
              gen: torch.Generator) -> torch.Tensor | None:
    """The target's local shard with its recorded ops replayed (None: it fails over to the
    full-size path, the reason in `rec.failed`)."""
    lay = replay.layout(t.full_shape, sharding.shard_spec(t.meta))
    if t.slot() is not t.stand_in:
        rec.fail(t.key, "the init replaced the tensor instead of writing into it")
    elif lay.local_shape != tuple(t.meta.shape):
        rec.fail(t.key, f"its shard layout {lay} does not give the local shape "
                        f"{tuple(t.meta.shape)}")
    if t.key in rec.failed:
        return None
    local = torch.zeros(t.meta.shape, dtype=t.meta.dtype, device=device)
    ops = replay.live(rec.ops.get(t.key, []), t.full_shape)
    return replay.replay(ops, local, lay, seed, t.key, gen)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int):
    """The global RNG at `seed` for the duration, restored after (the init's own draws)."""
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        yield


def _full_then_slice(order: list[Step], failed: list[Target], reasons: dict[str, str],
                     init: Init, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The pre-replay path, for tensors the recorder could not replay: allocate them at full
    size, rerun the inits that can write them (their owners' and ancestors', in post-order,
    each under its module's seed), keep this rank's slice. Every other tensor is a stand-in
    meanwhile (recording is over), so those inits leave the rest alone."""
    for t in failed:
        _warn_fallback(t, reasons[t.key])
        t.put(torch.zeros(t.full_shape, dtype=t.meta.dtype, device=device))
    owners = {id(t.mod) for t in failed}
    for step in scope.covering(order, lambda m: id(m) in owners):
        with _seeded(device, module_seed(seed, step.path)):
            init(step)
    out = {}
    for t in failed:
        value = t.slot().detach()
        spec = sharding.shard_spec(t.meta)
        if spec is not None:
            value = sharding.local_slice(value, spec.axis, spec.world_size, spec.rank,
                                         spec.blocks).clone()
        out[t.key] = value
    return out


def carry_records(old: torch.Tensor, new: torch.Tensor) -> None:
    """Shard spec, expert shard (`--ep`) and Slapo's tags travel from the meta tensor to its
    materialised value."""
    spec = sharding.shard_spec(old)
    if spec is not None:
        new._slapo_shard = spec
    experts = getattr(old, sharding.EXPERT_SHARD_ATTR, None)
    if experts is not None:
        setattr(new, sharding.EXPERT_SHARD_ATTR, experts)
    tags = getattr(old, "_slapo_tags", None)
    if tags:
        new._slapo_tags = dict(tags)
        for key, v in tags.items():
            setattr(new, key, v)


class InitFallbackWarning(UserWarning):
    """A tensor was initialised at full size and then sliced: its init does something the
    shard replay cannot reproduce exactly (the message says what)."""


_WARNED: set[tuple[str, str, str]] = set()


def _warn_fallback(t: Target, reason: str) -> None:
    _warn_once(t, reason, f"{_where(t)} {t.full_shape} (and {type(t.mod).__name__}.{t.name} "
               f"elsewhere) was allocated at full size and then sliced, because {reason}. Give "
               "the module an init made of random fills, constants and elementwise ops (or "
               "slapo.build(init_weights=...)) to initialise the shard alone.")


def _warn_constructor(t: Target, reason: str) -> None:
    _warn_once(t, "constructor: " + reason, f"the constructor's init of {_where(t)} cannot be "
               f"replayed ({reason}); it gets its module's reset_parameters() instead. Pass "
               "slapo.build(init_weights=fn) with fn(module) applying that init to get it.")


def _where(t: Target) -> str:
    return f"{t.path}.{t.name}" if t.path else t.name


def _warn_once(t: Target, reason: str, message: str) -> None:
    """Once per (module class, tensor, reason): a 48-layer model warns once, not 48 times."""
    key = (type(t.mod).__name__, t.name, reason)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"delayed init: {message}", InitFallbackWarning, stacklevel=7)


def reset_init_warnings() -> None:
    """Forget which fallbacks were reported (tests)."""
    _WARNED.clear()
