"""Pipeline stage modules for Hugging Face decoder LMs (GPT-2, GPT-Neo, OPT by hand-written
layouts; every decoder whose config declares `base_model_pp_plan` and whose forward between the
layers is proven, `stages_declared`: LLaMA, Mistral, Qwen2/3, Gemma 2/3, OLMo 2, ...), built from
the cuts.

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
from ..op.context_parallel import KEY_DOC, KEY_VALID
from . import stages_declared as declared
from .stage_router import RouterAux, record_router, router_aux, router_modules, stage_stats
from .stages_declared import BETWEEN, Between, declared_parts


@dataclass(frozen=True)
class DecoderLayout:
    """Where a decoder LM keeps its parts (paths relative to the root), and which HF model types
    it covers.

    A stage re-implements what the model's `forward` does between its layers (embedding,
    positions, masks, final norm). That code is only right for the model types listed in
    `model_types`, each checked against the model's own forward by a test; another model with
    the same module names would train silently wrong, so it is refused by `layout_of`. A model
    whose config declares a pipeline plan (`base_model_pp_plan`) gets the "declared" layout:
    its parts from that plan, what its forward does between them from the table `between`
    (`stages_declared.BETWEEN`, proven by `tests/test_pipeline_declared.py`)."""

    family: str  # how stages embed and call layers: "gpt2", "opt" or "declared"
    model_types: tuple[str, ...]
    layers: str
    embed: tuple[str, ...]
    final: tuple[str, ...]
    shared: tuple[str, ...] = ()  # parameter-free modules every stage needs (rotary embedding)
    optional: tuple[str, ...] = ()  # parts some configs leave out (None in the model)
    between: Between | None = None  # the declared family's forward between its parts


GPT2 = DecoderLayout("gpt2", ("gpt2", "gpt_neo"), "transformer.h",
                     ("transformer.wte", "transformer.wpe", "transformer.drop"),
                     ("transformer.ln_f", "lm_head"))
OPT = DecoderLayout("opt", ("opt",), "model.decoder.layers",
                    ("model.decoder.embed_tokens", "model.decoder.embed_positions",
                     "model.decoder.project_in"),
                    ("model.decoder.final_layer_norm", "model.decoder.project_out", "lm_head"),
                    optional=("model.decoder.project_in", "model.decoder.final_layer_norm",
                              "model.decoder.project_out"))
LAYOUTS = (GPT2, OPT)  # the decoders that declare no pipeline plan

# Model types whose stages are not built, and why (named in the refusal).
UNSUPPORTED = {
    "albert": "ALBERT applies one shared layer at every depth, so its depth cannot be split "
              "into stages that own their layers",
}


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def layout_of(model: nn.Module) -> DecoderLayout:
    """The layout of `model`: from its declared pipeline plan (`stages_declared`), else one of
    `LAYOUTS`; refused unless its model type is one whose forward the stages are known to
    reproduce (see `DecoderLayout`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    name = type(model).__name__
    if model_type in UNSUPPORTED:
        raise SchedulingError("", f"pipeline stages of {name}: {UNSUPPORTED[model_type]}.",
                              "train it without pp_stages (tensor or data parallelism), or "
                              "pipeline a supported model (" + supported() + ").")
    parts = declared_parts(model)
    if parts is not None:
        return DecoderLayout("declared", (model_type,), parts.layers, parts.embed, parts.final,
                             parts.shared, between=parts.between)
    for layout in LAYOUTS:
        parts = layout.embed + layout.final + layout.shared
        if not _has(model, layout.layers) or not all(
                _has(model, p) for p in parts if p not in layout.optional):
            continue
        if model_type not in layout.model_types:
            raise SchedulingError("", f"{name} (model_type={model_type!r}) is laid out like "
                                  f"{layout.family} ({layout.layers}), but pipeline stages "
                                  "re-implement the model's forward between layers and are "
                                  f"checked for {', '.join(layout.model_types)} only; another "
                                  "model type may scale or mask differently and train wrong.",
                                  "use one of those model types, or train without pp_stages.")
        _check_config(model, layout)
        return layout
    raise SchedulingError("", f"pipeline stages are built for HF decoder LMs ({supported()}) "
                          f"and BERT-like encoders; {name} is neither.", "use one of those "
                          "models, or train without pp_stages.")


def supported() -> str:
    """The decoder model types the stages cover, in words."""
    hand = [t for lay in LAYOUTS for t in lay.model_types]
    return (", ".join(hand) + f", the {len(BETWEEN)} declared-plan model types of "
            "slapo.runtime.stages_declared.BETWEEN (llama, mistral, qwen3, gemma3_text, "
            "olmo2, phi3, granite, ...), bert, roberta, t5, mt5")


def _check_config(model: nn.Module, layout: DecoderLayout) -> None:
    if layout.family == "opt" and getattr(model.config, "layerdrop", 0.0) > 0.0:
        raise SchedulingError("", f"OPT's layerdrop={model.config.layerdrop} skips random "
                              "layers in training; pipeline stages run every layer.",
                              "set config.layerdrop = 0.0.")


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


def labels_cross_entropy(logits: torch.Tensor, batch) -> torch.Tensor:
    """Cross-entropy of `logits` against `batch['labels']`, unshifted, -100 ignored: the own
    loss of HF's masked-LM and encoder-decoder heads (their last stages' `default_loss`)."""
    labels = batch.get("labels") if isinstance(batch, dict) else None
    if labels is None:
        raise SchedulingError("", "the batch has no `labels`, so the model's own loss cannot "
                              "be computed.", "add labels to the batch or pass loss_fn=.")
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1).to(logits.device),
                                             ignore_index=-100)


class FusedLossStage:
    """What every stage kind shares for the `fused_loss` knob (`model_schedule.fused_loss`):
    when the model's forward was replaced by the fused head + loss, every stage takes the
    micro-batch's `labels` (`loss_inputs`: the runner hands them to every stage, as the
    padding masks, when the model's own loss is asked for) and the last one returns the loss
    instead of the logits (`fused`: the head's plan), so a pipeline's last stage never holds
    the logits either. Computing the loss inside the stage's forward keeps the head's weight
    read where FSDP2 has gathered it. With a user `loss_fn` no labels come and the last stage
    returns the logits as before."""

    fused = None  # the root's fused-loss kernel (`.head`, `.stage_loss`), on the last stage
    loss_inputs: tuple[str, ...] = ()

    def init_fused_loss(self, root: nn.Module, last: bool) -> None:
        from ..module_patch import kernel

        fused = kernel(root)
        if not callable(getattr(fused, "stage_loss", None)):
            fused = None
        self.loss_inputs = ("labels",) if fused is not None else ()
        self.fused = fused if last else None

    def fused_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss, shaped (1,): torch's schedules concatenate the last stage's micro-batch
        outputs (`schedule.eval` returns them), which a 0-d tensor cannot be."""
        return self.fused.stage_loss(self, hidden, labels).reshape(1)

    def wrap_loss(self, output, cls_name: str):
        """`pipeline_outputs` of a last stage that returned the fused loss (shape (1,)): the
        model's output type with that loss (0-d) and no logits; None for anything else."""
        if self.fused is None or not isinstance(output, torch.Tensor) or \
                tuple(output.shape) != (1,):
            return None
        from transformers import modeling_outputs

        return getattr(modeling_outputs, cls_name)(loss=output.reshape(()), logits=None)


def not_a_view(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied if it is a view. torch's split backward (the zero-bubble schedules) ends a
    stage's input pass with `detach_()` on its outputs, which a view refuses ("Can't detach
    views in-place"): OPT's decoder layer returns `hidden_states.view(shape)`, so a 2-stage OPT
    under ZBVZeroBubble failed at its first step. One copy of one activation per stage."""
    return t.clone() if isinstance(t, torch.Tensor) and t._is_view() else t


def own_loss(outputs) -> torch.Tensor | None:
    """The loss a fused last stage already computed (`FusedLossStage`), else None."""
    return getattr(outputs, "loss", None)


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


class HFDecoderStage(FusedLossStage, nn.Module):
    """One pipeline stage of an HF decoder LM: layers [lo, hi), plus embeddings/head at the ends.

    forward(x, *router, attention_mask=None, labels=None, position_ids=None,
    cp_key_valid=None, cp_key_doc=None): x is `input_ids` on the first stage, hidden states elsewhere; returns
    hidden states, or logits on the last stage (the loss, with the fused loss and `labels`:
    `FusedLossStage`). A mixture of experts whose loss adds the router's load-balancing loss
    (`self.router`, `stage_router.py`) returns `(that, stats)` instead, every stage after the
    first taking the statistics so far as `router`.
    `attention_mask` (the micro-batch's padding mask, handed to every stage by the runner)
    goes into the masks as in the model's forward, and into OPT's positions.

    Under context parallelism the runner hands every stage the cp batch's `position_ids`,
    its documents when the batch is packed (`cp_key_doc`) and
    key flags instead (`cp_inputs`, `runtime/context_parallel.py`): the positions feed the
    embeddings and RoPE as given, the layers get the key flags (their attention is the cp
    core, which masks by them and ignores the mask argument, so no mask is built for the
    local chunk).
    """

    mask_inputs = ("attention_mask",)  # the padding masks the runner hands every stage
    first_inputs = ("input_ids",)  # what stage 0 takes
    cp_inputs = ("position_ids", KEY_VALID, KEY_DOC)  # under cp (documents: a packed batch)
    position_inputs = ("position_ids",)  # a batch's own positions (packed documents)

    def __init__(self, root: nn.Module, layout: DecoderLayout, lo: int, hi: int, first: bool,
                 last: bool):
        super().__init__()
        self.layout, self.lo, self.hi, self.first, self.last = layout, lo, hi, first, last
        self._root = (root,)  # a tuple: not registered, so its parameters stay out of the stage
        self.config = root.config
        self.input_names = self.first_inputs if first else ()
        self.router: RouterAux | None = router_aux(
            root, layout.between is not None and layout.between.router)
        self.init_fused_loss(root, last)
        if self.fused is not None and layout.between is not None and \
                declared.has_tail(layout.between):
            raise SchedulingError("", f"fused_loss on {type(root).__name__}: its forward scales "
                                  "or caps around the LM head, which the fused loss skips.",
                                  "pass fused_loss=False.")
        for path in self.paths():
            graft(self, root, path)
        self._routers = [] if self.router is None else router_modules(  # found once
            [self._get(f"{layout.layers}.{i}") for i in range(lo, hi)], self.router)

    def paths(self) -> list[str]:
        lay = self.layout
        out = list(lay.embed) if self.first else []
        out += [f"{lay.layers}.{i}" for i in range(self.lo, self.hi)]
        out += list(lay.final) if self.last else []
        out += list(lay.shared)
        root = self._root[0]
        return [p for p in out if p not in lay.optional or _has(root, p)]

    def _init_weights(self, module: nn.Module) -> None:  # delayed init uses the model's own
        self._root[0]._init_weights(module)

    def _get(self, path: str) -> nn.Module | None:
        """The stage's module at `path`; None for an optional part this model leaves out."""
        if path in self.layout.optional and not _has(self, path):
            return None
        return self.get_submodule(path)

    def forward(self, x: torch.Tensor, *router: torch.Tensor,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                cp_key_valid: torch.Tensor | None = None, cp_key_doc: torch.Tensor | None = None):
        cp = {} if cp_key_valid is None else {KEY_VALID: cp_key_valid}
        cp.update({} if cp_key_doc is None else {KEY_DOC: cp_key_doc})
        if self.router is None:
            return self._forward(x, attention_mask, labels, position_ids, cp)
        assert not cp, "refused by check_context_parallel"
        with record_router(self._routers, self.router) as logits:
            out = self._forward(x, attention_mask, labels, position_ids, cp)
        return out, stage_stats(self.router, logits, attention_mask, router, out.device)

    def _forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None,
                 labels: torch.Tensor | None, position_ids: torch.Tensor | None,
                 cp: dict) -> torch.Tensor:
        lay = self.layout
        h = self._embed(x, attention_mask, position_ids) if self.first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0) if position_ids is None \
            else position_ids
        kinds = {self._attention_type(i) for i in range(self.lo, self.hi)}
        masks = {k: None for k in kinds} if cp else self._masks(h, pos, attention_mask, kinds)
        between = lay.between
        keys = [None if between is None else declared.rope_key(self.config, between, i)
                for i in range(self.lo, self.hi)]
        extra = {None: {}}  # a hand-written layout's layers take no position arguments
        if between is not None:
            modules = {p.rsplit(".", 1)[-1]: self._get(p) for p in lay.shared}
            extra = declared.layer_kwargs(self, between, modules, h, pos, set(keys))
        for i, key in zip(range(self.lo, self.hi), keys, strict=True):
            layer = self._get(f"{lay.layers}.{i}")
            kind = self._attention_type(i)
            if lay.family == "gpt2":
                out = layer(h, attention_mask=masks[kind], use_cache=False, **cp)
            else:
                out = layer(h, attention_mask=masks[kind], position_ids=pos, use_cache=False,
                            **extra[key], **cp)
            h = out[0] if isinstance(out, tuple) else out  # GPT-Neo's blocks return tuples
        return not_a_view(self._final(h, labels) if self.last else h)

    def _final(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The modules after the layers (final norm, LM head), with what the forward does
        around the head (`stages_declared`: a divided hidden state, scaled or capped logits)."""
        lay = self.layout
        fused = self.fused is not None and labels is not None
        head = lay.final[-1]
        for path in lay.final:
            if path == head and lay.between is not None:
                h = declared.hidden_extra(self, lay.between, h)
            if fused and path == self.fused.head:
                return self.fused_loss(h, labels)
            module = self._get(path)
            h = h if module is None else module(h)
        return h if lay.between is None else declared.logits_extra(self, lay.between, h)

    def _embed(self, ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0) \
            if position_ids is None else position_ids
        family = self.layout.family
        if family == "gpt2":
            h = self._get("transformer.wte")(ids) + self._get("transformer.wpe")(pos)
            return self._get("transformer.drop")(h)
        if family == "opt":  # learned positions (offset 2), then project_in if the model has it
            h = self._get("model.decoder.embed_tokens")(ids)
            # OPT numbers the positions of unmasked tokens only (padding does not advance them)
            pmask = torch.ones(ids.shape, device=ids.device) if attention_mask is None \
                else attention_mask
            if position_ids is None:  # else: the cp split's, OPT's own numbering
                pos = (torch.cumsum(pmask, dim=1) * pmask - 1).long()
            p = self._get("model.decoder.embed_positions")(pmask, 0, position_ids=pos)
            project_in = self._get("model.decoder.project_in")
            h = h if project_in is None else project_in(h)
            return h + p.to(h.device)
        # declared: the embedding, what the forward does to its output, the plan's next modules
        embed, *after = self.layout.embed
        h = declared.embed_extra(self, self.layout.between, self._get(embed)(ids))
        for path in after:
            h = self._get(path)(h)
        return h

    def _attention_type(self, i: int) -> str:
        if self.layout.between is None:
            return "full_attention"
        return declared.attention_type(self.config, self.layout.between, i)

    def _masks(self, h: torch.Tensor, pos: torch.Tensor, attention_mask: torch.Tensor | None,
               kinds: set[str]) -> dict:
        """The masks this stage's layers use, made as the model's forward makes them."""
        from transformers import masking_utils

        kw = {"config": self.config, "inputs_embeds": h, "attention_mask": attention_mask,
              "past_key_values": None, "position_ids": pos}
        unknown = kinds - set(declared.LAYER_MASKS)
        if unknown:
            raise SchedulingError(self.layout.layers, f"attention types {sorted(unknown)} of "
                                  f"{type(self._root[0]).__name__} have no pipeline mask.",
                                  "use attention types the stages mask (stages_declared.LAYER_MASKS), "
                                  "or no pp_stages.")
        return {k: getattr(masking_utils, declared.LAYER_MASKS[k])(
            **kw, **declared.mask_kwargs(self.layout.between, k)) for k in kinds}

    # ---- what the pipeline runtime asks the last stage ----------------------------------------
    def pipeline_outputs(self, logits):
        from transformers.modeling_outputs import CausalLMOutput

        aux = None
        if self.router is not None:  # (logits or fused loss, the router's statistics)
            logits, stats = logits
            aux = self.router.loss(stats)
        out = self.wrap_loss(logits, "CausalLMOutput")
        out = out if out is not None else CausalLMOutput(logits=logits)
        if aux is not None:  # HF's MoE output type; `default_loss` adds coef * aux_loss
            from transformers.modeling_outputs import MoeCausalLMOutputWithPast

            out = MoeCausalLMOutputWithPast(loss=out.loss, logits=out.logits, aux_loss=aux)
        return out

    def default_loss(self, outputs, batch) -> torch.Tensor:
        """The HF model's own loss (shifted next-token cross-entropy) from `batch['labels']`,
        plus `router_aux_loss_coef` times the load-balancing loss when the model adds it."""
        lm = self._lm_loss(outputs, batch)
        aux = getattr(outputs, "aux_loss", None)
        return lm if aux is None else lm + self.router.coef * aux.to(lm.device)

    def _lm_loss(self, outputs, batch) -> torch.Tensor:
        if own_loss(outputs) is not None:
            return own_loss(outputs)
        labels = batch.get("labels") if isinstance(batch, dict) else None
        if labels is None:
            raise SchedulingError("", "the batch has no `labels`, so the model's own loss cannot "
                                  "be computed.", "add labels to the batch or pass loss_fn=.")
        root = self._root[0]
        # under cp: the labels shifted before the split, the sum over the global token count
        cp = {k: batch[k] for k in ("shift_labels", "num_items_in_batch") if k in batch}
        return root.loss_function(outputs.logits, labels, vocab_size=self.config.vocab_size,
                                  **cp)
