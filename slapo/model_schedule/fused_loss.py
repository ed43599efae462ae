"""The `fused_loss` knob: the LM head and its cross-entropy as one chunked op, no logits.

Why: for a language model the logits are the largest activation of the step (tokens x vocab,
upcast to fp32 by HF's loss): LLaMA 1.1B at 8 x 2048 holds 2 GiB of bf16 logits plus 4 GiB of
fp32 copies and their gradients. `slapo.op.fused_linear_cross_entropy` computes loss and
gradients chunk by chunk (Liger-Kernel's recipe) so none of that lives across the step.

How: a `Kernel` (see `slapo.module_patch`) replaces the *root* model's forward when it is called
with `labels`: it runs the base model as HF would (T5: encoder, then decoder on the shifted
labels, its output scaled as the model's forward does), applies the per-token part of the head
(BERT's transform, RoBERTa's dense+GELU+norm, ALBERT's), and the fused loss with the head's own weight
and bias (tied embeddings stay tied: the same Parameter). Without labels the original forward
runs unchanged. The output is the model's own output class with `loss` set and `logits=None`
(the point is not to build them); code that needs logits calls the model without labels.
Pipeline stages do the same on the last stage (`FusedLossKernel.stage_loss`,
`runtime.stages_decoder.FusedLossStage`): it takes the labels and returns the loss.

Exactness: the same loss as HF's (causal LMs shift labels, ignore -100, mean over counted
tokens or `num_items_in_batch` where the class's own loss honours it, `honours_num_items`;
BERT, RoBERTa, ALBERT and T5 take a plain mean, as their forwards do); masked
LMs and T5 compute only the rows that have a label (`_labelled_rows`), which does not change the
loss. Verified against the original model (loss and every gradient) for every plan in
tests/test_gpu_schedule.py and both knob grids.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import module_patch
from ..errors import SchedulingError
from ..schedule import Schedule


def _identity(root: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return h


def _bert_transform(root: nn.Module, h: torch.Tensor) -> torch.Tensor:
    return root.cls.predictions.transform(h)


def _roberta_transform(root: nn.Module, h: torch.Tensor) -> torch.Tensor:
    head = root.lm_head
    return head.layer_norm(F.gelu(head.dense(h)))


def _albert_transform(root: nn.Module, h: torch.Tensor) -> torch.Tensor:
    head = root.predictions
    return head.LayerNorm(head.activation(head.dense(h)))


_T5_INPUTS = {"input_ids", "attention_mask", "inputs_embeds", "decoder_input_ids",
              "decoder_attention_mask", "decoder_inputs_embeds", "use_cache"}


def _t5_decoder_hidden(root: nn.Module, inputs: dict, labels: torch.Tensor,
                       scale: float) -> tuple[torch.Tensor, dict] | None:
    """T5's forward up to its LM head: encoder, decoder on the labels shifted right (or the
    given decoder inputs), the output scaled as the model's forward scales it (`scale`, asked of
    the model when the loss was fused: `stages_seq2seq.decoder_output_scale`). No KV cache: a
    training loss has no use for one. None for inputs this path does not take (precomputed
    encoder outputs, a cache, ...): the original forward runs then."""
    if set(inputs) - _T5_INPUTS:
        return None
    enc = root.encoder(input_ids=inputs.get("input_ids"),
                       attention_mask=inputs.get("attention_mask"),
                       inputs_embeds=inputs.get("inputs_embeds"), return_dict=True)
    dec_ids, dec_embeds = inputs.get("decoder_input_ids"), inputs.get("decoder_inputs_embeds")
    if dec_ids is None and dec_embeds is None:
        dec_ids = root._shift_right(labels)
    dec = root.decoder(input_ids=dec_ids, attention_mask=inputs.get("decoder_attention_mask"),
                       inputs_embeds=dec_embeds, encoder_hidden_states=enc.last_hidden_state,
                       encoder_attention_mask=inputs.get("attention_mask"), use_cache=False,
                       return_dict=True)
    hidden = dec.last_hidden_state
    if scale != 1.0:
        hidden = hidden * scale
    return hidden, {"encoder_last_hidden_state": enc.last_hidden_state}


@dataclass(frozen=True)
class LossPlan:
    """Where a head class keeps its pieces: `base` (attribute with the base model), `head` (path
    of the vocabulary Linear), `transform(root, hidden)` (per-token layers before it), and
    whether labels are shifted (causal LM) or used in place (masked LM)."""

    base: str
    head: str
    transform: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    causal: bool
    output: str = "CausalLMOutputWithPast"  # the head class's own type (transformers.modeling_outputs)
    # encoder-decoder: `hidden(root, inputs, labels, scale)` -> (head input, output fields) or
    # None (then the original forward runs), instead of `base`'s last hidden state
    hidden: Callable | None = None
    scale: float = 1.0  # filled in by `fuse_loss` for a plan with `hidden`
    # a mixture of experts whose loss adds `router_aux_loss_coef` x its modeling module's
    # `load_balancing_loss_func` when `output_router_logits` is on (`_router_aux`)
    router: bool = False


# HF head class name -> plan. A table, so a new head is one line.
PLANS: dict[str, LossPlan] = {
    "GPT2LMHeadModel": LossPlan("transformer", "lm_head", _identity, True,
                                "CausalLMOutputWithCrossAttentions"),
    "GPTNeoForCausalLM": LossPlan("transformer", "lm_head", _identity, True),
    "LlamaForCausalLM": LossPlan("model", "lm_head", _identity, True),
    "MistralForCausalLM": LossPlan("model", "lm_head", _identity, True),
    "Qwen2ForCausalLM": LossPlan("model", "lm_head", _identity, True),
    "Qwen3ForCausalLM": LossPlan("model", "lm_head", _identity, True),
    "OPTForCausalLM": LossPlan("model", "lm_head", _identity, True),
    "BertForMaskedLM": LossPlan("bert", "cls.predictions.decoder", _bert_transform, False,
                                "MaskedLMOutput"),
    "RobertaForMaskedLM": LossPlan("roberta", "lm_head.decoder", _roberta_transform, False,
                                   "MaskedLMOutput"),
    "AlbertForMaskedLM": LossPlan("albert", "predictions.decoder", _albert_transform, False,
                                  "MaskedLMOutput"),
    "MixtralForCausalLM": LossPlan("model", "lm_head", _identity, True,
                                   "MoeCausalLMOutputWithPast", router=True),
    "Qwen3MoeForCausalLM": LossPlan("model", "lm_head", _identity, True,
                                    "MoeCausalLMOutputWithPast", router=True),
    "DeepseekV3ForCausalLM": LossPlan("model", "lm_head", _identity, True,
                                      "MoeCausalLMOutputWithPast"),  # no aux loss in HF's
    "T5ForConditionalGeneration": LossPlan("", "lm_head", _identity, False, "Seq2SeqLMOutput",
                                           hidden=_t5_decoder_hidden),
    "MT5ForConditionalGeneration": LossPlan("", "lm_head", _identity, False, "Seq2SeqLMOutput",
                                            hidden=_t5_decoder_hidden),
}

_DROP = ("labels", "logits_to_keep", "num_items_in_batch", "shift_labels", "return_dict")


class FusedLossKernel(module_patch.Kernel):
    """The root model's forward with the head and loss fused (see module docstring)."""

    name = "fused_loss"
    dropped_outputs = ("logits",)  # by design; `Verify` compares the loss instead

    def __init__(self, plan: LossPlan, original_forward: Callable):
        self.plan = plan
        self.signature = inspect.signature(original_forward)
        self.original_forward = original_forward
        # read from the class, not the table: releases change which losses honour it
        self.num_items = honours_num_items(original_forward)

    def __call__(self, module: nn.Module, *args, **kwargs):
        bound = self.signature.bind(module, *args, **kwargs)
        params = dict(bound.arguments)
        params.pop("self", None)
        extra = params.pop("kwargs", {}) or {}
        params.update(extra)
        labels = params.get("labels")
        if labels is None:
            return self.original_forward(module, *args, **kwargs)
        return self.fused(module, params)

    def fused(self, root: nn.Module, params: dict):
        plan = self.plan
        shift = params.get("shift_labels")
        num_items = params.get("num_items_in_batch") if self.num_items else None
        labels = params["labels"]
        inputs = {k: v for k, v in params.items() if k not in _DROP}
        if plan.hidden is not None:
            got = plan.hidden(root, inputs, labels, plan.scale)
            if got is None:
                return self.original_forward(root, **params)
            hidden, fields = got
        else:
            router = plan.router and _router_on(root, params)
            if router:
                inputs["output_router_logits"] = True
            out = getattr(root, plan.base)(**inputs, return_dict=True)
            hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
            fields = {k: getattr(out, k, None) for k in ("past_key_values", "hidden_states",
                                                          "attentions", "cross_attentions")}
        loss = head_loss(plan, root, hidden, labels, shift, num_items)
        if plan.hidden is None and router:  # as the MoE head's forward adds it
            aux = _router_aux(root, out.router_logits, inputs.get("attention_mask"))
            loss = loss + root.router_aux_loss_coef * aux.to(loss.device)
            fields.update(aux_loss=aux, router_logits=out.router_logits)
        return _output(plan, fields, loss)

    # ---- what a pipeline's last stage asks (`runtime.stages_decoder.FusedLossStage`, which
    # finds this kernel on the root: the runtime layer does not import model_schedule) ------
    @property
    def head(self) -> str:
        """Path of the head's vocabulary Linear (the module the last stage stops before)."""
        return self.plan.head

    def stage_loss(self, stage: nn.Module, hidden: torch.Tensor,
                   labels: torch.Tensor) -> torch.Tensor:
        """The model's own loss from the hidden state before the head, on a stage holding
        the head under the model's names (`head_loss`)."""
        return head_loss(self.plan, stage, hidden, labels)


def _router_on(root: nn.Module, params: dict) -> bool:
    """Whether the MoE head's forward would add the load-balancing loss: its
    `output_router_logits` argument, else the config's."""
    asked = params.get("output_router_logits")
    return bool(getattr(root.config, "output_router_logits", False) if asked is None else asked)


def _router_aux(root: nn.Module, router_logits, attention_mask) -> torch.Tensor:
    """The head's own load-balancing loss: its modeling module's `load_balancing_loss_func`
    on the router logits the base model recorded, as its forward calls it."""
    import sys

    fn = sys.modules[module_patch.original_class(root).__module__].load_balancing_loss_func
    return fn(router_logits, root.num_experts, root.num_experts_per_tok, attention_mask)


def head_loss(plan: LossPlan, root: nn.Module, hidden: torch.Tensor, labels: torch.Tensor,
              shift_labels: torch.Tensor | None = None,
              num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """The head's per-token transform, its vocabulary Linear and the cross-entropy as one
    chunked op: the model's own loss from the hidden state before the head. `root` is the
    model, or a pipeline stage holding the head under the model's names (the last stage
    computes its loss this way: `FusedLossKernel.stage_loss`)."""
    if plan.causal:
        labels = shift_labels if shift_labels is not None else \
            F.pad(labels, (0, 1), value=-100)[..., 1:]
    head = root.get_submodule(plan.head)
    if not plan.causal:
        # per-token transform only where a label exists (exact for the loss)
        hidden, labels = _labelled_rows(hidden, labels)
    hidden = plan.transform(root, hidden)
    from ..op.linear_ce import fused_linear_cross_entropy

    return fused_linear_cross_entropy(hidden, head.weight, labels, head.bias,
                                      num_items=num_items)


# Under fake tensors (the tuner's cost model) the labelled-row count is data-dependent and
# unknown: None takes every row, a fraction takes that share of them (`assume_labelled`).
_FAKE_LABELLED: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "slapo_fused_loss_fake_labelled", default=None)


@contextlib.contextmanager
def assume_labelled(fraction: float):
    """Inside: on fake tensors, the masked-LM head runs on `fraction` of the positions (the
    share a batch labels, e.g. BERT pre-training's 15%) instead of all of them, so a cost model
    sees the shapes the real step has. Real tensors always take their own labelled rows."""
    token = _FAKE_LABELLED.set(float(fraction))
    try:
        yield
    finally:
        _FAKE_LABELLED.reset(token)


def _labelled_rows(hidden: torch.Tensor, labels: torch.Tensor):
    """The rows of `hidden` (flattened to tokens) that carry a label, and those labels."""
    from torch._subclasses.fake_tensor import is_fake

    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if is_fake(hidden):
        fraction = _FAKE_LABELLED.get()
        if fraction is None:
            return flat, flat_labels
        rows = int(round(fraction * flat.shape[0]))
        return flat[:rows], flat_labels[:rows]
    idx = (flat_labels != -100).nonzero()[:, 0]
    return flat.index_select(0, idx), flat_labels[idx]


def _output(plan: LossPlan, fields: dict, loss: torch.Tensor):
    """The head class's own output type (`plan.output`), with the loss and no logits."""
    from transformers import modeling_outputs

    cls = getattr(modeling_outputs, plan.output)
    keep = {k: v for k, v in fields.items() if k in cls.__dataclass_fields__}
    return cls(loss=loss, logits=None, **keep)


def plan_for(model: nn.Module) -> LossPlan | None:
    return PLANS.get(module_patch.original_class(model).__name__)


def check_fusable(sch: Schedule) -> LossPlan:
    """The plan for this root, or a SchedulingError saying why not (nothing is changed)."""
    root = sch.mod
    name = module_patch.original_class(root).__name__
    plan = PLANS.get(name)
    if plan is None:
        raise SchedulingError(sch.path, f"fused_loss has no plan for {name}.",
                              f"pass fused_loss=False (heads with a plan: "
                              f"{', '.join(sorted(PLANS))}).")
    head = root.get_submodule(plan.head)
    from .lora import is_tuner_layer

    if is_tuner_layer(head):  # the kernel reads head.weight/.bias: the adapter would be skipped
        raise SchedulingError(sch.path, f"fused_loss computes the LM head from its weight, but "
                              f"{plan.head} is a PEFT {type(head).__name__} layer whose "
                              "adapter the fused loss would skip.", "leave the LM head out of "
                              "the adapter's target_modules, or pass fused_loss=False.")
    if getattr(head.weight, "_slapo_shard", None) is not None:
        raise SchedulingError(sch.path, f"fused_loss needs an unsharded LM head, but "
                              f"{plan.head}.weight is sharded over the vocabulary.",
                              "pass vocab_parallel=False with fused_loss=True.")
    if module_patch.kernel(root) is not None:
        raise SchedulingError(sch.path, "the model's forward is already replaced.",
                              "apply fused_loss once.")
    return plan


def honours_num_items(forward: Callable) -> bool:
    """Whether an HF head class's `forward` divides its loss by `num_items_in_batch` when given
    (what HF's Trainer passes under gradient accumulation): the step's own rule
    (`runtime.token_mean.forward_divides_by_num_items`, read from the installed source: in
    5.23 the causal LMs do; BERT's, RoBERTa's and ALBERT's masked LM and T5 take the plain
    mean). Without a source the fused loss cannot match the model's loss scale, so it refuses."""
    from ..runtime.token_mean import forward_divides_by_num_items

    honours = forward_divides_by_num_items(forward)
    if honours is None:
        raise SchedulingError("", f"fused_loss cannot read {forward.__qualname__}'s source to "
                              "tell whether it honours num_items_in_batch.",
                              "install transformers with its sources, or pass "
                              "fused_loss=False.")
    return honours


def fuse_loss(sch: Schedule) -> None:
    """Install the fused head+loss on the schedule's root (see module docstring)."""
    plan = check_fusable(sch)
    if plan.hidden is not None:  # asked of the model's own forward, before anything changes
        from dataclasses import replace

        from ..runtime.stages_seq2seq import decoder_output_scale

        plan = replace(plan, scale=decoder_output_scale(sch.mod))
    kernel = FusedLossKernel(plan, module_patch.original_class(sch.mod).forward)  # may refuse
    module_patch.set_kernel(sch.mod, kernel)
    sch._record("fused_loss", (), {"head": plan.head})
