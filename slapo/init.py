"""Delayed initialisation: build on the meta device, shard, then materialise only local shards.

    with slapo.init_empty_weights():
        model = BertModel(config)          # no memory allocated
    sch = slapo.create_schedule(model)
    ... shard ...
    model, _ = slapo.build(sch, seed=0)    # each rank allocates and initialises its shards

Each module is initialised under its own RNG seed derived from (seed, module path), so a shard is
bit-for-bit the slice of the full tensor the same procedure gives without sharding, independent of
tensor-parallel degree and rank. Per module, the full-size tensors exist only transiently (one
module at a time); the model ends up holding shards only.

Initialisation per module, first that applies: `init_fn(module)` / `init_fn(module, path)`, the
Hugging Face model's `_init_weights(module)`, `module.reset_parameters()`; tensors none of them
touch stay zero. Weights that are already materialised are never touched.
"""

from __future__ import annotations

import contextlib
import inspect
import zlib
from collections.abc import Callable

import torch
import torch.nn as nn

from . import sharding


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
    """Allocate and initialise every meta tensor of `model` on `device` (shards stay shards)."""
    init = _init_callable(model, init_fn)
    device = torch.device(device)
    done: dict[int, torch.Tensor] = {}  # id(meta tensor) -> materialised (keeps ties tied)
    for path, mod in model.named_modules(remove_duplicate=False):
        metas = []
        for k, d in (("p", mod._parameters), ("b", mod._buffers)):
            for n, t in list(d.items()):
                if t is None or t.device.type != "meta":
                    continue
                if id(t) in done:
                    d[n] = done[id(t)]
                else:
                    metas.append((n, t, k))
        if not metas:
            continue
        # 1. full-size zero tensors, so the init function sees the original shapes
        full = {}
        for n, t, k in metas:
            spec = sharding.shard_spec(t)
            shape = spec.orig_shape if spec else tuple(t.shape)
            z = torch.zeros(shape, dtype=t.dtype, device=device)
            full[n] = nn.Parameter(z, requires_grad=t.requires_grad) if k == "p" else z
            (mod._parameters if k == "p" else mod._buffers)[n] = full[n]
        # 2. initialise under a per-module seed
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            torch.manual_seed(module_seed(seed, path))
            init(mod, path)
        # 3. keep this rank's slice; carry shard specs and tags over
        for n, t, k in metas:
            spec = sharding.shard_spec(t)
            value = (mod._parameters if k == "p" else mod._buffers)[n].detach()
            if spec is not None:
                value = sharding.local_slice(value, spec.axis, spec.world_size, spec.rank,
                                             spec.blocks).clone()
            new = nn.Parameter(value, requires_grad=t.requires_grad) if k == "p" else value
            if spec is not None:
                new._slapo_shard = spec
            tags = getattr(t, "_slapo_tags", None)
            if tags:
                new._slapo_tags = dict(tags)
                for key, v in tags.items():
                    setattr(new, key, v)
            (mod._parameters if k == "p" else mod._buffers)[n] = new
            done[id(t)] = new
        del full
    return model
