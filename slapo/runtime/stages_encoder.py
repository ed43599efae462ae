"""Pipeline stage modules for Hugging Face BERT-like encoders (BERT, RoBERTa; the base model or
`*ForMaskedLM` with its head on the last stage), built from the cuts. Same approach as the
decoder stages (`stages_decoder`): a stage shares the scheduled model's modules under their
original names."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SchedulingError
from ..op.context_parallel import KEY_VALID
from .stages_decoder import FusedLossStage, graft, labels_cross_entropy, own_loss

ENCODER_PREFIXES = ("", "bert.", "roberta.")
# the masked-LM head module of each supported head class (BertForMaskedLM: `cls`,
# RobertaForMaskedLM: `lm_head`); other head classes are refused at build, naming the
# parameters no stage would hold (`slapo.runtime.partition.check_stage_coverage`)
MLM_HEADS = ("cls", "lm_head")
# the model types whose forward `BertStage` reproduces (checked by tests against the model's
# own): another encoder with BERT's module names (DeBERTa, ELECTRA-style) embeds or attends
# differently, so it is refused rather than pipelined wrong
ENCODER_TYPES = ("bert", "roberta")


def encoder_prefix(model: nn.Module) -> str | None:
    for prefix in ENCODER_PREFIXES:
        try:
            model.get_submodule(prefix + "encoder.layer")
            model.get_submodule(prefix + "embeddings")
            return prefix
        except AttributeError:
            continue
    return None


def check_encoder(model: nn.Module) -> None:
    """Refuse an encoder whose forward `BertStage` is not known to reproduce."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ENCODER_TYPES:
        raise SchedulingError("", f"{type(model).__name__} (model_type={model_type!r}) is laid "
                              "out like BERT, but encoder pipeline stages are checked for "
                              f"{', '.join(ENCODER_TYPES)} only; another encoder may embed or "
                              "attend differently and train wrong.", "use BERT or RoBERTa, or "
                              "train without pp_stages.")


def mlm_head(model: nn.Module) -> str | None:
    """The path of the masked-LM head of a `*ForMaskedLM` encoder, else None."""
    if not type(model).__name__.endswith("ForMaskedLM"):
        return None
    return next((h for h in MLM_HEADS if isinstance(getattr(model, h, None), nn.Module)), None)


class BertStage(FusedLossStage, nn.Module):
    """Layers [lo, hi) of an HF BERT-like encoder (BERT, RoBERTa); the first stage embeds
    `input_ids`. The last stage also runs what follows the encoder: a `*ForMaskedLM` model's
    head (returns the logits; `outputs.loss` is the model's own masked-LM cross-entropy), else
    the pooler if any (returns `(last_hidden_state, pooler_output)`). The first stage takes
    `token_type_ids` after `input_ids` when the batch has them (sentence pairs).
    `attention_mask` (the micro-batch's padding mask, handed to every stage by the runner)
    becomes the layers' bidirectional mask, as in the model's forward. With the fused loss and
    `labels` the last stage returns the masked-LM loss instead (`FusedLossStage`). Under
    context parallelism every stage takes the cp batch's `position_ids` (the embeddings look
    them up: RoBERTa's own numbering, `context_parallel.position_rule`) and key flags, which
    the layers' cp attention masks by (no mask is built for the local chunk)."""

    mask_inputs = ("attention_mask",)
    first_inputs = ("input_ids", "token_type_ids")  # what stage 0 takes, in order
    cp_inputs = ("position_ids", KEY_VALID)  # what every stage takes under cp

    def __init__(self, root: nn.Module, prefix: str, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.prefix, self.lo, self.hi, self.first, self.last = prefix, lo, hi, first, last
        self.config = root.config
        self._root = (root,)  # a tuple: not registered, so its parameters stay out of the stage
        self.head = mlm_head(root) if last else None
        self.input_names = self.first_inputs if first else ()
        self.init_fused_loss(root, last and self.head is not None)
        paths = ([prefix + "embeddings"] if first else [])
        paths += [f"{prefix}encoder.layer.{i}" for i in range(lo, hi)]
        encoder = root.get_submodule(prefix.rstrip(".")) if prefix else root
        if last and self.head is None and getattr(encoder, "pooler", None) is not None:
            paths.append(prefix + "pooler")
        if self.head is not None:
            paths.append(self.head)
        for p in paths:
            graft(self, root, p)

    def _init_weights(self, module: nn.Module) -> None:  # delayed init uses the model's own
        self._root[0]._init_weights(module)

    def forward(self, x: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                cp_key_valid: torch.Tensor | None = None):
        h = self.get_submodule(self.prefix + "embeddings")(
            input_ids=x, token_type_ids=token_type_ids, position_ids=position_ids) \
            if self.first else x
        mask = None
        cp = {} if cp_key_valid is None else {KEY_VALID: cp_key_valid}
        if attention_mask is not None and not cp:
            from transformers import masking_utils

            mask = masking_utils.create_bidirectional_mask(
                config=self.config, inputs_embeds=h, attention_mask=attention_mask)
        for i in range(self.lo, self.hi):
            out = self.get_submodule(f"{self.prefix}encoder.layer.{i}")(h, attention_mask=mask,
                                                                        **cp)
            h = out[0] if isinstance(out, tuple) else out
        if not self.last:
            return h
        if self.fused is not None and labels is not None:
            return self.fused_loss(h, labels)
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

        loss = self.wrap_loss(output, "MaskedLMOutput")
        return loss if loss is not None else MaskedLMOutput(logits=output)

    def default_loss(self, outputs, batch) -> torch.Tensor:
        """The `*ForMaskedLM` model's own loss: cross-entropy over `batch['labels']` (-100
        ignored), as HF computes it."""
        if self.head is None:
            raise SchedulingError("", f"{type(self._root[0]).__name__} has no loss of its own "
                                  "(no masked-LM head).", "pass build(..., loss_fn=fn) with "
                                  "fn(outputs, batch) -> scalar.")
        if own_loss(outputs) is not None:
            return own_loss(outputs)
        return labels_cross_entropy(outputs.logits, batch)
