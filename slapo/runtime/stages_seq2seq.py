"""Pipeline stage modules for Hugging Face T5 (`T5ForConditionalGeneration`, mT5), built from
the cuts. Same contract as the decoder and encoder stages (`runtime.partition`): a stage shares
the scheduled model's modules under their original names, and the stages composed are the
model's forward.

The encoder blocks and then the decoder blocks form one sequence of E + D layers; a cut on
`encoder.block.{i}` or `decoder.block.{j}` ends a stage after that block (the last encoder
block may be cut: that boundary is the encoder/decoder one, as in Slapo 2023's T5 schedule).
What crosses each boundary is a tuple of float tensors, so torch's pipelining sends and
differentiates every part:

| boundary | tensors sent |
|---|---|
| inside the encoder | encoder hidden states, the encoder's position bias, the decoder's input embeddings |
| after the encoder | the decoder's input embeddings, the encoder output (final norm + dropout applied) |
| inside the decoder | decoder hidden states, the decoder's position bias, the encoder output |

Why these:
- T5's relative position bias is computed once, by the first block of each stack (only that
  block has the `relative_attention_bias` weight), and every later block adds it. A later stage
  cannot recompute it without that weight, so the bias (1 x heads x q x k) is sent along and its
  gradient comes back to the first block's weight: exactly the model's own data flow.
- The decoder's input ids (`decoder_input_ids`, or `labels` shifted right as the model does)
  are embedded on stage 0, which holds the shared embedding (`shared`, `encoder.embed_tokens`
  and `decoder.embed_tokens`: one weight), so only float tensors cross the boundaries and
  the embedding's gradient is summed on the rank that owns it; the decoder's embedding dropout
  runs where the decoder starts, as in `T5Stack`.
- The decoder output's scaling before the LM head is asked of the model's own forward
  (`decoder_output_scale`): T5 and mT5 differ there, and so do transformers versions.
- Masks are rebuilt on each stage, as `T5Stack.forward` builds them, from the padding masks
  the runner hands every stage (`attention_mask` for the encoder and cross-attention,
  `decoder_attention_mask` for the decoder's causal mask). Cross-attention has no relative bias
  (zeros, recomputed by each block).

Only `t5` and `mt5` model types are built (UMT5, LongT5 and Switch Transformers keep the module
names but attend differently), and only the `*ForConditionalGeneration` head (its own loss is a
cross-entropy over `labels`, unshifted).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SchedulingError
from .stages_decoder import FusedLossStage, graft, labels_cross_entropy, own_loss

SEQ2SEQ_TYPES = ("t5", "mt5")
ENCODER, DECODER = "encoder.block", "decoder.block"
EMBEDDINGS = ("shared", "encoder.embed_tokens", "decoder.embed_tokens")


def is_seq2seq(model: nn.Module) -> bool:
    """Laid out like T5: two block lists and a shared embedding."""
    try:
        for path in (ENCODER, DECODER, "shared"):
            model.get_submodule(path)
    except AttributeError:
        return False
    return True


def check_seq2seq(model: nn.Module) -> None:
    """Refuse a T5 look-alike or head whose forward `T5Stage` is not known to reproduce."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    if model_type not in SEQ2SEQ_TYPES:
        raise SchedulingError("", f"{name} (model_type={model_type!r}) is laid out like T5, but "
                              "encoder-decoder pipeline stages are checked for "
                              f"{', '.join(SEQ2SEQ_TYPES)} only; another model may bias or mask "
                              "attention differently and train wrong.", "use T5 or mT5, or "
                              "train without pp_stages.")
    if not name.endswith("ForConditionalGeneration") or not hasattr(model, "lm_head"):
        raise SchedulingError("", f"pipeline stages of {name}: only the "
                              "*ForConditionalGeneration head (T5ForConditionalGeneration, "
                              "MT5ForConditionalGeneration) is built.", "pipeline the "
                              "conditional-generation model, or train without pp_stages.")


def _sent(t: torch.Tensor, received: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A tensor to send on: dense (T5's `compute_bias` returns a permuted view; gloo sends
    need contiguous memory), and never a received input object itself: a handed-on tensor
    (the bias or the encoder output passing through a stage) is copied, one activation-sized
    copy per micro-batch, so every output is a node of the stage's graph as in any other
    stage. An output that *is* its input leaf relies on autograd accumulating into a leaf
    handed to `backward` as an output, which torch's split backward already breaks."""
    return t.clone() if any(t is r for r in received) else t.contiguous()


class _Stop(Exception):
    pass


class _Stub(nn.Module):
    """Stands in for a stack (returns ones) or the LM head (records its input, stops)."""

    def __init__(self, d_model: int, record: list | None = None):
        super().__init__()
        self.d_model, self.record = d_model, record

    def forward(self, *args, **kwargs):
        if self.record is not None:
            self.record.append(args[0])
            raise _Stop
        from transformers.modeling_outputs import BaseModelOutput

        return BaseModelOutput(last_hidden_state=torch.ones(1, 1, self.d_model))


def decoder_output_scale(root: nn.Module) -> float:
    """The factor the model's forward multiplies the decoder output by before the LM head,
    asked of the model itself: T5 scales by d_model**-0.5 when its head is tied
    (`scale_decoder_outputs` in newer transformers, `tie_word_embeddings` in older ones), while
    mT5's forward in transformers 5.x never scales although its config says tied. The forward is
    run once with both stacks and the head replaced by stubs (no parameter or collective is
    touched), and the head's input read back."""
    d = root.config.d_model
    seen: list[torch.Tensor] = []
    saved = {n: root._modules[n] for n in ("encoder", "decoder", "lm_head")}
    try:
        root._modules.update(encoder=_Stub(d), decoder=_Stub(d), lm_head=_Stub(d, seen))
        with torch.no_grad():
            root.forward(input_ids=torch.zeros(1, 1, dtype=torch.long),  # no root hooks
                         decoder_input_ids=torch.zeros(1, 1, dtype=torch.long),
                         use_cache=False)
    except _Stop:
        pass
    finally:
        root._modules.update(saved)
    if len(seen) != 1:
        raise SchedulingError("", f"{type(root).__name__}'s forward did not reach its LM head "
                              "as T5's does, so its pipeline stages cannot be built.",
                              "train it without pp_stages.")
    return float(seen[0].reshape(-1)[0])


def seq2seq_bounds(cuts: list[str], n_enc: int, n_dec: int) -> list[tuple[int, int]]:
    """[lo, hi) ranges over the E + D blocks (encoder first) of each stage, from the cuts."""
    ends = []
    for c in cuts:
        for prefix, offset, count in ((ENCODER, 0, n_enc), (DECODER, n_enc, n_dec)):
            idx = c[len(prefix) + 1:] if c.startswith(prefix + ".") else ""
            if idx.isdigit() and int(idx) < count:
                ends.append(offset + int(idx) + 1)
                break
        else:
            raise SchedulingError(c, f"T5 pipeline cuts must be on the blocks {ENCODER}.0 .. "
                                  f"{ENCODER}.{n_enc - 1} or {DECODER}.0 .. {DECODER}."
                                  f"{n_dec - 2}.", f"cut e.g. sch['{ENCODER}.{n_enc - 1}'] "
                                  "(between encoder and decoder).")
    bounds = [0] + ends + [n_enc + n_dec]
    pairs = list(zip(bounds, bounds[1:], strict=False))
    if any(hi <= lo for lo, hi in pairs):
        raise SchedulingError(cuts[0] if cuts else "", f"the cuts {cuts} leave a stage without "
                              f"blocks (ordered boundaries: {bounds}).", "cut distinct blocks "
                              "in increasing order, not the decoder's last one.")
    return pairs


class T5Stage(FusedLossStage, nn.Module):
    """Blocks [lo, hi) of the encoder-then-decoder sequence; stage 0 embeds both inputs, the
    stage ending the encoder applies its final norm, the last stage the decoder's final norm,
    the output scaling and the LM head (returns logits; the loss, with the fused loss and
    `labels`: `FusedLossStage`)."""

    first_inputs = ("input_ids", "decoder_input_ids")  # what stage 0 takes (`first_args`)
    mask_inputs = ("attention_mask", "decoder_attention_mask")

    def __init__(self, root: nn.Module, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.n_enc, self.n_dec = len(root.encoder.block), len(root.decoder.block)
        self.lo, self.hi, self.first, self.last = lo, hi, first, last
        self.config = root.config
        self._root = (root,)  # a tuple: not registered, so its parameters stay out of the stage
        self.scale = decoder_output_scale(root) if last else 1.0
        # torch's split weight pass (zero-bubble schedules) gets the decoder's position-bias
        # weight wrong, or fails, on a later stage that makes the bias from it
        # (`split_backward.check_split_backward`); the first stage's backward is not split
        self.split_backward = first or not self.starts_decoder
        self.init_fused_loss(root, last)
        for path in self.paths():
            graft(self, root, path)

    # ---- which modules: [lo, hi) over E encoder blocks, then D decoder blocks ----------------
    @property
    def ends_encoder(self) -> bool:
        return self.lo < self.n_enc <= self.hi

    @property
    def starts_decoder(self) -> bool:
        return self.lo <= self.n_enc < self.hi

    def paths(self) -> list[str]:
        e = self.n_enc
        out = list(EMBEDDINGS) + ["encoder.dropout"] if self.first else []
        out += [f"{ENCODER}.{i}" for i in range(self.lo, min(self.hi, e))]
        out += ["encoder.final_layer_norm", "encoder.dropout"] * self.ends_encoder
        out += ["decoder.dropout"] * self.starts_decoder
        out += [f"{DECODER}.{i - e}" for i in range(max(self.lo, e), self.hi)]
        out += ["decoder.final_layer_norm", "decoder.dropout", "lm_head"] * self.last
        return list(dict.fromkeys(out))

    def _init_weights(self, module: nn.Module) -> None:  # delayed init uses the model's own
        self._root[0]._init_weights(module)

    def first_args(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 0's inputs from a batch: `input_ids` and `decoder_input_ids`, or the labels
        shifted right (the model's own rule, applied to the whole batch before it is split)."""
        dec = batch.get("decoder_input_ids")
        if dec is None:
            labels = batch.get("labels")
            if labels is None:
                raise SchedulingError("", "a T5 pipeline batch needs `decoder_input_ids` or "
                                      "`labels` (shifted right into the decoder's inputs).",
                                      "add labels to the batch.")
            dec = self._root[0]._shift_right(labels)
        return batch["input_ids"], dec

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, *xs: torch.Tensor, attention_mask: torch.Tensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        e = self.n_enc
        if self.first:
            ids, dec_ids = xs
            h = self.get_submodule("encoder.dropout")(
                self.get_submodule("encoder.embed_tokens")(ids))
            bias, other = None, self.get_submodule("decoder.embed_tokens")(dec_ids)
        elif self.lo < e:
            h, bias, other = xs  # other: the decoder's input embeddings, carried along
        elif self.lo == e:
            other, enc_out = xs  # the decoder's input embeddings, the encoder output
        else:
            h, bias, enc_out = xs
        if self.lo < e:
            h, bias = self._blocks(ENCODER, range(self.lo, min(self.hi, e)), h, bias,
                                   mask=attention_mask)
            if self.hi < e:
                return h, _sent(bias, xs), _sent(other, xs)
            enc_out = self.get_submodule("encoder.dropout")(
                self.get_submodule("encoder.final_layer_norm")(h))
            if self.hi == e:
                return _sent(other, xs), enc_out
        if self.starts_decoder:
            h, bias = self.get_submodule("decoder.dropout")(other), None
        h, bias = self._blocks(DECODER, range(max(self.lo, e) - e, self.hi - e), h, bias,
                               enc_out, decoder_attention_mask, attention_mask)
        if not self.last:
            return h, _sent(bias, xs), _sent(enc_out, xs)
        h = self.get_submodule("decoder.dropout")(
            self.get_submodule("decoder.final_layer_norm")(h))
        if self.scale != 1.0:
            h = h * self.scale
        if self.fused is not None and labels is not None:
            return self.fused_loss(h, labels)
        return self.get_submodule("lm_head")(h)

    def _blocks(self, stack: str, idx: range, h: torch.Tensor, bias: torch.Tensor | None,
                enc_out: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                enc_mask: torch.Tensor | None = None):
        """Run blocks `idx` of `stack` as `T5Stack.forward` does (its masks from the padding
        masks, the position bias from the stack's first block handed on)."""
        from transformers import masking_utils

        root = self._root[0]
        cfg = (root.decoder if enc_out is not None else root.encoder).config
        if enc_out is None:
            mask = masking_utils.create_bidirectional_mask(config=cfg, inputs_embeds=h,
                                                           attention_mask=mask)
            cross_mask = None
        else:
            mask = masking_utils.create_causal_mask(config=cfg, inputs_embeds=h,
                                                    attention_mask=mask, past_key_values=None)
            cross_mask = masking_utils.create_bidirectional_mask(
                config=cfg, inputs_embeds=h, attention_mask=enc_mask,
                encoder_hidden_states=enc_out)
        cross_bias = None
        for i in idx:
            h, bias, cross = self.get_submodule(f"{stack}.{i}")(
                h, mask, bias, enc_out, cross_mask, cross_bias)
            cross_bias = cross if enc_out is not None else None
        return h, bias

    # ---- what the pipeline runtime asks the last stage ----------------------------------------
    def pipeline_outputs(self, logits: torch.Tensor):
        from transformers.modeling_outputs import Seq2SeqLMOutput

        loss = self.wrap_loss(logits, "Seq2SeqLMOutput")
        return loss if loss is not None else Seq2SeqLMOutput(logits=logits)

    def default_loss(self, outputs, batch) -> torch.Tensor:
        """The model's own loss: cross-entropy over `batch['labels']` (unshifted, -100
        ignored)."""
        if own_loss(outputs) is not None:
            return own_loss(outputs)
        return labels_cross_entropy(outputs.logits, batch)


def partition(sch, num_stages: int) -> list[T5Stage]:
    """The stage modules of a cut T5 schedule."""
    root = sch.mod
    check_seq2seq(root)
    cuts = list(sch.pipeline_cuts)
    if len(cuts) + 1 != num_stages:
        raise SchedulingError(sch.path, f"{len(cuts)} cut(s) give {len(cuts) + 1} stages, not "
                              f"{num_stages}.", f"cut {num_stages - 1} block(s).")
    bounds = seq2seq_bounds(cuts, len(root.encoder.block), len(root.decoder.block))
    return [T5Stage(root, lo, hi, s == 0, s == num_stages - 1)
            for s, (lo, hi) in enumerate(bounds)]
