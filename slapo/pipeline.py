"""Partition a scheduled model into pipeline stage modules at its `cut_pipeline_stage` cuts.

Approach (torchtitan's, not Slapo 2023's whole-model trace + split_module): a stage is a small
module that *shares* the original submodules (no copies) for its layers, and for HF models adds
what the ends need: the first stage the embeddings, later stages take hidden states, the last
the final norm and head. Sharing means every primitive applied to a layer (shard/sync hooks,
checkpoint, traced/fused graphs) comes along and parameter names stay those of the full model.
Decoder LMs (GPT-2, LLaMA) use the pipeline runtime's stages (`slapo.runtime.stages`); this module
adds encoders (BERT) and the user-facing `partition` / `build_stage`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .errors import SchedulingError
from .runtime import stages as _stages


def cuts_of(sch) -> list[str]:
    """The recorded stage boundaries, in model order."""
    return list(sch._root.meta.get("pipeline_cuts", []))


def _bert_layers(model: nn.Module) -> str | None:
    for prefix in ("", "bert."):
        try:
            model.get_submodule(prefix + "encoder.layer")
            model.get_submodule(prefix + "embeddings")
            return prefix
        except AttributeError:
            continue
    return None


class BertStage(nn.Module):
    """Layers [lo, hi) of an HF BERT encoder; the first stage embeds `input_ids`, the last also
    runs the pooler (returns `(last_hidden_state, pooler_output)`)."""

    def __init__(self, root: nn.Module, prefix: str, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.prefix, self.lo, self.hi, self.first, self.last = prefix, lo, hi, first, last
        self.config = root.config
        paths = ([prefix + "embeddings"] if first else [])
        paths += [f"{prefix}encoder.layer.{i}" for i in range(lo, hi)]
        if last and getattr(root.get_submodule(prefix.rstrip(".")) if prefix else root,
                            "pooler", None) is not None:
            paths.append(prefix + "pooler")
        for p in paths:
            _stages._graft(self, root, p)

    def forward(self, x: torch.Tensor):
        h = self.get_submodule(self.prefix + "embeddings")(input_ids=x) if self.first else x
        for i in range(self.lo, self.hi):
            out = self.get_submodule(f"{self.prefix}encoder.layer.{i}")(h)
            h = out[0] if isinstance(out, tuple) else out
        if self.last:
            try:
                pooler = self.get_submodule(self.prefix + "pooler")
            except AttributeError:
                return h
            return h, pooler(h)
        return h


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
    prefix = _bert_layers(model)
    if prefix is None:
        return _stages.partition(sch, n)
    layout = _stages.DecoderLayout("bert", prefix + "encoder.layer", (), ())
    if len(cuts) + 1 != n:
        raise SchedulingError(sch.path, f"{len(cuts)} cut(s) give {len(cuts) + 1} stages, not "
                              f"{n}.", f"cut {n - 1} layer(s).")
    n_layers = len(model.get_submodule(layout.layers))
    bounds = _stages.layer_bounds(cuts, layout, n_layers)
    return [BertStage(model, prefix, lo, hi, s == 0, s == n - 1)
            for s, (lo, hi) in enumerate(bounds)]


def build_stage(sch, stage_idx: int) -> nn.Module:
    """Only stage `stage_idx` (what one pipeline rank runs)."""
    stages = partition(sch)
    if not 0 <= stage_idx < len(stages):
        raise SchedulingError(sch.path, f"stage {stage_idx} does not exist ({len(stages)} "
                              "stages).", f"use 0..{len(stages) - 1}.")
    return stages[stage_idx]


def run_stages(stages: list[nn.Module], input_ids: torch.Tensor):
    """Run the stages one after the other (the reference a pipeline schedule must reproduce)."""
    x = input_ids
    for stage in stages:
        x = stage(x)
    return x
