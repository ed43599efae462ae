"""Pipeline stage modules for Hugging Face decoder LMs (GPT-2, LLaMA-like), built from the cuts.

This is the minimum the pipeline runtime needs (the torchtitan approach, not tracing: the tracer
fails on LLaMA's RoPE): each stage keeps references to its own decoder layers, the first stage
also the embeddings, the last the final norm and LM head. Later stages receive hidden states and
recompute what every layer needs (positions, the causal mask, LLaMA's rotary embeddings).

A stage shares the original (scheduled) modules, so tensor-parallel hooks, checkpointing and
every other primitive come along, and it exposes them under their original names
(`transformer.h.3.attn...`), so state-dict keys, delayed-init seeds and optimizer grouping are
those of the full model. Creating all stages is cheap (no copies): every rank builds all of them
to agree on which weights several stages share.

Cuts follow Slapo's `cut_pipeline_stage()`: the stage boundary is *after* the cut module, which
must be one of the decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import SchedulingError


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder LM keeps its parts (paths relative to the root)."""

    family: str
    layers: str
    embed: tuple[str, ...]
    final: tuple[str, ...]
    shared: tuple[str, ...] = ()  # parameter-free modules every stage needs (rotary embedding)


GPT2 = DecoderLayout("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe",
                                               "transformer.drop"), ("transformer.ln_f", "lm_head"))
LLAMA = DecoderLayout("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"),
                      ("model.rotary_emb",))


def layout_of(model: nn.Module) -> DecoderLayout:
    for layout in (GPT2, LLAMA):
        try:
            model.get_submodule(layout.layers)
            for p in layout.embed + layout.final + layout.shared:
                model.get_submodule(p)
        except AttributeError:
            continue
        return layout
    raise SchedulingError("", f"pipeline stages are built for HF decoder LMs laid out like "
                          f"GPT-2 (transformer.h) or LLaMA (model.layers); {type(model).__name__} "
                          "is neither.", "use a GPT-2/LLaMA-style model (or a BERT-like encoder: "
                          "slapo.runtime.partition covers both).")


def layer_bounds(cuts: list[str], layout: DecoderLayout, n_layers: int) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges of the stages; a cut on layer i ends its stage after layer i."""
    prefix = layout.layers + "."
    ends = []
    for c in cuts:
        idx = c[len(prefix):] if c.startswith(prefix) else ""
        if not idx.isdigit() or int(idx) >= n_layers:
            raise SchedulingError(c, f"pipeline cuts must be on the decoder layers "
                                  f"{layout.layers}.0 .. {layout.layers}.{n_layers - 1}.",
                                  f"cut e.g. sch['{layout.layers}.{n_layers // 2 - 1}'].")
        ends.append(int(idx) + 1)
    bounds = [0] + ends + [n_layers]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi <= lo:
            raise SchedulingError(cuts[0] if cuts else "", f"the cuts {cuts} leave a stage "
                                  f"without layers (ordered boundaries: {bounds}).",
                                  "cut distinct layers in increasing order, not the last one.")
    return list(zip(bounds, bounds[1:], strict=False))


def graft(container: nn.Module, root: nn.Module, path: str) -> None:
    """Register `root.get_submodule(path)` in `container` under the same dotted path."""
    parent = container
    parts = path.split(".")
    for part in parts[:-1]:
        nxt = parent._modules.get(part)
        if nxt is None:
            nxt = nn.Module()
            parent.add_module(part, nxt)
        parent = nxt
    parent.add_module(parts[-1], root.get_submodule(path))


class HFDecoderStage(nn.Module):
    """One pipeline stage of an HF decoder LM: layers [lo, hi), plus embeddings/head at the ends.

    forward(x): x is `input_ids` on the first stage, hidden states elsewhere; returns hidden
    states, or logits on the last stage.
    """

    def __init__(self, root: nn.Module, layout: DecoderLayout, lo: int, hi: int, first: bool,
                 last: bool):
        super().__init__()
        self.layout, self.lo, self.hi, self.first, self.last = layout, lo, hi, first, last
        self._root = (root,)  # a tuple: not registered, so its parameters stay out of the stage
        self.config = root.config
        self.input_names = ("input_ids",) if first else ()
        for path in self.paths():
            graft(self, root, path)

    def paths(self) -> list[str]:
        lay = self.layout
        out = list(lay.embed) if self.first else []
        out += [f"{lay.layers}.{i}" for i in range(self.lo, self.hi)]
        out += list(lay.final) if self.last else []
        return out + list(lay.shared)

    def _init_weights(self, module: nn.Module) -> None:  # delayed init uses the model's own
        self._root[0]._init_weights(module)

    def _get(self, path: str) -> nn.Module:
        return self.get_submodule(path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        if self.first:
            h = self._embed(x)
        else:
            h = x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = self._causal_mask(h, pos)
        extra = {}
        if lay.family == "llama":
            extra["position_embeddings"] = self._get("model.rotary_emb")(h, position_ids=pos)
        for i in range(self.lo, self.hi):
            layer = self._get(f"{lay.layers}.{i}")
            if lay.family == "gpt2":
                h = layer(h, None, mask, None, use_cache=False, position_ids=pos)
            else:
                h = layer(h, attention_mask=mask, position_ids=pos, use_cache=False, **extra)
        if self.last:
            for path in lay.final:
                h = self._get(path)(h)
        return h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.layout.family == "gpt2":
            pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            h = self._get("transformer.wte")(ids) + self._get("transformer.wpe")(pos)
            return self._get("transformer.drop")(h)
        return self._get("model.embed_tokens")(ids)

    def _causal_mask(self, h: torch.Tensor, pos: torch.Tensor):
        from transformers.masking_utils import create_causal_mask

        return create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  past_key_values=None, position_ids=pos)

    # ---- what the pipeline runtime asks the last stage ----------------------------------------
    def pipeline_outputs(self, logits: torch.Tensor):
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(logits=logits)

    def default_loss(self, outputs, batch) -> torch.Tensor:
        """The HF model's own loss (shifted next-token cross-entropy) from `batch['labels']`."""
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if labels is None:
            raise SchedulingError("", "the batch has no `labels`, so the model's own loss cannot "
                                  "be computed.", "add labels to the batch or pass loss_fn=.")
        root = self._root[0]
        return root.loss_function(outputs.logits, labels, vocab_size=self.config.vocab_size)
