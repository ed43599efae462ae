"""PEFT's LoRA inside the tensor-parallel plans: a wrapped model schedules like its base.

`peft.get_peft_model` replaces each targeted projection by a `peft.tuners.lora.Linear` that
holds the original as `base_layer` and computes `base(x) + B(A(dropout(x))) * scaling` per
active adapter (A: in -> r, B: r -> out). A plan row written for the projection now finds the
LoRA layer at its path; `plan.TPPlan.resolve` hands the row to `lora_style`, which says how the
row applies to base, A and B so the sum stays exact under tp ranks:

- `Column` (output features split): the base keeps its output slice, B keeps the same slice of
  its output rows (`blocks` too: GPT-2's fused q|k|v), A stays whole. Each rank's output is its
  slice of base(x) + B(A(x)) with no collective. A is replicated but its gradient is the sum
  over all output features, which each rank sees a part of: A's gradient is summed over the
  group (`reduce_param_grads`), like a replicated norm inside a sharded region.
- `Row` (input features split): the base keeps its input slice and A keeps the same input
  columns, so A(x) on this rank is a partial sum, and so is B(A(x)) (B linear, replicated).
  base(x) + B(A(x)) is therefore reduced **once**, by one kernel on the LoRA layer
  (`LoraRowKernel`: the bias-free base product plus the LoRA term, all-reduce or, under sequence
  parallelism, reduce-scatter, then the base's bias added once). B's gradient pairs the whole
  output gradient with this rank's partial A(x): it is summed over the group.
- rows acting on the module's input or output (`EnterRegion`, `ReduceInputGrad`,
  `GatherOutput`, `ScatterInput`) apply to the LoRA layer itself: they act on the whole sum.

Refused before any change (`SchedulingError`): a PEFT layer other than LoRA's `Linear` over an
`nn.Linear` or HF `Conv1D` under a plan row, a LoRA variant (DoRA), `lora_bias`, merged
adapters, any other plan style on a LoRA layer, and aLoRA on a cp or pp mesh
(`_check_activated_lora`).

LoRA dropout under tp > 1 follows the input's layout: a column LoRA's input is whole on every
rank (replicated, or gathered under sequence parallelism), so its dropout draws from the shared
stream, one mask for all ranks, even inside a per-rank region such as LLaMA's `self_attn`
(`fork_rng(stream="shared")`); a row LoRA's input holds this rank's features, so its dropout
draws from the per-rank stream (`fork_rng()`; a no-op where the region is already per-rank).
Each rank then computes its part of exactly what one process computes with the mask that is
the concatenation of the ranks' masks (`tests/test_lora_dropout_tp.py`). `peft` is imported only when it is already loaded: a model that holds
PEFT layers was made by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import module_patch, sharding
from ..distributed import collectives
from ..errors import SchedulingError
from ..runtime.peft_wrapper import is_peft_model, peft_inner_path, peft_module
from ..schedule import Schedule
from .plan import Column, EnterRegion, ReduceInputGrad, Row, Style, _check_split

_peft = peft_module


def model_inside(sch: Schedule) -> Schedule:
    """The node a family schedules: the Hugging Face model inside a `peft.PeftModel`, so its
    paths (layer lists, model-level sequence-parallel paths) are the base model's own; `sch`
    itself otherwise."""
    path = peft_inner_path(sch.mod)
    return sch if path is None else sch[path]


def is_tuner_layer(mod: nn.Module) -> bool:
    """Any PEFT adapter layer (LoRA, AdaLoRA, IA3, ...)."""
    peft = _peft()
    if peft is None:
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return isinstance(mod, BaseTunerLayer)


def _is_lora_linear(mod: nn.Module) -> bool:
    from peft.tuners.lora.layer import Linear

    return module_patch.original_class(mod) is Linear


def lora_style(node: Schedule, style: Style) -> Style:
    """The style a plan row applies when its module is a PEFT adapter layer (module doc);
    `style` itself for any other module."""
    if not is_tuner_layer(node.mod):
        return style
    if isinstance(style, Column):
        return LoraColumn(style)
    if isinstance(style, Row):
        return LoraRow(style)
    from .plan_edges import GatherOutput, ScatterInput

    if isinstance(style, (EnterRegion, ReduceInputGrad, GatherOutput, ScatterInput)):
        return OnLoraLayer(style)
    return Unsplittable(style)


# ---- the checks ------------------------------------------------------------------------------


def _adapters(node: Schedule) -> list[str]:
    return list(node.mod.lora_A.keys())


def check_lora_layer(node: Schedule, style: Style, tp: int) -> None:
    """Everything the LoRA styles need of the layer, before any change."""
    mod = node.mod
    if not _is_lora_linear(mod):
        raise SchedulingError(node.path, f"{style} cannot split the PEFT layer "
                              f"{type(mod).__name__} ({type(mod).__module__}): only LoRA's "
                              "Linear is split by the tensor-parallel plans.",
                              "leave this module out of the adapter's target_modules, or use "
                              "tp=1.")
    base = mod.get_base_layer()
    if not (isinstance(base, nn.Linear) or sharding._is_hf_conv1d(base)):
        raise SchedulingError(node.path, f"{style}: the LoRA layer's base is "
                              f"{type(base).__name__}, not an nn.Linear or HF Conv1D.",
                              "leave this module out of the adapter's target_modules.")
    if mod.merged:
        raise SchedulingError(node.path, "the LoRA adapter is merged into the base weight, and "
                              "the tensor-parallel LoRA computes base and adapter separately.",
                              "unmerge the adapter (model.unmerge_adapter()) before scheduling.")
    for name in _adapters(node):
        if name in getattr(mod, "lora_variant", {}):
            raise SchedulingError(node.path, f"adapter {name!r} is a LoRA variant "
                                  f"({type(mod.lora_variant[name]).__name__}, e.g. DoRA), which "
                                  "the tensor-parallel plan cannot split.",
                                  "use plain LoRA (use_dora=False), or tp=1.")
        if mod.lora_B[name].bias is not None:
            raise SchedulingError(node.path, f"adapter {name!r} has lora_bias=True; a "
                                  "tensor-parallel LoRA B has no bias.",
                                  "use lora_bias=False, or tp=1.")
        drop = mod.lora_dropout[name]
        if tp > 1 and not isinstance(drop, (nn.Dropout, nn.Identity)):
            raise SchedulingError(node.path, f"adapter {name!r} has a {type(drop).__name__} as "
                                  "its LoRA dropout; under tensor parallelism only nn.Dropout "
                                  "gets its stream rule.", "use plain lora_dropout, or tp=1.")


def _dropouts(node: Schedule) -> list[Schedule]:
    """The adapters' dropout modules that can draw (p > 0)."""
    return [_part(node, "lora_dropout", n) for n in _adapters(node)
            if isinstance(node.mod.lora_dropout[n], nn.Dropout) and node.mod.lora_dropout[n].p > 0]


def _part(node: Schedule, what: str, name: str) -> Schedule:
    return node[f"{what}.{name}"]


# ---- the styles ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraColumn(Style):
    """`Column` on a LoRA layer: base and B split over output features, A's gradient summed."""

    inner: Column

    def effects(self, node, tp, sp):
        base = node["base_layer"]
        out = [("shard", "base_layer." + e[1]) for e in self.inner.effects(base, tp, sp)]
        return out + [("shard", f"lora_B.{n}.weight") for n in _adapters(node)] + \
            [("grads", f"lora_A.{n}") for n in _adapters(node)]

    def check(self, node, tp, sp):
        check_lora_layer(node, self, tp)
        self.inner.check(node["base_layer"], tp, sp)
        for n in _adapters(node):
            _check_split(_part(node, "lora_B", n), "weight", 0, tp, self.inner.blocks, self)

    def apply(self, node, tp, sp):
        self.inner.apply(node["base_layer"], tp, sp)
        for n in _adapters(node):
            _part(node, "lora_B", n).shard("weight", axis=0, blocks=self.inner.blocks)
            _part(node, "lora_A", n).reduce_param_grads("weight")
        for drop in _dropouts(node):  # the input is whole on every rank: one mask for all
            drop.fork_rng(draws="dropout", stream="shared")
        node.set_attr("out_features", node.mod.out_features // tp)
        module_patch.module_meta(node.mod, create=True)["output_layout"] = \
            (sharding.PARTITION, -1)


@dataclass(frozen=True)
class LoraRow(Style):
    """`Row` on a LoRA layer: base and A split over input features, base(x) + B(A(x)) reduced
    once by `LoraRowKernel`, B's gradient summed."""

    inner: Row

    def effects(self, node, tp, sp):
        op = "reduce_scatter" if sp else "all_reduce"
        return [("shard", "base_layer.weight"), ("sync", "fwd_post", op)] + \
            [("shard", f"lora_A.{n}.weight") for n in _adapters(node)] + \
            [("grads", f"lora_B.{n}") for n in _adapters(node)]

    def check(self, node, tp, sp):
        check_lora_layer(node, self, tp)
        self.inner.check(node["base_layer"], tp, sp)
        for n in _adapters(node):
            _check_split(_part(node, "lora_A", n), "weight", 1, tp, 1, self)

    def apply(self, node, tp, sp):
        base = node["base_layer"]
        base.shard("weight", axis=0 if sharding._is_hf_conv1d(base.mod) else 1)
        for n in _adapters(node):
            _part(node, "lora_A", n).shard("weight", axis=1)
            _part(node, "lora_B", n).reduce_param_grads("weight")
        for drop in _dropouts(node):  # each rank holds other input features: its own mask
            drop.fork_rng(draws="dropout")
        node.set_attr("in_features", node.mod.in_features // tp)
        scatter = self.inner.token_axis if sp else None
        module_patch.set_kernel(node.mod, LoraRowKernel(node.group, scatter))
        meta = module_patch.module_meta(node.mod, create=True)
        op = "reduce_scatter" if sp else "all_reduce"
        meta.setdefault("syncs", []).append(("fwd_post", op))
        meta["output_layout"] = (sharding.PARTITION, scatter) if sp else ("replicated", None)
        node._record("lora_row", (), {"reduce": op, "axis": scatter})


@dataclass(frozen=True)
class OnLoraLayer(Style):
    """A row acting on the module's input or output: applied to the LoRA layer (the whole
    base + adapter sum); its check reads the base projection."""

    inner: Style

    def effects(self, node, tp, sp):
        return self.inner.effects(node, tp, sp)

    def check(self, node, tp, sp):
        check_lora_layer(node, self.inner, tp)
        self.inner.check(node["base_layer"], tp, sp)

    def apply(self, node, tp, sp):
        self.inner.apply(node, tp, sp)


@dataclass(frozen=True)
class Unsplittable(Style):
    """Any other plan style on an adapter layer: refused at the check."""

    inner: Style

    def check(self, node, tp, sp):
        raise SchedulingError(node.path, f"the tensor-parallel plan applies {self.inner} here, "
                              f"but the module is a PEFT {type(node.mod).__name__} layer, which "
                              "that style cannot split.", "leave this module out of the "
                              "adapter's target_modules, or use tp=1.")

    def apply(self, node, tp, sp):
        raise AssertionError("checked")  # `check` always refuses first


# ---- the row-parallel kernel -----------------------------------------------------------------


class LoraRowKernel(module_patch.Kernel):
    """A row-parallel LoRA layer's forward: (x W_local + sum over active adapters of
    B(A_local(dropout(x))) * scaling), reduced once over the group (all-reduce, or reduce-scatter
    along `scatter_dim` under sequence parallelism), then the base's bias added once (its
    gradient summed when each rank added it to its own tokens). What PEFT's forward does, with
    the one reduction placed where the sum is still partial."""

    name = "lora_row"

    def __init__(self, group, scatter_dim: int | None = None):
        self.group, self.scatter_dim = group, scatter_dim

    def __call__(self, mod: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args or kwargs.get("adapter_names") is not None or mod.merged:
            raise SchedulingError("", "a tensor-parallel LoRA layer runs one input with its "
                                  "active adapters (no adapter_names mixed batches, no merged "
                                  "adapters).", "call the model without adapter_names, or use "
                                  "tp=1.")
        base = mod.get_base_layer()
        y = sharding.local_gemm(base, x)
        dtype = y.dtype
        if not mod.disable_adapters:
            for name in mod.active_adapters:
                if name not in mod.lora_A:
                    continue
                a, b = mod.lora_A[name], mod.lora_B[name]
                xa = x.to(a.weight.dtype) if x.dtype != a.weight.dtype else x
                y = y + b(a(mod.lora_dropout[name](xa))) * mod.scaling[name]
        if self.scatter_dim is None:
            y = collectives.reduce_forward(y, self.group)
        else:
            y = collectives.reduce_scatter(y, self.scatter_dim, self.group)
        if base.bias is not None:
            bias = base.bias if self.scatter_dim is None else \
                collectives.reduce_backward(base.bias, self.group)
            y = y + bias
        return y.to(dtype)




def check_knobs(sch: Schedule, tp: int, fuse: bool, kernels: bool,
                vocab_parallel: bool) -> None:
    """The knobs that do not compose with PEFT adapter layers yet, refused before any change:
    `fuse` and `kernels` (they trace or
    replace whole MLPs, which would drop or break the adapters inside), and under tp > 1 with
    `vocab_parallel` an adapter on the input embedding or the LM head (their vocabulary shard
    does not split an adapter)."""
    tuned = [name for name, mod in sch.mod.named_modules() if is_tuner_layer(mod)]
    if not tuned:
        return
    _check_activated_lora(sch)
    for knob, on in (("fuse", fuse), ("kernels", kernels)):
        if on:
            raise SchedulingError(sch.path, f"{knob} is not supported on a model with PEFT "
                                  f"adapter layers ({len(tuned)}, e.g. {tuned[0]}).",
                                  f"schedule without {knob.split(' ')[0]}, or without adapters.")
    if tp > 1 and vocab_parallel:
        for what in ("get_input_embeddings", "get_output_embeddings"):
            get = getattr(sch.mod, what, None)
            emb = get() if callable(get) else None
            if emb is not None and is_tuner_layer(emb):
                raise SchedulingError(sch.path, f"vocab_parallel shards the embedding and LM "
                                      f"head over the vocabulary, but {what}() is a PEFT "
                                      f"{type(emb).__name__} layer it cannot split.",
                                      "pass vocab_parallel=False, or leave the embedding and "
                                      "LM head out of the adapter's target_modules.")


def _check_activated_lora(sch: Schedule) -> None:
    """aLoRA (activated LoRA, `alora_invocation_tokens`) adds its adapter only to the tokens
    after an invocation sequence, at offsets `PeftModelForCausalLM.forward` finds in each row's
    whole `input_ids`. A cp rank's input is chunks of every row (the offsets are found in, and
    counted from the end of, the wrong tokens: gradients 55% off, LLaMA cp=2) and a pipeline
    stage never runs that forward (no offsets: the adapter is never added, its gradient 0):
    both trained without an error. Refused on a cp or pp mesh, before any change."""
    from ..runtime.mesh import ParallelDims

    dims = ParallelDims.of(sch.mesh)
    split = [f"{k}={n}" for k, n in (("cp", dims.cp), ("pp", dims.pp)) if n > 1]
    if not split:
        return
    for name, mod in sch.mod.named_modules():
        for adapter, variant in getattr(mod, "lora_variant", {}).items():
            if type(variant).__name__ == "ALoraLinearVariant":
                path = f"{sch.path}.{name}" if sch.path else name
                raise SchedulingError(path, f"adapter {adapter!r} is an activated LoRA "
                                      "(alora_invocation_tokens): PEFT's model forward finds "
                                      "where it starts in each whole row of input_ids, which "
                                      f"a mesh with {' and '.join(split)} never hands one "
                                      "module (cp: chunks of every row; pp: stages skip that "
                                      "forward), so the adapter would be applied to the wrong "
                                      "tokens or none.", "use a plain LoRA (no "
                                      "alora_invocation_tokens), or a mesh without cp and pp "
                                      "(data-parallel ranks hold whole rows).")


__all__ = ["LoraColumn", "LoraRow", "LoraRowKernel", "OnLoraLayer", "Unsplittable",
           "check_knobs", "is_peft_model", "is_tuner_layer", "lora_style", "model_inside",
           "peft_inner_path"]
