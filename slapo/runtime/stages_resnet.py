"""Pipeline stages of a torchvision-layout ResNet (the WideResNet family's `partition`).

Same contract as the transformer stages (`runtime.partition`): a stage shares the model's
blocks (no copies; names kept), the first adds the stem, the last avgpool + flatten + fc, and
their composition is the model's forward. The layout is detected from modules, not a class:
`conv1` (Conv2d), `bn1` (BatchNorm), `layer1`..`layer4` (sequences of blocks with
`conv1`/`bn1`/`conv2`) and `fc`, at the root or under a prefix (the 2023 loss wrapper's
`model`). The schedule side (TP plan, checkpointing, cuts) is `model_schedule.wideresnet`.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import SchedulingError
from ..module_patch import original_class

STAGES = ("layer1", "layer2", "layer3", "layer4")
STEM = ("conv1", "bn1", "relu", "maxpool")
HEAD = ("avgpool", "fc")


def is_a(mod, cls) -> bool:
    return mod is not None and issubclass(original_class(mod), cls)


def _is_block(mod: nn.Module) -> bool:
    return all(is_a(getattr(mod, n, None), c) for n, c in
               (("conv1", nn.Conv2d), ("bn1", nn.modules.batchnorm._BatchNorm),
                ("conv2", nn.Conv2d)))


def _is_resnet_body(mod: nn.Module) -> bool:
    if not (is_a(getattr(mod, "conv1", None), nn.Conv2d) and
            is_a(getattr(mod, "bn1", None), nn.modules.batchnorm._BatchNorm)
            and isinstance(getattr(mod, "fc", None), nn.Module)):
        return False
    stages = [getattr(mod, s, None) for s in STAGES]
    return all(isinstance(s, nn.Sequential) and len(s) and all(_is_block(b) for b in s)
               for s in stages)


def resnet_prefix(model: nn.Module) -> str | None:
    """Path of the ResNet body ("" at the root, "model" under the 2023 loss wrapper), or None."""
    for path, mod in model.named_modules():
        if _is_resnet_body(mod):
            return path
    return None


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _graft(container: nn.Module, root: nn.Module, path: str) -> None:
    """Register `root.get_submodule(path)` in `container` under the same dotted path (so stage
    parameter names are the full model's)."""
    parent = container
    parts = path.split(".")
    for part in parts[:-1]:
        if part not in parent._modules:
            parent.add_module(part, nn.Module())
        parent = parent._modules[part]
    parent.add_module(parts[-1], root.get_submodule(path))


class ResNetStage(nn.Module):
    """One pipeline stage of a ResNet: blocks `paths` (shared with the model), the stem on the
    first stage, avgpool + flatten + fc on the last. forward(x): images on the first stage,
    feature maps elsewhere; logits from the last."""

    def __init__(self, root: nn.Module, prefix: str, blocks: list[str], first: bool,
                 last: bool):
        super().__init__()
        self.prefix, self.blocks, self.first, self.last = prefix, list(blocks), first, last
        self.input_names = ("x",) if first else ()
        self.paths = [join_path(prefix, n) for n in STEM] * first + list(blocks) + \
            [join_path(prefix, n) for n in HEAD] * last
        for path in self.paths:
            _graft(self, root, path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            for name in STEM:
                x = self.get_submodule(join_path(self.prefix, name))(x)
        for path in self.blocks:
            x = self.get_submodule(path)(x)
        if self.last:
            x = self.get_submodule(join_path(self.prefix, "avgpool"))(x)
            x = self.get_submodule(join_path(self.prefix, "fc"))(torch.flatten(x, 1))
        return x

    def default_loss(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """Cross-entropy against `batch['labels']` (the 2023 benchmark's loss)."""
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if labels is None:
            raise SchedulingError("", "the batch has no `labels` for the ResNet's "
                                  "cross-entropy.", "add labels, or pass loss_fn=.")
        return F.cross_entropy(logits, labels.reshape(-1))


def partition(sch, num_stages: int | None = None) -> list[ResNetStage]:
    """The stage modules of a cut ResNet schedule (same contract as
    `slapo.runtime.partition.partition`: their composition is the model's forward)."""
    prefix = resnet_prefix(sch.mod)
    if prefix is None:
        raise SchedulingError(sch.path, "not a ResNet layout (conv1, bn1, layer1..layer4, fc).",
                              "use slapo.runtime.partition for transformer models.")
    blocks = [join_path(join_path(prefix, s), str(i)) for s in STAGES
              for i in range(len(sch.mod.get_submodule(join_path(prefix, s))))]
    cuts = list(sch.pipeline_cuts)
    bad = [c for c in cuts if c not in blocks]
    if not cuts or bad:
        raise SchedulingError(sch.path, f"ResNet pipeline cuts must be blocks of layer1..layer4"
                              f" (got {cuts or 'none'}).", "cut e.g. sch['layer2.0'].")
    n = len(cuts) + 1 if num_stages is None else num_stages
    if len(cuts) + 1 != n:
        raise SchedulingError(sch.path, f"{len(cuts)} cut(s) give {len(cuts) + 1} stages, not "
                              f"{n}.", f"cut {n - 1} block(s).")
    bounds = [0] + sorted(blocks.index(c) + 1 for c in cuts) + [len(blocks)]
    if any(hi <= lo for lo, hi in zip(bounds, bounds[1:])):
        raise SchedulingError(sch.path, f"the cuts {cuts} leave a stage without blocks.",
                              "cut distinct blocks, not the last one.")
    return [ResNetStage(sch.mod, prefix, blocks[lo:hi], s == 0, s == n - 1)
            for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
