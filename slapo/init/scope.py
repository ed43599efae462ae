"""Which tensors a delayed init materialises, which module inits run, in what order, and the
stand-ins that sit in every tensor slot of the model while they run.

Why the whole model at once and not module by module: an init may write tensors of its
children (HF's `GPT2PreTrainedModel._init_weights(GPT2Attention)` rescales `c_proj.weight`,
`T5PreTrainedModel._init_weights(T5Attention)` sets each projection's std from the config).
Hugging Face runs `_init_weights` over the modules children first, parent last (`smart_apply`,
a post-order), so a parent's write lands after, and on top of, the child's own init. To see
those writes, every pending tensor of the model has its stand-in in place before any init runs,
and the inits run in the same post-order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import sharding
from .record import Recorder


@dataclass
class Target:
    """One meta tensor to materialise, at its canonical slot: the first module (in
    `named_modules` order) holding it. A tensor tied under several names (GPT-2's embedding and
    LM head) is one target; writes through its other slots are dropped, as Hugging Face drops
    the LM head's own init when it ties the head to the embedding after initialising both."""

    path: str
    mod: nn.Module
    name: str
    kind: str  # "p" (parameter) or "b" (buffer)
    meta: torch.Tensor
    stand_in: torch.Tensor | None = None  # its tracked stand-in while `staged`

    @property
    def key(self) -> str:
        """The recorder's name for the tensor and the root of its random streams."""
        return f"{self.path}:{self.name}"

    @property
    def full_shape(self) -> tuple[int, ...]:
        return full_shape(self.meta)

    def slot(self) -> torch.Tensor | None:
        return slots(self.mod, self.kind).get(self.name)

    def put(self, value: torch.Tensor) -> None:
        slots(self.mod, self.kind)[self.name] = wrap(value, self.meta, self.kind)


@dataclass(frozen=True)
class Step:
    """One init call of the post-order: `module` at `path`; `hf` is its nearest ancestor (or
    itself) with the Hugging Face `_init_weights(module)` and a `config` (None: none above)."""

    path: str
    module: nn.Module
    hf: nn.Module | None


def slots(mod: nn.Module, kind: str) -> dict:
    return mod._parameters if kind == "p" else mod._buffers


def full_shape(t: torch.Tensor) -> tuple[int, ...]:
    spec = sharding.shard_spec(t)
    return tuple(spec.orig_shape) if spec else tuple(t.shape)


def wrap(value: torch.Tensor, like: torch.Tensor, kind: str) -> torch.Tensor:
    return nn.Parameter(value, requires_grad=like.requires_grad) if kind == "p" else value


def _own(mod: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) of the module's own parameters and buffers."""
    for kind in ("p", "b"):
        for name, t in slots(mod, kind).items():
            if t is not None:
                yield kind, name, t


def targets(model: nn.Module, only: set[int] | None) -> list[Target]:
    """The meta tensors to materialise (those whose id is in `only`, if given), each once, at
    its first owner in `named_modules` order."""
    out, seen = [], set()
    for path, mod in model.named_modules():
        for kind, name, t in _own(mod):
            if t.device.type != "meta" or id(t) in seen or (only is not None and id(t) not in only):
                continue
            seen.add(id(t))
            out.append(Target(path, mod, name, kind, t))
    return out


def _is_hf(mod: nn.Module) -> bool:
    return hasattr(mod, "_init_weights") and hasattr(mod, "config")


def post_order(model: nn.Module) -> list[Step]:
    """Every module once (at its `named_modules` path), children before their parent: the
    order of `nn.Module.apply` and of Hugging Face's `smart_apply`."""
    out: list[Step] = []
    seen: set[int] = set()

    def visit(mod: nn.Module, path: str, hf: nn.Module | None) -> None:
        seen.add(id(mod))
        hf = mod if _is_hf(mod) else hf
        for name, child in mod._modules.items():
            if child is not None and id(child) not in seen:
                visit(child, f"{path}.{name}" if path else name, hf)
        out.append(Step(path, mod, hf))

    visit(model, "", None)
    return out


def covering(order: list[Step], owned: Callable[[nn.Module], bool]) -> list[Step]:
    """The steps whose subtree holds a module for which `owned` is true (a module's init can
    write anything in its subtree), in the same order."""
    hit: set[int] = set()
    for step in order:  # post-order: children are decided before their parent
        mod = step.module
        if owned(mod) or any(c is not None and id(c) in hit for c in mod._modules.values()):
            hit.add(id(mod))
    return [s for s in order if id(s.module) in hit]


@contextlib.contextmanager
def staged(model: nn.Module, todo: list[Target], recorder: Recorder) -> Iterator[None]:
    """Every tensor slot of the model holds a stand-in meanwhile: a target's canonical slot a
    tracked one (its writes are recorded under `Target.key`), every other slot (materialised
    weights, meta tensors left for another rank, a tied tensor's other names) an untracked one,
    so no init touches what it must not. Every slot gets its old tensor back on exit."""
    canonical = {(id(t.mod), t.kind, t.name): t for t in todo}
    kept: list[tuple[dict, str, torch.Tensor]] = []
    for mod in model.modules():
        for kind, name, t in _own(mod):
            target = canonical.get((id(mod), kind, name))
            key = target.key if target is not None else None
            kept.append((slots(mod, kind), name, t))
            stand_in = wrap(recorder.stand_in(key, full_shape(t), t.dtype), t, kind)
            slots(mod, kind)[name] = stand_in
            if target is not None:
                target.stand_in = stand_in
    try:
        yield
    finally:
        for table, name, t in kept:
            table[name] = t


def repoint(model: nn.Module, values: dict[int, torch.Tensor]) -> None:
    """Every slot holding a materialised meta tensor (`values`: id(meta) -> new tensor) now
    holds the new tensor: tied names stay tied."""
    for mod in model.modules():
        for kind, name, t in list(_own(mod)):
            if id(t) in values:
                slots(mod, kind)[name] = values[id(t)]
