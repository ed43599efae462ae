"""WideResNet (torchvision's ResNet of Bottleneck blocks): the first ready schedule for a CNN.

    sch = slapo.model_schedule.apply(resnet, tp=2, ckpt_ratio=0.5, pp_stages=2)

The family is detected from the module layout, not a config or a class: a module with
`conv1` (nn.Conv2d), `bn1` (nn.BatchNorm2d), `layer1`..`layer4` (sequences of blocks that have
`conv1`/`bn1`/`conv2`) and `fc`, at the root or under a prefix (the 2023 benchmark's loss
wrapper keeps it at `model`). So `torchvision.models.wide_resnet50_2()`, the 2023 sizes
(`tests/vision_models.py`) and any copy of that layout get the same schedule.

**Channel tensor parallelism** (`TP_PLAN`, one row per module of a block):

    conv1  ConvOut + ReduceInputGrad   1x1, this rank's 1/tp of the inner width
    bn1    NormChannels                weight, bias, running mean/var of those channels
    conv2  ConvIn (all-reduce after)   3x3 over this rank's channels -> partial sum -> whole

Where the all-reduce goes, and why: right after `conv2`, the block's only forward collective.
conv1 and conv2 are about 85% of a wide block's FLOPs and weights (a 1x1 of in x w, a 3x3 of
w x w = 9 w^2, against conv3's w x 4w/2); splitting them Megatron-style (column, then row) needs
one all-reduce of the inner width w, the smallest activation of the block, and BatchNorm on the
split channels is exact (its statistics are per channel). conv3, bn2, bn3 and the downsample
path stay replicated: each rank computes them on the whole activation, so their gradients are
identical on every rank without any collective. The 2023 schedule also split conv3 and
all-gathered its output (a second forward collective, of 4w channels: twice the bytes) to save
its weights; not done here. The backward all-reduce sits on conv1's *input* (not the block's):
the identity/downsample path carries the rest of that gradient whole on every rank.

**Checkpointing** is per stage: `ckpt_ratio` r checkpoints round-half-up(r * n_k) blocks of
each of layer1..layer4 (the first ones; compat's "uniform" spaces them evenly), so every
resolution saves the same share. Recomputing a block re-runs its BatchNorms in training mode,
which would update their running statistics a second time (plain torch.utils.checkpoint does:
a known trap); the `checkpoint` primitive itself keeps them as the real forward left them, for
any checkpointed module (`slapo.primitives.checkpoint.running_stats_kept`).

**Offloading** (`offload_ratio` r) is per stage too: round-half-up(r * n_k) blocks of each
stage, the ones after its checkpointed blocks, keep their saved activations in host memory
(`offload` primitive); exact, BatchNorm untouched (nothing is recomputed).

**Pipeline**: `pp_stages` cuts at evenly spaced block boundaries over the 4 stages' blocks; the
2023 form `apply_schedule(..., pipeline_cuts=[[..], [..], [..], [..]])` cuts after
`layer{k+1}[i]` for each i of list k. `partition(sch)` builds the stage modules (the stem with
the first, avgpool + fc with the last; blocks shared, names kept).

*BatchNorm under a pipeline*: training-mode BN normalises each micro-batch with that
micro-batch's statistics and updates the running statistics once per micro-batch, so a
pipelined step equals the unscheduled model run on the *same micro-batches* one after the other
(gradients summed, loss averaged), not on the whole batch at once. This is inherent to
micro-batching a BN network (GPipe's paper notes it), not a pipeline bug; `tests/test_wideresnet.py`
checks exactly that reference.

`compile_blocks` compiles every block on its own (`compile` primitive: one graph per distinct
block; checkpointing, channel TP's collectives and `sync_batchnorm` run inside; BN statistics
are mutated in the graph and counted once under recomputation, tests/test_wideresnet.py).

Knobs that mean nothing for a CNN (`attention`, `fuse`, `fuse_compiler`, `tempo`, `kernels`,
`sequence_parallel`, `vocab_parallel`, `fused_loss`) raise a `KnobError` naming the knob when
they differ from their default: `slapo train`/`slapo tune` pass every knob at its default,
which is "not set".
"""

from __future__ import annotations

import math

import torch.nn as nn

from ..errors import SchedulingError
from ..runtime.stages_resnet import (
    STAGES,
    ResNetStage,
    join_path,
    partition,
    resnet_prefix,
)
from ..schedule import Schedule
from ._registry import Family, compile_layers
from .knobs import KnobError, ScheduleKnobs, spec
from .plan import ReduceInputGrad, TPPlan
from .plan_channels import ConvIn, ConvOut, NormChannels

TP_PLAN = TPPlan((
    ("conv1", ConvOut()),
    ("conv1", ReduceInputGrad()),  # its input also flows whole through the residual path
    ("bn1", NormChannels()),
    ("conv2", ConvIn()),           # all-reduce: the block's one forward collective
))

MEANINGLESS = ("attention", "fuse", "fuse_compiler", "tempo", "kernels", "sequence_parallel",
               "vocab_parallel", "fused_loss")


# ---- detection --------------------------------------------------------------------------------

def matches(model: nn.Module) -> bool:
    return resnet_prefix(model) is not None


def stage_nodes(sch: Schedule) -> list[list[Schedule]]:
    """The blocks of layer1..layer4, one list per stage."""
    prefix = resnet_prefix(sch.mod)
    return [list(sch[join_path(prefix, s)]) for s in STAGES]


# ---- apply ------------------------------------------------------------------------------------

def schedule(sch: Schedule, knobs: ScheduleKnobs) -> Schedule:
    """`model_schedule.apply` for a ResNet (knob values already validated by the schema)."""
    tp = sch.tp_size if knobs.tp is None else knobs.tp
    check(sch, knobs, tp)
    stages = stage_nodes(sch)
    if tp > 1:
        for block in (b for s in stages for b in s):
            TP_PLAN.apply(block, tp)
    checkpoint_stages(stages, knobs.ckpt_ratio,
                      None if knobs.ckpt_policy == "full" else knobs.ckpt_policy)
    offload_stages(stages, knobs.ckpt_ratio, knobs.offload_ratio)
    if knobs.compile_blocks:
        compile_layers(sch, [b for s in stages for b in s], knobs.compile_blocks)
    if knobs.pp_stages > 1:
        cut_evenly([b for s in stages for b in s], knobs.pp_stages)
    return sch


def check(sch: Schedule, knobs: ScheduleKnobs, tp: int) -> None:
    """Every check before the first change (a rejected call leaves the model untouched)."""
    for name in MEANINGLESS:
        value, default = getattr(knobs, name), spec(name)["default"]
        if value != default:
            raise KnobError(name, f"{name}={value!r} has no meaning for a convolutional "
                            "network (the WideResNet schedule has channel TP, per-stage "
                            "checkpointing and pipeline cuts).", f"leave {name} at its "
                            f"default ({default!r}).", sch.path)
    if tp not in (1, sch.tp_size):
        raise SchedulingError(sch.path, f"tp={tp} but the schedule's tensor-parallel group has "
                              f"{sch.tp_size} rank(s).", "create the schedule on a group of "
                              "that size, or pass tp=None.")
    stages = stage_nodes(sch)
    if tp > 1:
        for block in (b for s in stages for b in s):
            TP_PLAN.resolve(block, tp)
    n_blocks = sum(len(s) for s in stages)
    if knobs.pp_stages > n_blocks:
        raise SchedulingError(sch.path, f"{n_blocks} blocks cannot make {knobs.pp_stages} "
                              "pipeline stages.", "use fewer pipeline stages.")


# ---- checkpointing ----------------------------------------------------------------------------

def n_checkpointed(n_blocks: int, ratio: float) -> int:
    """round-half-up(ratio * n): ratio 0.5 of 3 blocks checkpoints 2 (2023 floored: 1)."""
    return math.floor(ratio * n_blocks + 0.5)


def checkpoint_stages(stages: list[list[Schedule]], ratio: float, policy=None,
                      method: str = "head") -> int:
    """Checkpoint `ratio` of each stage's blocks: the first ones ("head") or evenly spaced
    ("uniform"); their BatchNorm statistics are guarded (see the module doc). Returns the
    number of checkpointed blocks."""
    if not 0.0 <= ratio <= 1.0:
        raise SchedulingError("", f"ckpt_ratio must be in [0, 1], got {ratio}.",
                              "pass e.g. ckpt_ratio=0.5.")
    total = 0
    for blocks in stages:
        n = n_checkpointed(len(blocks), ratio)
        picked = range(n) if method == "head" else \
            sorted({math.floor(k * len(blocks) / n) for k in range(n)})
        for i in picked:
            _checkpoint(blocks[i], policy)
        total += n
    return total


def offload_stages(stages: list[list[Schedule]], ckpt_ratio: float, ratio: float) -> int:
    """Offload (`offload` primitive) round-half-up(ratio * n_k) blocks of each stage, the ones
    after its checkpointed blocks (the first round-half-up(ckpt_ratio * n_k)): per stage, as
    checkpointing, so every resolution offloads the same share; a block is checkpointed or
    offloaded (the schema refuses ratios summing above 1). Offloading copies saved tensors only:
    BatchNorm runs once, its statistics are untouched. Returns the number of offloaded blocks."""
    total = 0
    for blocks in stages:
        first = n_checkpointed(len(blocks), ckpt_ratio)
        n = min(n_checkpointed(len(blocks), ratio), len(blocks) - first)
        for block in blocks[first:first + n]:
            block.offload()
        total += n
    return total


def _checkpoint(block: Schedule, policy) -> None:
    """The `checkpoint` primitive keeps the block's BatchNorm statistics through the
    recomputation (`slapo.primitives.checkpoint.running_stats_kept`)."""
    if policy is None:
        block.checkpoint()
    else:
        block.checkpoint(policy=policy)


# ---- pipeline cuts ----------------------------------------------------------------------------

def cut_evenly(blocks: list[Schedule], num_stages: int) -> None:
    """Cuts after blocks round(s * n / stages) - 1, s = 1 .. stages - 1."""
    per = len(blocks) / num_stages
    for s in range(1, num_stages):
        blocks[round(s * per) - 1].cut_pipeline_stage()


def check_cut_lists(sch: Schedule, cuts: list) -> None:
    """The 2023 form: four lists of block indices, one per stage (layer1..layer4)."""
    if not isinstance(cuts, (list, tuple)) or len(cuts) != 4 or \
            not all(isinstance(c, (list, tuple)) for c in cuts):
        raise SchedulingError(sch.path, f"wideresnet pipeline_cuts must be four lists (block "
                              f"indices in layer1..layer4), got {cuts!r}.",
                              "pass e.g. pipeline_cuts=[[], [1], [], []].")
    for stage, (blocks, ks) in enumerate(zip(stage_nodes(sch), cuts)):
        for k in ks:
            if not isinstance(k, int) or not 0 <= k < len(blocks):
                raise SchedulingError(sch.path, f"pipeline cut {k!r} is outside 0.."
                                      f"{len(blocks) - 1} of layer{stage + 1}.",
                                      "cut after an existing block.")
    last = cuts[3]
    if len(stage_nodes(sch)[3]) - 1 in last:
        raise SchedulingError(sch.path, "a cut after the last block of layer4 leaves the last "
                              "stage without blocks.", "cut an earlier block.")


def cut_lists(sch: Schedule, cuts: list) -> None:
    check_cut_lists(sch, cuts)
    for blocks, ks in zip(stage_nodes(sch), cuts):
        for k in sorted(set(ks)):
            blocks[k].cut_pipeline_stage()


FAMILY = Family(name="wideresnet", model_types=(), layer_lists=STAGES, tp_plan=TP_PLAN,
                matches=matches, schedule=schedule,
                notes="torchvision ResNet/WideResNet (Bottleneck blocks), detected by layout")

__all__ = ["FAMILY", "TP_PLAN", "ResNetStage", "checkpoint_stages", "cut_lists", "matches",
           "partition", "resnet_prefix", "schedule"]
