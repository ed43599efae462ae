"""A family for any Hugging Face decoder, derived from the tensor-parallel plan its config
declares (`config.base_model_tp_plan`, e.g. {"layers.*.self_attn.q_proj": "colwise", ...}).

Transformers declares how each architecture splits, and applies it with DTensor without
checking that the result computes what the model did. Here the declaration is only the
*input*: every HF style becomes Slapo plan rows (`plan.py`, `plan_edges.py`) applied with
Slapo's primitives, or a refusal naming the style, the module and the way out. What is not
provably the model's computation is refused, never approximated:

| HF style                        | Slapo rows (per module)                                      |
|---------------------------------|--------------------------------------------------------------|
| `colwise`                       | `Column()` + `EnterRegion()` (Megatron f on the projection)  |
| `packed_colwise`                | `Column(blocks=2)` + `EnterRegion()` (gate|up per block)     |
| `colwise` on a parameter        | `ShardParam(name, axis=0)` on its module (per-head sinks)    |
| `colwise_gather_output`         | `Column()` + `EnterRegion()` + `GatherOutput()`              |
| `rowwise`                       | `Row()` (all-reduce after)                                   |
| `rowwise_split_input`           | `ScatterInput()` + `Row()`                                   |
| `replicated_with_grad_allreduce`| `ReduceParamGrads()` (per-head norms)                        |
| `local_params`, `replicate`     | nothing (Slapo's shards are local tensors; replicated stays) |
| `embedding_rowwise` (model)     | the `vocab_parallel` knob (the input embedding and LM head)  |
| `moe_tp_experts` (+ its tensors' `packed_colwise`/`colwise`/`rowwise`/`packed_rowwise`) | `Experts()` (`plan_experts.py`: each expert's FFN split) |
| `mla_kv_a_proj`                 | `ReduceTailGrad(qk_rope_head_dim)` + `Replicated()` on `q_a_proj`, `q_a_layernorm`, `kv_a_layernorm` |
| others                          | refused (`REFUSED`)                                          |

Why `EnterRegion` on each projection and not on the attention/MLP module as the hand plans
do: a module's input may also flow around its projections (a gate, a residual inside the
module), and all-reducing that part's gradient would multiply it by tp. A projection's input
is replicated and its weight is split, so its input gradient is partial and the sum is exact,
whatever else reads the input; it costs one all-reduce per projection instead of one per
module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule
from ._common import find_path
from .hf_plan_layers import (
    Refused,
    check_moe_layers,
    check_regions,
    get,
    has_param,
    join,
    other_kinds_optional,
)
from .lora import is_tuner_layer
from .plan import (
    OPTIONAL,
    Column,
    EnterRegion,
    ReduceParamGrads,
    Row,
    ShardParam,
    Style,
    TPPlan,
)
from .plan_edges import GatherOutput, ReduceTailGrad, Replicated, ScatterInput
from .plan_experts import Experts
from .plan_supplements import declared_tp_plan

if TYPE_CHECKING:
    from ._registry import Family

_MOE = "MoE experts are not translated here (expert parallelism: issue 33)"
# HF style -> why it is refused (the reason names what the translation cannot prove)
REFUSED = {
    "moe_identity_expert": "an identity expert inside tensor-parallel experts returns its whole "
                           "input on every rank, which the experts' all-reduce would multiply",
    "grouped_gemm": _MOE,
    "ep_dispatch_experts": _MOE,
    "all_reduce": "a module-output all-reduce outside a row projection (shared MoE experts) "
                  "has no Slapo row that proves it",
    "embedding_colwise": "an embedding split over its features inside a layer is not "
                         "translated",
}
_NOTHING = {"local_params": "Slapo's shards are local tensors already",
            "replicate": "stays replicated"}
_MODULE_STYLES = {"colwise", "packed_colwise", "colwise_gather_output", "rowwise",
                  "rowwise_split_input", "replicated_with_grad_allreduce"}
EXPERTS = "moe_tp_experts"
# the styles HF gives the stacked tensors of a `moe_tp_experts` module (their split is the
# module's: `plan_experts.Experts` reads it from the module's own flags)
_EXPERT_TENSOR_STYLES = {"packed_colwise", "colwise", "rowwise", "packed_rowwise"}
MLA = "mla_kv_a_proj"
# the modules of multi-head latent attention that run before its column projections (whole on
# every rank, their gradient whole after the projections' input reductions)
# (DeepSeek-V3.2's sparse-attention `indexer` too: it scores tokens from those whole inputs)
_MLA_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_layernorm", "indexer")
# MLA's query: `q_proj` without a low-rank query (q_lora_rank None), else `q_b_proj`
_MLA_QUERY = ("q_proj", "q_b_proj")
KNOWN = set(REFUSED) | set(_NOTHING) | _MODULE_STYLES | {"embedding_rowwise", EXPERTS,
                                                         "packed_rowwise", MLA}
_LAYER_ROW = re.compile(r"^(?P<list>[^*]+)\.\*\.(?P<rel>[^*]+)$")
FIX = ("use tp=1 (every other knob still applies), or register a hand-written Family with "
       "its own TPPlan (docs/model_schedule.md).")


@dataclass(frozen=True)
class DeclaredPlan(TPPlan):
    """A `TPPlan` derived from a declared HF plan. A row is skipped only in a layer that lacks
    its top-level module (hybrid decoders: a layer has `self_attn` or `linear_attn`), or where
    `hf_plan_layers.other_kinds_optional` marked it optional (another kind of module at its
    place, a per-head parameter the layer lacks); any other missing module is an error, so a
    projection is never split without its partner."""

    model_type: str = ""

    @staticmethod
    def _node(layer: Schedule, path: str, style: Style) -> Schedule | None:
        if path.rstrip(OPTIONAL).split(".")[0] not in layer.mod._modules:
            return None
        node = TPPlan._node(layer, path, style)
        if (node is not None and path.endswith(OPTIONAL) and isinstance(style, ShardParam)
                and not has_param(node.mod, style.name)):
            return None  # a per-head parameter this layer's module does not have
        return node


@dataclass(frozen=True)
class RefusedPlan:
    """The plan of a model whose declared plan cannot be translated: every knob but tp > 1
    applies; `validate` (run by `apply` before any change) raises the named reason."""

    problem: str
    fix: str = FIX

    def validate(self, layers: list[Schedule], tp: int, sequence_parallel: bool = False) -> None:
        path = layers[0].parent.path if layers and layers[0].parent is not None else ""
        raise SchedulingError(path, f"{self.problem}.", self.fix)

    def apply(self, layer: Schedule, tp: int, sequence_parallel: bool = False) -> None:
        raise SchedulingError(layer.path, f"{self.problem}.", self.fix)


def split_rows(declared: dict) -> tuple[dict[str, list[tuple[str, str]]], list[tuple[str, str]]]:
    """({layer list: [(path in a layer, HF style)]}, [(model-level path, HF style)])."""
    layers: dict[str, list[tuple[str, str]]] = {}
    model_rows = []
    for key, style in declared.items():
        m = _LAYER_ROW.match(key)
        if m:
            layers.setdefault(m["list"], []).append((m["rel"], style))
        else:
            model_rows.append((key, style))
    return layers, model_rows


def refusal(model: nn.Module, declared: dict) -> str | None:
    """Why the declared plan cannot be translated, or None. Checked from the plan and the
    model's modules alone, before any change."""
    model_type = model.config.model_type
    for key, style in declared.items():
        if isinstance(style, tuple):  # Slapo's own rows (`plan_supplements.py`)
            continue
        if style not in KNOWN:
            return (f"the declared tensor-parallel plan of {model_type!r} gives {key!r} the "
                    f"style {style!r}, which Slapo does not know")
        if style in REFUSED:
            return f"{model_type!r} declares {key!r}: {style!r}, refused: {REFUSED[style]}"
    layers, model_rows = split_rows(declared)
    for key, style in model_rows:
        if style in _NOTHING:  # an embedding that stays whole (Inkling 2's "replicate")
            continue
        if style != "embedding_rowwise" or not _is_input_embedding(model, key):
            return (f"{model_type!r} declares {key!r}: {style!r} outside the layers, which "
                    "is not translated (only the input embedding's embedding_rowwise is: "
                    "the vocab_parallel knob)")
    for key in declared:
        if "*" in key and not _LAYER_ROW.match(key):
            return f"{model_type!r} declares {key!r}, a path with more than one wildcard"
    if not layers:
        return (f"{model_type!r} declares no layer rows ({sorted(declared)}): its declared plan "
                "splits nothing inside the layers")
    if len({frozenset(rows) for rows in layers.values()}) > 1:
        return (f"{model_type!r} declares different rows for its layer lists "
                f"{sorted(layers)}")
    for rel, style in next(iter(layers.values())):
        if style == "embedding_rowwise":
            return (f"{model_type!r} declares {rel!r}: 'embedding_rowwise' inside a layer, "
                    "which is not translated")
    return None


def _is_input_embedding(model: nn.Module, key: str) -> bool:
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    path = find_path(model, key)
    return emb is not None and path is not None and model.get_submodule(path) is emb


def _rows_for(rel: str, style: str, target: nn.Module | None, param: str | None,
              model_type: str) -> list[tuple[str, Style]]:
    """The Slapo rows of one declared (module or parameter, style) pair."""
    if style in _NOTHING:
        return []
    if param is not None:  # a parameter of the module at `rel`'s parent (attention sinks)
        if style != "colwise":
            raise Refused(f"{model_type!r} declares the parameter {rel!r} {style!r}; only "
                          "'colwise' parameters (per-head tensors) are translated")
        return [(rel.rpartition(".")[0], ShardParam(param, axis=0))]
    if style == "replicated_with_grad_allreduce":  # a norm without a scale: nothing to sum
        return [(rel, ReduceParamGrads())] if any(True for _ in target.parameters()) else []
    if is_tuner_layer(target):  # a PEFT adapter layer: its plan row splits base, A and B
        target = target.get_base_layer()
    if not isinstance(target, nn.Linear):
        raise Refused(f"{model_type!r} declares {rel!r}: {style!r} on a "
                      f"{type(target).__name__}; only nn.Linear projections are split")
    if style in ("colwise", "packed_colwise"):
        return [(rel, Column(blocks=2 if style == "packed_colwise" else 1)), (rel, EnterRegion())]
    if style == "colwise_gather_output":
        return [(rel, Column()), (rel, EnterRegion()), (rel, GatherOutput())]
    if style == "rowwise":
        return [(rel, Row())]
    return [(rel, ScatterInput()), (rel, Row())]  # rowwise_split_input


def _find(layers: list[nn.Module], rel: str) -> tuple[nn.Module | None, str | None]:
    """(module at `rel`, None) or (None, parameter name) in the first layer that has it."""
    parent, _, name = rel.rpartition(".")
    for layer in layers:
        try:
            return layer.get_submodule(rel), None
        except AttributeError:
            pass
        try:
            owner = layer.get_submodule(parent) if parent else layer
        except AttributeError:
            continue
        if has_param(owner, name):
            return None, name
    return None, None


def layer_lists(model: nn.Module, declared: dict) -> tuple[str, ...]:
    """Full paths of the ModuleLists holding the layers: the declared tp plan's `<list>.*`
    prefixes, else the ModuleLists its pp plan names, else `layers` (a plan that only shards
    the embedding: its family still has layers for the other knobs)."""
    names = list(split_rows(declared)[0])
    if not names:
        names = list(getattr(model.config, "base_model_pp_plan", None) or {}) + ["layers"]
    paths = [find_path(model, n) for n in names]
    found = tuple(p for p in paths if p is not None and isinstance(get(model, p), nn.ModuleList))
    return found if split_rows(declared)[0] else found[:1]


def derive_plan(model: nn.Module, lists: tuple[str, ...]) -> DeclaredPlan | RefusedPlan:
    """The model's declared plan as a `DeclaredPlan`, or a `RefusedPlan` with the reason."""
    declared = declared_tp_plan(model) or {}
    model_type = model.config.model_type
    why = refusal(model, declared)
    if why is not None:
        return RefusedPlan(why)
    layers = [layer for path in lists for layer in model.get_submodule(path)]
    rows: list[tuple[str, Style]] = []
    declared_rows = next(iter(split_rows(declared)[0].values()))
    experts = {rel for rel, style in declared_rows if style == EXPERTS}
    try:
        for rel, style in declared_rows:
            if isinstance(style, tuple):  # Slapo styles, where some layer has the module
                if any(get(layer, rel) is not None for layer in layers):
                    rows += [(rel, st) for st in style]
                continue
            if style == EXPERTS:
                rows.append((rel, Experts()))
                continue
            if rel.rpartition(".")[0] in experts:  # a tensor of the experts: their split
                if style not in _EXPERT_TENSOR_STYLES:
                    raise Refused(f"{model_type!r} declares the expert tensor {rel!r} "
                                  f"{style!r}, which expert TP does not translate")
                continue
            if style == MLA:
                rows += _mla_rows(model, layers, rel, declared_rows)
                continue
            if style == "packed_rowwise":
                raise Refused(f"{model_type!r} declares {rel!r}: 'packed_rowwise' outside "
                              "tensor-parallel experts, which is not translated")
            target, param = _find(layers, rel)
            if target is None and param is None:
                if _moe_alternative(rel, experts):  # the dense MLP of MoE-only layers
                    continue
                if _mla_query_alternative(rel, declared_rows, layers):
                    continue
                raise Refused(f"{model_type!r} declares {rel!r}: {style!r}, but no layer of "
                              "this model has that module or parameter")
            rows += _rows_for(rel, style, target, param, model_type)
        rows = [(p + OPTIONAL if _moe_alternative(p, experts) else p, st) for p, st in rows]
        rows = other_kinds_optional(layers, rows, model_type)
        check_moe_layers(layers, rows, experts, model_type)
        check_regions(layers, rows, model_type)
    except Refused as e:
        return RefusedPlan(str(e))
    return DeclaredPlan(tuple(rows), model_type=model_type)


def _mla_rows(model: nn.Module, layers: list[nn.Module], rel: str,
              declared_rows: list[tuple[str, str]]) -> list[tuple[str, Style]]:
    """Multi-head latent attention's kv_a projection: replicated, the gradient of its shared
    rotary key (its last `qk_rope_head_dim` outputs) summed over the ranks; the compressed kv
    feeds `kv_b_proj`, which must be a declared column projection (its input reduction sums
    the rest). The modules before the column projections are replicated rows."""
    model_type = model.config.model_type
    parent = rel.rpartition(".")[0]
    # the width each layer's attention stores (a config may set it per layer); one for all
    widths = {getattr(get(layer, parent), "qk_rope_head_dim", None) for layer in layers
              if get(layer, rel) is not None}
    if len(widths) != 1 or not isinstance(rope := widths.pop(), int) or rope <= 0:
        raise Refused(f"{model_type!r} declares {rel!r}: {MLA!r}, but its layers' attention "
                      f"modules do not share one qk_rope_head_dim (found {sorted(map(str, widths))}"
                      "): the shared rotary key's width")
    kv_b = join(parent, "kv_b_proj")
    if (kv_b, "colwise") not in declared_rows:
        raise Refused(f"{model_type!r} declares {rel!r}: {MLA!r} without a colwise {kv_b!r} "
                      "to sum the compressed kv's gradient")
    rows: list[tuple[str, Style]] = [(rel, ReduceTailGrad(rope))]
    for name in _MLA_REPLICATED:
        path = join(parent, name)
        if _find(layers, path)[0] is not None:
            rows.append((path + OPTIONAL, Replicated()))
    return rows


def _mla_query_alternative(rel: str, declared_rows: list[tuple[str, str]],
                           layers: list[nn.Module]) -> bool:
    """`rel` is the MLA query projection this configuration does not build, and the other one
    is there (DeepSeek-V2's plan declares both `q_proj` and `q_b_proj`)."""
    parent, _, name = rel.rpartition(".")
    if name not in _MLA_QUERY or (join(parent, "kv_a_proj_with_mqa"), MLA) not in declared_rows:
        return False
    other = join(parent, _MLA_QUERY[1 - _MLA_QUERY.index(name)])
    return _find(layers, other)[0] is not None


def _moe_alternative(rel: str, experts: set[str]) -> bool:
    """A row of an MoE block's own module (its experts, shared experts, or the dense MLP that
    layers without experts have in the same place): present in some layers only."""
    return any(rel == e or rel.startswith(e.rpartition(".")[0] + ".") for e in experts)


def declared_family(model: nn.Module) -> Family | None:
    """A `Family` scheduling `model` from its config's `base_model_tp_plan`, or None when the
    config declares none or its layers cannot be found. The tensor-parallel plan is derived
    (or refused, with the reason raised at `tp > 1`); the layer-wise knobs (ckpt_ratio,
    compile_blocks, attention, fused_loss, vocab_parallel, pp_stages) need only the layers."""
    from ._registry import Family

    cfg = getattr(model, "config", None)
    declared = declared_tp_plan(model)
    if declared is None:
        return None
    lists = layer_lists(model, declared)
    if not lists:
        return None
    return Family(name=f"declared:{cfg.model_type}", model_types=(cfg.model_type,),
                  layer_lists=lists, tp_plan=derive_plan(model, lists),
                  notes="derived from config.base_model_tp_plan (model_schedule/hf_plan.py)")


__all__ = ["DeclaredPlan", "KNOWN", "REFUSED", "RefusedPlan", "declared_family", "derive_plan",
           "layer_lists"]
