"""Partition a scheduled model into pipeline stage modules at its `cut_pipeline_stage` cuts.

Approach (torchtitan's, not Slapo 2023's whole-model trace + split_module): a stage is a small
module that *shares* the original submodules (no copies) for its layers, and for HF models adds
what the ends need: the first stage the embeddings, later stages take hidden states, the last
the final norm and head. Sharing means every primitive applied to a layer (shard/sync hooks,
checkpoint, traced/fused graphs) comes along and parameter names stay those of the full model.
Decoder LMs (GPT-2, OPT; a decoder with a declared `base_model_pp_plan`, `stages_declared`)
get `stages_decoder.HFDecoderStage`; encoders (BERT, RoBERTa:
the base model, or `*ForMaskedLM` with its head on the last stage) `stages_encoder.BertStage`;
torchvision-layout ResNets `stages_resnet.ResNetStage`; T5/mT5 conditional generation
`stages_seq2seq.T5Stage`.
Only model types whose forward the stages are checked to reproduce are partitioned
(`check_partitionable`, also called by `model_schedule.apply(pp_stages=...)` before it cuts).
Other head classes (sequence classification, pre-training) are not partitioned: `build` refuses
them, naming the parameters no stage holds (`check_stage_coverage`), instead of training
without them. `slapo.pipeline` is the public (and 2023) name of this module's functions.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SchedulingError
from .peft_wrapper import peft_inner_path
from .stages_decoder import DecoderLayout, HFDecoderStage, layer_bounds, layout_of
from .stages_encoder import BertStage, check_encoder, encoder_prefix
from .stages_resnet import partition as resnet_partition
from .stages_resnet import resnet_prefix
from .stages_seq2seq import check_seq2seq, is_seq2seq
from .stages_seq2seq import partition as seq2seq_partition


def cuts_of(sch) -> list[str]:
    """The recorded stage boundaries, in model order."""
    return list(sch.pipeline_cuts)


def peft_inner(model: nn.Module) -> str | None:
    """The path of the HF model inside a PEFT `PeftModel` with tuner layers (LoRA:
    `base_model.model`), None for any other module. The stages are built for the inner model
    (its layout is the family's) and carry it under this prefix (`PrefixedStage`), so their
    parameter names are the wrapper's. Prompt learning (virtual tokens the wrapper's forward
    adds before the model) is refused: the stages would skip them."""
    inner = peft_inner_path(model)
    if inner == "base_model":
        raise SchedulingError("", f"pipeline stages of a prompt-learning {type(model).__name__}: "
                              "its forward adds virtual tokens the stages would not.",
                              "pipeline a LoRA (tuner) PeftModel, or train without pp_stages.")
    return inner


class PrefixedStage(nn.Module):
    """A stage of the model inside a `PeftModel`, registered under `prefix` so its parameter
    and state-dict names are the wrapper's (`base_model.model.model.layers.0...`), as one
    process's optimizer, checkpoints and the adapters' export name them. Everything the
    pipeline runtime asks of a stage (its inputs, loss, outputs) is the inner stage's."""

    def __init__(self, stage: nn.Module, prefix: str):
        super().__init__()
        parent: nn.Module = self
        *outer, last = prefix.split(".")
        for name in outer:
            child = nn.Module()
            parent.add_module(name, child)
            parent = child
        parent.add_module(last, stage)
        self.__dict__["_stage"] = stage

    def forward(self, *args, **kwargs):
        return self._stage(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_stage" not in self.__dict__:  # still in __init__
                raise
            return getattr(self.__dict__["_stage"], name)


class _InnerSchedule:
    """The schedule as the inner model's partition reads it: its module, its cuts relative to
    it, the path for messages."""

    def __init__(self, sch, prefix: str):
        self.mod, self.path, self._root = sch.mod.get_submodule(prefix), sch.path, sch._root
        self.pipeline_cuts = tuple(c[len(prefix) + 1:] for c in sch.pipeline_cuts
                                   if c.startswith(prefix + "."))


def check_partitionable(model: nn.Module) -> None:
    """Raise the error `partition` would raise for this model's kind, before anything is cut."""
    inner = peft_inner(model)
    if inner is not None:
        model = model.get_submodule(inner)
    if resnet_prefix(model) is not None:
        return
    if is_seq2seq(model):
        check_seq2seq(model)
    elif encoder_prefix(model) is not None:
        check_encoder(model)
    else:
        layout_of(model)


def partition(sch_or_model, num_stages: int | None = None) -> list[nn.Module]:
    """Stage modules (sharing the model's submodules) whose sequential composition is the
    model's forward: stage 0 takes `input_ids`, stage i>0 the previous stage's output."""
    sch = sch_or_model if hasattr(sch_or_model, "_root") else None
    if sch is None:
        raise SchedulingError("", "partition needs the schedule (the cuts live there).",
                              "pass slapo.create_schedule(model) after cut_pipeline_stage().")
    cuts = cuts_of(sch)
    n = len(cuts) + 1 if num_stages is None else num_stages
    if not cuts:
        raise SchedulingError(sch.path, "the schedule has no pipeline cuts.",
                              "call sch['<layers>.<i>'].cut_pipeline_stage() first.")
    model = sch.mod
    inner = peft_inner(model)
    if inner is not None:  # PEFT's wrapper: the inner model's stages, under its names
        return [PrefixedStage(s, inner) for s in partition(_InnerSchedule(sch, inner), n)]
    if resnet_prefix(model) is not None:
        return resnet_partition(sch, n)
    if is_seq2seq(model):
        return seq2seq_partition(sch, n)
    prefix = encoder_prefix(model)
    if prefix is None:
        return _decoder_stages(sch, n)
    check_encoder(model)
    bounds = _bounds(sch, DecoderLayout("bert", (), prefix + "encoder.layer", (), ()), n)
    return [BertStage(model, prefix, lo, hi, s == 0, s == n - 1)
            for s, (lo, hi) in enumerate(bounds)]


def build_stage(sch, stage_idx: int) -> nn.Module:
    """Only stage `stage_idx` (what one pipeline rank runs)."""
    stages = partition(sch)
    if not 0 <= stage_idx < len(stages):
        raise SchedulingError(sch.path, f"stage {stage_idx} does not exist ({len(stages)} "
                              "stages).", f"use 0..{len(stages) - 1}.")
    return stages[stage_idx]


def run_stages(stages: list[nn.Module], *inputs: torch.Tensor, **masks: torch.Tensor):
    """Run the stages one after the other (the reference a pipeline schedule must reproduce):
    stage 0 takes `inputs` (`input_ids`; T5: `input_ids, decoder_input_ids`), every later
    stage the previous one's output (a tuple is spread over its arguments); `masks` (padding
    masks, e.g. `attention_mask=`) go to every stage, as the runner hands them."""
    x = inputs
    for i, stage in enumerate(stages):
        x = stage(*x, **masks)
        if i < len(stages) - 1 and not isinstance(x, tuple):
            x = (x,)
    return x


def _decoder_stages(sch, num_stages: int) -> list[nn.Module]:
    """All `num_stages` stage modules of a decoder LM, from the schedule's cuts."""
    root = sch.mod
    layout = layout_of(root)
    bounds = _bounds(sch, layout, num_stages)
    return [HFDecoderStage(root, layout, lo, hi, s == 0, s == num_stages - 1)
            for s, (lo, hi) in enumerate(bounds)]


def _bounds(sch, layout: DecoderLayout, num_stages: int) -> list[tuple[int, int]]:
    """The [lo, hi) layer range of each stage, from the cuts (which must make `num_stages`)."""
    cuts = list(sch.pipeline_cuts)
    if len(cuts) + 1 != num_stages:
        raise SchedulingError(sch.path, f"{len(cuts)} cut(s) give {len(cuts) + 1} stages, not "
                              f"{num_stages}.", f"cut {num_stages - 1} layer(s).")
    return layer_bounds(cuts, layout, len(sch.mod.get_submodule(layout.layers)))


def check_stage_coverage(root: nn.Module, stages: list[nn.Module]) -> None:
    """Every parameter name of `root` belongs to exactly one stage, checked before anything is
    materialised or moved (every rank builds all stages, so every rank raises the same error).

    A parameter in no stage would never be trained (nothing logged, the loss silently off);
    one in two stages would be updated twice. Tied weights follow their owners: a tensor shared
    under two names (GPT-2's `transformer.wte.weight` and `lm_head.weight`, BERT's word
    embedding and `cls.predictions.decoder.weight`) is held by the stage of each name, and
    `find_tied` sums its gradients over those stages' ranks."""
    count: dict[str, int] = {}
    for stage in stages:
        for name, _ in stage.named_parameters(remove_duplicate=False):
            count[name] = count.get(name, 0) + 1
    names = [n for n, _ in root.named_parameters(remove_duplicate=False)]
    orphans = [n for n in names if count.get(n, 0) == 0]
    doubled = sorted(n for n, c in count.items() if c > 1)
    if orphans:
        shown = ", ".join(orphans[:12]) + (f" (+{len(orphans) - 12} more)" if len(orphans) > 12
                                           else "")
        raise SchedulingError("", f"{len(orphans)} parameter(s) of {type(root).__name__} belong "
                              f"to no pipeline stage and would never be trained: {shown}.",
                              "use a model class whose head the pipeline stages cover (decoder "
                              "LMs, BertModel/RobertaModel, *ForMaskedLM, "
                              "T5ForConditionalGeneration), or pipeline the base model and "
                              "apply the head in loss_fn only if it has no parameters.")
    if doubled:
        raise SchedulingError("", f"parameter(s) {', '.join(doubled[:12])} are held by more "
                              "than one pipeline stage.", "cut the model so each module is in "
                              "one stage.")
