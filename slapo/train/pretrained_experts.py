"""Mixture-of-experts checkpoints in Hugging Face's per-expert format, read into the fused
experts tensors the model holds.

Why: transformers 5 models keep each layer's experts as stacked tensors (`mlp.experts.gate_up_proj`
[E, 2I, H], `mlp.experts.down_proj` [E, H, I]), but `save_pretrained` and the Hub keep one tensor
per expert (`mlp.experts.3.gate_proj.weight` [I, H], ...; Mixtral's `block_sparse_moe.experts.3.w1`).
HF converts at load time with the `WeightConverter`s of `transformers.conversion_mapping`. Slapo's
loader reads tensors by key, each rank only its shard, so it takes the same declarations and
reads the fused tensor's pieces from the per-expert ones: a converter whose operations are
`MergeModulelist(dim=0)` (stack the experts), optionally then `Concatenate(dim=1)` (gate | up),
with the plain-string `WeightRenaming`s reversed (for every tensor: Mixtral's router too). Any other conversion is not guessed: the
loader's "no weights for ..." error stays.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn


@dataclass(frozen=True)
class MergedKey:
    """A fused experts tensor's checkpoint keys: per concatenated part, one key per expert."""

    parts: tuple[tuple[str, ...], ...]

    def keys(self) -> list[str]:
        return [k for part in self.parts for k in part]

    def reader(self, open_key: Callable[[str], object]) -> MergedSlice:
        return MergedSlice(self, open_key)


class MergedSlice:
    """What `pretrained.local_piece` reads from: the fused tensor's shape, and any box of it
    assembled from the per-expert slices it covers (nothing else is read)."""

    def __init__(self, key: MergedKey, open_key: Callable[[str], object]):
        self.key, self.open = key, open_key
        shapes = [tuple(open_key(part[0]).get_shape()) for part in key.parts]
        self.sizes = [s[0] for s in shapes]
        self.rest = shapes[0][1:]
        self.shape = (len(key.parts[0]), sum(self.sizes), *self.rest)

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: tuple) -> torch.Tensor:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        experts = range(self.shape[0])[index[0]]
        lo, hi, _ = index[1].indices(self.shape[1])
        out = []
        for e in experts:
            pieces, start = [], 0
            for part, size in zip(self.key.parts, self.sizes):
                a, b = max(lo, start), min(hi, start + size)
                if a < b:
                    pieces.append(self.open(part[e])[(slice(a - start, b - start), *index[2:])])
                start += size
            out.append(torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0])
        return torch.stack(out)


def merged_key(model: nn.Module, name: str, shape: tuple[int, ...], keys: dict[str, Path],
               checkpoint_key: Callable[[str], str | None]) -> MergedKey | None:
    """The per-expert keys of the fused tensor `name` (full shape `shape`) in this checkpoint,
    by the model's own HF conversion declarations; None when none applies or a key is missing."""
    convs = _conversions(model)
    if not convs or len(shape) != 3:
        return None
    converters, renames = convs
    for sources, target, concat in converters:
        if not name.endswith(target.lstrip(".")):
            continue
        stem = name[: len(name) - len(target.lstrip("."))]
        parts = []
        for pattern in sources:
            part = []
            for e in range(shape[0]):
                key = checkpoint_key(_unrename(stem + pattern.lstrip(".").replace("*", str(e)),
                                               renames))
                if key is None:
                    return None
                part.append(key)
            parts.append(tuple(part))
        if len(parts) > 1 and not concat:
            return None
        return MergedKey(tuple(parts))
    return None


def renamed_key(model: nn.Module, name: str,
                checkpoint_key: Callable[[str], str | None]) -> str | None:
    """The checkpoint key of `name` under the model's HF renamings (Mixtral's
    `block_sparse_moe` for `mlp`), or None."""
    convs = _conversions(model)
    if not convs or not convs[1]:
        return None
    old = _unrename(name, convs[1])
    return checkpoint_key(old) if old != name else None


def _conversions(model: nn.Module):
    """([(source patterns, target pattern, concatenated)], [(checkpoint, model) renamings]) of
    the model's HF conversion mapping, the supported kinds only; None without one."""
    try:
        from transformers.conversion_mapping import extract_weight_conversions_for_model
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
        )
    except ImportError:
        return None
    if not hasattr(model, "config"):
        return None
    found = extract_weight_conversions_for_model(model) or []
    converters, renames = [], []
    for conv in found:
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        if isinstance(conv, WeightRenaming) and len(sources) == len(targets) == 1 and \
                all(_plain(p) for p in sources + targets):
            renames.append((sources[0], targets[0]))
        elif isinstance(conv, WeightConverter) and len(targets) == 1:
            ops = list(conv.operations)
            merge = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
            concat = len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1
            if merge and (len(ops) == 1 or concat):
                converters.append((sources, targets[0], concat))
    return converters, renames


def _plain(pattern: str) -> bool:
    return not any(c in pattern for c in "^$*+?()[]{}|\\")


def _unrename(key: str, renames: list[tuple[str, str]]) -> str:
    """The checkpoint's name for a model key (the renamings run backwards)."""
    for source, target in renames:
        key = key.replace(target, source)
    return key


__all__ = ["MergedKey", "MergedSlice", "merged_key", "renamed_key"]
