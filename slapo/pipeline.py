"""Partition a scheduled model into pipeline stage modules at its `cut_pipeline_stage` cuts.

Approach (torchtitan's, not Slapo 2023's whole-model trace + split_module): a stage is a small
module that *shares* the original submodules (no copies) for its layers, and for HF models adds
what the ends need: the first stage the embeddings, later stages take hidden states, the last
the final norm and head. Sharing means every primitive applied to a layer (shard/sync hooks,
checkpoint, traced/fused graphs) comes along and parameter names stay those of the full model.
Decoder LMs (GPT-2, LLaMA) use the pipeline runtime's stages (`slapo.runtime.stages`); this module
adds encoders (BERT, RoBERTa: the base model, or `*ForMaskedLM` with its head on the last stage)
and the user-facing `partition` / `build_stage`. Other head classes (sequence classification,
pre-training) are not partitioned: `build` refuses them, naming the parameters no stage holds
(`slapo.runtime.stages.check_stage_coverage`), instead of training without them.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .errors import SchedulingError
from .runtime import stages as _stages


def cuts_of(sch) -> list[str]:
    """The recorded stage boundaries, in model order."""
    return list(sch.pipeline_cuts)


ENCODER_PREFIXES = ("", "bert.", "roberta.")
# the masked-LM head module of each supported head class (BertForMaskedLM: `cls`,
# RobertaForMaskedLM: `lm_head`); other head classes are refused at build, naming the
# parameters no stage would hold (`slapo.runtime.stages.check_stage_coverage`)
MLM_HEADS = ("cls", "lm_head")


def _bert_layers(model: nn.Module) -> str | None:
    for prefix in ENCODER_PREFIXES:
        try:
            model.get_submodule(prefix + "encoder.layer")
            model.get_submodule(prefix + "embeddings")
            return prefix
        except AttributeError:
            continue
    return None


def mlm_head(model: nn.Module) -> str | None:
    """The path of the masked-LM head of a `*ForMaskedLM` encoder, else None."""
    if not type(model).__name__.endswith("ForMaskedLM"):
        return None
    return next((h for h in MLM_HEADS if isinstance(getattr(model, h, None), nn.Module)), None)


class BertStage(nn.Module):
    """Layers [lo, hi) of an HF BERT-like encoder (BERT, RoBERTa); the first stage embeds
    `input_ids`. The last stage also runs what follows the encoder: a `*ForMaskedLM` model's
    head (returns the logits; `outputs.loss` is the model's own masked-LM cross-entropy), else
    the pooler if any (returns `(last_hidden_state, pooler_output)`)."""

    def __init__(self, root: nn.Module, prefix: str, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.prefix, self.lo, self.hi, self.first, self.last = prefix, lo, hi, first, last
        self.config = root.config
        self._root = (root,)  # a tuple: not registered, so its parameters stay out of the stage
        self.head = mlm_head(root) if last else None
        self.input_names = ("input_ids",) if first else ()
        paths = ([prefix + "embeddings"] if first else [])
        paths += [f"{prefix}encoder.layer.{i}" for i in range(lo, hi)]
        encoder = root.get_submodule(prefix.rstrip(".")) if prefix else root
        if last and self.head is None and getattr(encoder, "pooler", None) is not None:
            paths.append(prefix + "pooler")
        if self.head is not None:
            paths.append(self.head)
        for p in paths:
            _stages._graft(self, root, p)

    def _init_weights(self, module: nn.Module) -> None:  # delayed init uses the model's own
        self._root[0]._init_weights(module)

    def forward(self, x: torch.Tensor):
        h = self.get_submodule(self.prefix + "embeddings")(input_ids=x) if self.first else x
        for i in range(self.lo, self.hi):
            out = self.get_submodule(f"{self.prefix}encoder.layer.{i}")(h)
            h = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return h
        if self.head is not None:
            return self.get_submodule(self.head)(h)
        try:
            pooler = self.get_submodule(self.prefix + "pooler")
        except AttributeError:
            return h
        return h, pooler(h)

    # ---- what the pipeline runtime asks the last stage ----------------------------------------
    def pipeline_outputs(self, output):
        if self.head is None:
            return output
        from transformers.modeling_outputs import MaskedLMOutput

        return MaskedLMOutput(logits=output)

    def default_loss(self, outputs, batch) -> torch.Tensor:
        """The `*ForMaskedLM` model's own loss: cross-entropy over `batch['labels']` (-100
        ignored), as HF computes it."""
        if self.head is None:
            raise SchedulingError("", f"{type(self._root[0]).__name__} has no loss of its own "
                                  "(no masked-LM head).", "pass build(..., loss_fn=fn) with "
                                  "fn(outputs, batch) -> scalar.")
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if labels is None:
            raise SchedulingError("", "the batch has no `labels`, so the model's own loss cannot "
                                  "be computed.", "add labels to the batch or pass loss_fn=.")
        logits = outputs.logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels.reshape(-1).to(logits.device))


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
