"""Tensor-parallel plans as data: one table per family, run by the runtime AND the cost model.

A family's plan is a `TPPlan`: a table of (module path relative to one layer, style) rows, in
the spirit of `torch.distributed.tensor.parallel`'s `parallelize_module(layer, mesh, plan)`
(ColwiseParallel / RowwiseParallel / SequenceParallel), but applied through Slapo's own
primitives (`shard`, `sync`, `set_attr`, `reduce_param_grads`), so every change is validated,
recorded in the schedule and undone by nothing else:

    TPPlan((
        ("self_attn.q_proj", Column()),           # output features split: heads per rank
        ("self_attn", EnterRegion()),             # Megatron f (or the SP all-gather)
        ("self_attn.o_proj", Row()),              # input features split, all-reduce after
        ("self_attn.q_norm?", ReduceParamGrads()),  # "?": only some variants have it
    ))

Why data and not code: one table is read by `model_schedule.apply` (`Family.shard` calls
`TPPlan.apply`) and by the cost model (`shard_block` applies the same table to a copy of one
block on a `VirtualGroup`), so the runtime and the tuner cannot disagree about how a block is
split; a table can be validated whole before the first change, printed, and compared.

Why Megatron-style local shards (not DTensor styles): HF modules reshape with `-1` or with
attributes we divide (`DivideAttr`), and explicit autograd collectives cost nothing per op; see
`slapo.sharding`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn

from ..errors import SchedulingError
from ..module_patch import module_meta
from ..schedule import Schedule
from ._common import SEQ_DIM

OPTIONAL = "?"  # a trailing "?" on a plan path: skip the row when the layer has no such module

# ---- styles ----------------------------------------------------------------------------------


class Style:
    """How one module of a layer takes part in tensor parallelism.

    `effects` lists what `apply` will change (for the plan's whole-table check: a tensor sharded
    twice or a sync applied twice is refused before anything changes); `check` raises a
    `SchedulingError` for what would fail half-way (sizes that do not divide, missing tensors);
    `apply` makes the change with the primitives. All three take the schedule node of the
    module, the tensor-parallel degree and whether sequence parallelism is on. A plan
    written as code may call `style.apply(node, tp, sp)` directly."""

    def effects(self, node: Schedule, tp: int, sp: bool) -> list[tuple]:
        return []

    def check(self, node: Schedule, tp: int, sp: bool) -> None:
        return None

    def apply(self, node: Schedule, tp: int, sp: bool) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class Column(Style):
    """Column parallel: each rank keeps 1/tp of the output features (weight rows of a Linear,
    columns of an HF Conv1D, and the bias), so its output is a slice of the features (this
    rank's heads, or its share of the MLP's intermediate features) and needs no collective when
    a `Row` layer consumes it. `blocks=k` splits a fused projection per part (GPT-2's q|k|v
    `c_attn`: `blocks=3`), so each rank keeps its heads of q, of k and of v."""

    blocks: int = 1

    def effects(self, node, tp, sp):
        names = ["weight"] + (["bias"] if _has(node.mod, "bias") else [])
        return [("shard", n) for n in names]

    def check(self, node, tp, sp):
        axis = 1 if _is_conv1d(node.mod) else 0
        _check_split(node, "weight", axis, tp, self.blocks, self)
        if _has(node.mod, "bias"):
            _check_split(node, "bias", 0, tp, self.blocks, self)

    def apply(self, node, tp, sp):
        node.shard("weight", axis=1 if _is_conv1d(node.mod) else 0, blocks=self.blocks)
        if _has(node.mod, "bias"):
            node.shard("bias", axis=0, blocks=self.blocks)


@dataclass(frozen=True)
class Row(Style):
    """Row parallel: each rank keeps 1/tp of the input features and computes a partial sum of
    the full output. Plain TP all-reduces it (Megatron g; the bias is added once, after the
    reduction, by the sync's kernel). Under sequence parallelism it is reduce-scattered along
    the tokens instead (each rank keeps its sequence shard; the bias is added to this rank's
    tokens and its gradient summed over the group). `token_axis=0` for a layer that sees
    flattened [tokens, hidden] activations (OPT's MLP)."""

    token_axis: int = SEQ_DIM

    def effects(self, node, tp, sp):
        return [("shard", "weight"), ("sync", "fwd_post", "reduce_scatter" if sp else "all_reduce")]

    def check(self, node, tp, sp):
        _check_split(node, "weight", 0 if _is_conv1d(node.mod) else 1, tp, 1, self)

    def apply(self, node, tp, sp):
        node.shard("weight", axis=0 if _is_conv1d(node.mod) else 1)
        if sp:
            node.sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=self.token_axis)
        else:
            node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


@dataclass(frozen=True)
class ReduceInputGrad(Style):
    """All-reduce the gradient of the module's input (Megatron f: identity forward). The input
    is replicated and feeds column-parallel projections, so each rank's input gradient is only
    its heads' / features' share. Put it where the replicated input *enters* the sharded region
    and nowhere it also flows around it: ALBERT's attention adds its input back inside the
    module, so it is reduced per projection (and T5's cross-attention k/v read the encoder
    output, so each projection is reduced separately). The same in plain TP and under SP."""

    def effects(self, node, tp, sp):
        return [("sync", "bwd_post", "all_reduce")]

    def apply(self, node, tp, sp):
        node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


@dataclass(frozen=True)
class EnterRegion(Style):
    """The module's input enters a column-parallel region. Plain TP: the input is replicated and
    each rank's input gradient partial, so all-reduce it (Megatron f, as `ReduceInputGrad`).
    Sequence parallel: the input is sharded along the sequence, so all-gather it along
    `token_axis` (backward: reduce-scatter, Megatron's g-bar). A token-wise region (an MLP) may
    gather flattened [tokens, hidden] inputs on `token_axis=0`: the tokens come back rank-major,
    and the matching `Row(token_axis=0)` reduce-scatter returns each rank's own.

    `only="plain"` / `only="sp"` restricts the row to one mode, for a family whose gather point
    differs from its gradient point (GPT-2 reshapes q/k/v by the attention module's *input*
    shape, so under SP the whole module's input is gathered, while plain TP reduces `c_attn`'s)."""

    token_axis: int = SEQ_DIM
    only: Literal["plain", "sp"] | None = None

    def __post_init__(self):
        if self.only not in (None, "plain", "sp"):
            raise SchedulingError("", f"EnterRegion(only={self.only!r}) is not a mode.",
                                  "pass only=None (both), 'plain' (TP without SP) or 'sp'.")

    def _skipped(self, sp: bool) -> bool:
        return self.only == ("plain" if sp else "sp")

    def effects(self, node, tp, sp):
        if self._skipped(sp):
            return []
        return [("sync", "fwd_pre", "all_gather") if sp else ("sync", "bwd_post", "all_reduce")]

    def apply(self, node, tp, sp):
        if self._skipped(sp):
            return
        if sp:
            node.sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=self.token_axis)
        else:
            node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


@dataclass(frozen=True)
class DivideAttr(Style):
    """Divide an integer attribute by tp (`set_attr`): modules that reshape by a head count or a
    width they store (OPT/GPT-Neo `num_heads`, T5 `n_heads`/`inner_dim`, GPT-2's `split_size`
    for its fused q|k|v) must see this rank's share, or the reshape fails or mixes heads."""

    name: str

    def effects(self, node, tp, sp):
        return [("attr", self.name)]

    def check(self, node, tp, sp):
        value = node.mod.__dict__.get(self.name)
        if not isinstance(value, int) or isinstance(value, bool):
            raise SchedulingError(node.path, f"{self} needs an int attribute {self.name!r} on "
                                  f"{type(node.mod).__name__}, which has {value!r}.",
                                  "fix the attribute name in the plan.")
        if value % tp:
            raise SchedulingError(node.path, f"{self.name}={value} is not divisible by the "
                                  f"tensor-parallel degree {tp}.", "choose a tp that divides it.")

    def apply(self, node, tp, sp):
        node.set_attr(self.name, getattr(node.mod, self.name) // tp)


@dataclass(frozen=True)
class ShardParam(Style):
    """Shard one parameter along `axis` with nothing around it: a table whose rows are split
    the way the sharded projections are (T5's relative-position bias embedding, buckets x
    heads, sharded over heads: axis 1, so each rank adds the bias of its own heads)."""

    name: str
    axis: int

    def effects(self, node, tp, sp):
        return [("shard", self.name)]

    def check(self, node, tp, sp):
        _check_split(node, self.name, self.axis, tp, 1, self)

    def apply(self, node, tp, sp):
        node.shard(self.name, axis=self.axis)


@dataclass(frozen=True)
class ReduceParamGrads(Style):
    """Sum the gradients of the module's replicated parameters over the group: the module runs
    on one rank's share of the data, so each rank's gradient is partial (Qwen3's per-head
    `q_norm`/`k_norm` see only this rank's heads). `names=None`: every unsharded parameter."""

    names: tuple[str, ...] | None = None

    def __post_init__(self):  # a tuple keeps the style hashable (plans are cache keys)
        if self.names is not None:
            names = (self.names,) if isinstance(self.names, str) else tuple(self.names)
            object.__setattr__(self, "names", names)

    def effects(self, node, tp, sp):
        return [("grads",)]

    def check(self, node, tp, sp):
        params = node.mod._parameters
        wanted = self.names if self.names is not None else tuple(
            n for n, p in params.items() if p is not None)
        if not wanted or any(params.get(n) is None for n in wanted):
            raise SchedulingError(node.path, f"{self} needs parameters {list(wanted)} on "
                                  f"{type(node.mod).__name__}, which has "
                                  f"{[n for n, p in params.items() if p is not None]}.",
                                  "point the row at the module that owns the parameters.")

    def apply(self, node, tp, sp):
        node.reduce_param_grads(None if self.names is None else list(self.names))


def _has(mod: nn.Module, name: str) -> bool:
    return isinstance(getattr(mod, name, None), torch.Tensor)


def _is_conv1d(mod: nn.Module) -> bool:
    from ..sharding import _is_hf_conv1d

    return _is_hf_conv1d(mod)


def _check_split(node: Schedule, name: str, axis: int, tp: int, blocks: int, style) -> None:
    """`name` exists, is not sharded yet and its `axis` divides into tp * blocks pieces."""
    t = getattr(node.mod, name, None)
    if not isinstance(t, torch.Tensor):
        raise SchedulingError(node.path, f"{style} needs a tensor {name!r} on "
                              f"{type(node.mod).__name__}.", "point the row at a module with one "
                              "(a Linear or HF Conv1D for Column/Row).")
    if getattr(t, "_slapo_shard", None) is not None:
        raise SchedulingError(node.path, f"{style}: {name!r} is already sharded.",
                              "shard each tensor once: remove the row or the earlier shard.")
    if not -t.dim() <= axis < t.dim():
        raise SchedulingError(node.path, f"{style}: axis {axis} is out of range for {name!r} of "
                              f"shape {tuple(t.shape)}.", "fix the axis in the plan.")
    if t.shape[axis] % (tp * blocks):
        what = f"tp={tp}" + (f" x {blocks} blocks" if blocks > 1 else "")
        raise SchedulingError(node.path, f"{style} cannot split {name!r} of shape "
                              f"{tuple(t.shape)}: axis {axis} (size {t.shape[axis]}) is not "
                              f"divisible by {what}.", "choose a tp that divides the heads and "
                              "features.")


# ---- the degree against the model: the one check of tp against heads and widths ------------

def tp_divisibility(model: nn.Module, tp: int) -> list[str]:
    """The config sizes a tp-way head/feature split needs divisible, as "name=value" for each
    that is not (HF configs map `num_attention_heads` to each family's own name, e.g. GPT-2's
    `n_head`, T5's `num_heads`; `num_key_value_heads` is LLaMA's GQA; the MLP width is
    `intermediate_size`, GPT-2's `n_inner`, OPT's `ffn_dim`, T5's `d_ff`)."""
    cfg = getattr(model, "config", None)
    bad = []
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "n_inner",
                 "ffn_dim", "d_ff"):  # heads, GQA's KV heads, the MLP's sharded features
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value % tp:
            bad.append(f"{name}={value}")
    return bad


def _config_of(node: Schedule) -> tuple[Any, Schedule]:
    """The HF config governing `node` and the node holding it: the outermost one above it (the
    model a layer is in: what `apply` was called on), else the first one inside it (a copied
    block, as the cost model shards)."""
    found: tuple[Any, Schedule] | None = None
    at: Schedule | None = node
    while at is not None:
        if getattr(at.mod, "config", None) is not None:
            found = (at.mod.config, at)
        at = at.parent
    if found is not None:
        return found
    return next((m.config for m in node.mod.modules() if getattr(m, "config", None) is not None),
                None), node


def check_tp_heads(sch: Schedule, tp: int) -> None:
    """Raise before any change when the heads (or KV heads, or the MLP width) do not split over
    `tp` ranks: otherwise the sharded q/k/v reshape fails in the forward with a message naming
    neither. The one check of the tensor-parallel degree against a model (`TPPlan.validate`
    runs it for `apply`, `shard_block` for the cost model), naming the module whose config it
    read. Sizes alone can pass where heads do not (LLaMA GQA: 2 KV heads of 16 make 32 rows,
    which split 4 ways into half heads), so the config is read."""
    from types import SimpleNamespace

    config, owner = _config_of(sch)
    bad = tp_divisibility(SimpleNamespace(config=config), tp)
    if bad:
        raise SchedulingError(owner.path, f"tensor parallelism splits attention heads and MLP "
                              f"features over tp={tp} ranks, but {', '.join(bad)} is not "
                              f"divisible by {tp}.", "choose a tp that divides the number of "
                              "attention heads, of key/value heads and the MLP width.")


# ---- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPPlan:
    """A layer's tensor-parallel (and sequence-parallel) plan: (path, style) rows, applied in
    order. A path is relative to the layer ("" is the layer itself); a trailing "?" marks a row
    whose module only some variants have (T5 encoder blocks have no `EncDecAttention`, Qwen3 has
    `q_norm` and LLaMA does not): it is skipped where the module is missing, any other missing
    path is an error. A path may appear in several rows (T5's cross-attention q: `Column` and
    `ReduceInputGrad`)."""

    entries: tuple[tuple[str, Style], ...]

    def __post_init__(self):
        rows = tuple(tuple(e) for e in self.entries)
        for row in rows:
            if len(row) != 2 or not isinstance(row[0], str) or not isinstance(row[1], Style):
                raise SchedulingError("", f"TPPlan row {row!r} is not a (path, style) pair.",
                                      "write rows as ('attn.q_proj', Column()).")
        object.__setattr__(self, "entries", rows)

    def validate(self, layers: list[Schedule], tp: int,
                 sequence_parallel: bool = False) -> None:
        """Check the plan against a model before its first change: the degree against the
        model's heads, KV heads and MLP width (`check_tp_heads`: the one check of tp against a
        model), then every row of every layer (`resolve`). Mutates nothing."""
        if layers:
            check_tp_heads(layers[0], tp)
        for layer in layers:
            self.resolve(layer, tp, sequence_parallel)

    def apply(self, layer: Schedule, tp: int, sequence_parallel: bool = False) -> None:
        """Shard `layer` `tp` ways (sequence parallel if asked). Every row is resolved and
        checked first, so a bad plan or an indivisible size changes nothing."""
        rows = self.resolve(layer, tp, sequence_parallel)
        for node, style in rows:
            style.apply(node, tp, sequence_parallel)

    def resolve(self, layer: Schedule, tp: int,
                sequence_parallel: bool = False) -> list[tuple[Schedule, Style]]:
        """The (node, style) pairs this plan applies to `layer`, after checking all of them
        (paths, sizes, and that no tensor or sync is applied twice); mutates nothing."""
        if tp != layer.tp_size:
            raise SchedulingError(layer.path, f"the plan is applied for tp={tp}, but the "
                                  f"schedule's tensor-parallel group has {layer.tp_size} ranks.",
                                  "create the schedule on a group of that size.")
        from .lora import lora_style  # a PEFT LoRA layer at a row's path: base, A and B

        rows = [(self._node(layer, path, style), style) for path, style in self.entries]
        rows = [(n, lora_style(n, s)) for n, s in rows if n is not None]
        seen: dict[tuple, str] = {}
        for node, style in rows:
            style.check(node, tp, sequence_parallel)
            for effect in style.effects(node, tp, sequence_parallel):
                _claim(seen, node, effect, style)
        return rows

    @staticmethod
    def _node(layer: Schedule, path: str, style: Style) -> Schedule | None:
        rel = path[:-1] if path.endswith(OPTIONAL) else path
        if rel in layer:
            return layer[rel]
        if path.endswith(OPTIONAL):
            return None
        raise SchedulingError(layer.path, f"the tensor-parallel plan row ({path!r}, {style}) "
                              f"names a submodule this {type(layer.mod).__name__} does not have.",
                              f"fix the path, or mark it optional ('{path}{OPTIONAL}') if only "
                              "some variants of the layer have it.")

    def __str__(self) -> str:
        width = max((len(p) for p, _ in self.entries), default=4)
        lines = [f"  {p or '.':<{width}}  {s}" for p, s in self.entries]
        return "\n".join(["TPPlan (path relative to a layer -> style):", *lines])


def _claim(seen: dict, node: Schedule, effect: tuple, style: Style) -> None:
    """Refuse two rows that change the same thing, or a change the module already has."""
    key = (id(node.mod), *effect)
    if key in seen:
        raise SchedulingError(node.path, f"plan rows {seen[key]} and {style} both apply "
                              f"{effect} here.", "keep one of the two rows.")
    if effect[0] == "sync" and tuple(effect[1:]) in module_meta(node.mod).get("syncs", []):
        raise SchedulingError(node.path, f"{style}: sync{effect[1:]} was already applied to this "
                              "module.", "apply the plan once per layer.")
    seen[key] = str(style)


__all__ = ["Column", "DivideAttr", "EnterRegion", "ReduceInputGrad", "ReduceParamGrads", "Row",
           "ShardParam", "Style", "TPPlan"]
