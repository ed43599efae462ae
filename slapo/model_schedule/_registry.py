"""The family registry and `apply`, which composes the concerns in a visible order."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule, create_schedule
from . import _common
from . import context_parallel as _cp
from . import lora as _lora
from . import moe as _moe
from . import sequence_parallel as _sp
from .knobs import ScheduleKnobs, knob_fields
from .no_cache import training_without_cache


@dataclass
class Family:
    """How to schedule one architecture family.

    - `model_types`: HF `config.model_type` values it covers;
    - `layer_lists`: suffixes of the ModuleLists holding the transformer layers, in execution
      order (T5: encoder then decoder);
    - `tp_plan`: the tensor-parallel (and sequence-parallel) plan of one layer as data: an
      object with `validate(layers, tp, sequence_parallel)` (every check, no change) and
      `apply(layer: Schedule, tp: int, sequence_parallel: bool) -> None` (see
      `model_schedule.plan`; a plan written as code is such an object too); the cost model
      shards blocks with the same plan. None: the family is not tensor-parallel (`tp > 1` is
      refused before anything changes);
    - `mlp_paths`: paths (relative to a layer) of the MLP blocks, for `fuse`;
    - `sequence_plan`: where hidden states are split/gathered along the sequence, which norms and
      dropouts see sequence shards (None: `sequence_parallel=True` is rejected); the
      `tp_plan` then takes `sequence_parallel=True`;
    - `tp_rng`: modules (relative to a layer) whose random ops all sit inside a head- or
      feature-sharded region (attention-probability dropout, T5's FF dropout): under tp > 1
      they run in the per-rank RNG stream (`fork_rng`), as Megatron does, so the ranks' heads
      see different masks; everything else (residual, hidden, embedding dropout) keeps the
      default stream and identical masks;
    - `tp_rng_core`: attention modules that also hold a replicated dropout (GPT-2's
      `resid_dropout`): only their attention core is forked (a pass-through
      `_common.HFAttentionCore` is installed when no core replaced the model's own);
    - `matches(model) -> bool`: detection for models without an HF `config.model_type` (a
      torchvision ResNet is recognised by its module layout);
    - `schedule(sch, knobs) -> Schedule`: a family whose concerns are not the transformer
      ones (a CNN has no attention, vocabulary or sequence): `apply` validates the knob values
      with the schema, then hands the schedule and the `ScheduleKnobs` to it;
    - `moe`: a mixture-of-experts family's `moe.MoEPlan` (where a layer's experts are): on a
      mesh with ep > 1 `apply` spreads them over the "ep" ranks (None: ep > 1 is refused);
    - `context_parallel`: the attention module of a layer (relative path) that takes the
      context-parallel core on a mesh with cp > 1 (None: cp > 1 is refused, naming why:
      `model_schedule/context_parallel.py`).
    """

    name: str
    model_types: tuple[str, ...]
    layer_lists: tuple[str, ...]
    mlp_paths: tuple[str, ...] = ()
    sequence_plan: _sp.SequencePlan | None = None
    notes: str = ""
    extra: dict = field(default_factory=dict)
    tp_rng: tuple[str, ...] = ()
    tp_rng_core: tuple[str, ...] = ()
    tp_plan: Any = None
    matches: Callable[[nn.Module], bool] | None = None
    schedule: Callable[[Schedule, ScheduleKnobs], Schedule] | None = None
    moe: Any = None
    context_parallel: str | None = None

    def shard(self, layer: Schedule, tp: int, sequence_parallel: bool = False) -> None:
        """Shard one layer `tp` ways with this family's plan."""
        self.tp_plan.apply(layer, tp, sequence_parallel=sequence_parallel)


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def supported() -> dict[str, tuple[str, ...]]:
    """{family name: the HF model types it covers}."""
    return {f.name: f.model_types for f in _FAMILIES.values()}


def detect(model: nn.Module) -> Family:
    """A registered family covering `config.model_type` (or matching the modules), else one
    derived from the tensor-parallel plan the config declares (`hf_plan.declared_family`)."""
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    for fam in _FAMILIES.values():
        if model_type in fam.model_types:
            return _with_declared_tp_plan(fam, model)
    for fam in _FAMILIES.values():
        if model_type is None and fam.matches is not None and fam.matches(model):
            return fam
    from .hf_plan import declared_family  # after the hand-written families: they override
    if model_type is not None and (derived := declared_family(model)) is not None:
        return derived
    listing = "; ".join(f"{n}: {', '.join(t)}" for n, t in supported().items())
    raise SchedulingError("", f"no ready schedule for {type(model).__name__} "
                          f"(model_type={model_type!r}): no hand-written family covers it and "
                          "its config declares no base_model_tp_plan whose layers Slapo finds. "
                          f"Supported: {listing}.",
                          "write one with the primitives (see docs/model_schedule.md) and "
                          "register it with slapo.model_schedule.register_family(Family(...)).")


def _with_declared_tp_plan(family: Family, model: nn.Module) -> Family:
    """A hand-written family without a tensor-parallel plan (DeepSeek-V3: its MLA attention)
    takes the one derived from the model's declared plan, when that translates; the family's
    other fields (its MoE plan for expert parallelism) stay."""
    from .plan_supplements import declared_tp_plan

    declared = declared_tp_plan(model)
    if family.tp_plan is not None or declared is None:
        return family
    from .hf_plan import DeclaredPlan, derive_plan, layer_lists

    lists = tuple(p for p in layer_lists(model, declared)
                  if p.split(".")[-1] in family.layer_lists or p in family.layer_lists)
    plan = derive_plan(model, lists) if lists else None
    return dataclasses.replace(family, tp_plan=plan) if isinstance(plan, DeclaredPlan) \
        else family


def layers_of(sch: Schedule, family: Family) -> list[Schedule]:
    out = []
    for suffix in family.layer_lists:
        path = _common.require_path(sch, suffix, family.name)
        out += list(sch[path])
    return out


def apply(model_or_sch: nn.Module | Schedule, *, group=None, mesh=None,
          **knobs: Any) -> Schedule:
    """Schedule a Hugging Face model of a supported family (see the package docstring), or a
    torchvision-layout ResNet/WideResNet (detected by its modules; `tp`, `ckpt_ratio`,
    `ckpt_policy`, `pp_stages` apply, the transformer knobs are refused: `wideresnet.py`).

    Every knob is a field of `model_schedule.knobs.ScheduleKnobs`, which declares its default
    and documents it once (`help(ScheduleKnobs)`; `apply`'s signature is generated from it) and
    validates the values; `group` / `mesh` say where the schedule's tensor-parallel group comes
    from. `attention=None` keeps the model's own attention;
    "eager" forces HF's eager attention (one meaning in train, tune and the progressive demo).

    What the knobs' help does not say: with `compile_blocks`, calls that pass no `use_cache`
    run without a KV cache (a cache makes each layer a separate graph), as with checkpointing,
    and the model's config is not changed (`no_cache.training_without_cache`); with `kernels` and
    `fuse`, the LLaMA family's MLPs take the SwiGLU kernel instead of `fuse`'s compiled SwiGLU.
    """
    sch = model_or_sch if isinstance(model_or_sch, Schedule) else \
        create_schedule(model_or_sch, group=group, mesh=mesh)
    inner = _lora.model_inside(sch)  # a PEFT model schedules like the model it wraps
    family = detect(inner.mod)
    # every check first: a rejected call leaves the model and the schedule's history untouched
    checked = ScheduleKnobs.from_given(knobs).validate(sch.path)
    if family.schedule is not None:  # a non-transformer family (WideResNet) owns its concerns
        family.schedule(inner, checked)
    else:
        _apply_knobs(inner, family, **checked.as_kwargs())
    return sch


def _knob_signature() -> inspect.Signature:
    """`apply`'s signature for `help()`, editors and `inspect`: the schema's knobs as keyword
    parameters with the schema's defaults (declared once, in `knobs.py`)."""
    head = [inspect.Parameter("model_or_sch", inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("group", inspect.Parameter.KEYWORD_ONLY, default=None),
            inspect.Parameter("mesh", inspect.Parameter.KEYWORD_ONLY, default=None)]
    knobs = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=f.type) for f in knob_fields()]
    return inspect.Signature(head + knobs, return_annotation="Schedule")


apply.__signature__ = _knob_signature()


def _apply_knobs(sch: Schedule, family: Family, *, tp: int | None, ckpt_ratio: float,
                 ckpt_policy: str, offload_ratio: float, attention: str | None, fuse: bool, fuse_compiler: str,
                 tempo: bool, pp_stages: int, sequence_parallel: bool, vocab_parallel: bool,
                 compile_blocks: bool | str, fused_loss: bool, kernels: bool,
                 cp_attention: str) -> Schedule:
    """`apply` once the knobs passed the schema (every value given: the defaults are the
    schema's): the checks that need the model, then the concerns in a visible order."""
    ws = sch.tp_size
    tp = ws if tp is None else tp
    _validate(sch, family, tp, ws, sequence_parallel, pp_stages, vocab_parallel, fused_loss)
    _lora.check_knobs(sch, tp, fuse, kernels, vocab_parallel)
    ep = _moe.check_expert_parallel(sch, family, layers_of(sch, family))
    if ep is not None:  # the experts are ep's: the tp plan leaves them whole
        family = _moe.without_experts(family)
    _validate_plan(sch, family, tp, attention, fuse, kernels, pp_stages,
                   sequence_parallel and tp > 1)
    cp = _cp.check_context_parallel(sch, family, layers_of(sch, family), attention=attention,
                                    tempo=tempo, fused_loss=fused_loss,
                                    pp_stages=pp_stages, cp_attention=cp_attention, tp=tp)
    if attention is not None:
        _set_attention(sch, attention)
    sp = sequence_parallel and tp > 1  # one rank: nothing to split, SP is the identity
    if tp > 1:
        for layer in layers_of(sch, family):
            family.shard(layer, tp, sequence_parallel=sp)
        if sp:
            _sp.split_and_gather(sch, family, vocab_parallel)
        elif vocab_parallel:
            _common.vocab_parallel(sch)
    if ep is not None:
        _moe.expert_parallel(family, layers_of(sch, family), ep, root=sch.mod)
    if cp is not None:
        _cp.context_parallel(sch, family, layers_of(sch, family), cp, cp_attention)
    if fuse and not (kernels and _kernel_fuses_mlp(family)):
        _fuse_mlps(sch, family, fuse_compiler)
    if kernels:
        from .kernels import apply_kernels

        apply_kernels(sch, family.name)
    if tempo:
        from ..op import apply_tempo

        if compile_blocks:
            warnings.warn("tempo=True inside compiled blocks: Tempo's LayerNorm is now traced "
                          "so inductor fuses it, the GELU keeps a code-byte custom op; this path "
                          "saves more than the compiled plain layer (CPU-measured) but its GPU "
                          "time is not yet measured (the earlier opaque path: +32% on one H100 "
                          "BERT-large layer; benchmarks/tempo_gpu.py, docs/tempo.md). Selective "
                          "checkpointing trades memory for time there.", stacklevel=3)

        apply_tempo(sch, attention=attention in (None, "eager"))  # an explicit core wins;
        # fused activations are already inside compiled regions, so Tempo takes the rest
    layers = layers_of(sch, family)
    if sp:  # after fuse/tempo, which may replace the norms and dropouts
        _sp.replicated_on_shards(sch, family, layers)
    if tp > 1:  # after fuse/tempo too: a core Tempo installed is the one to fork
        for layer in layers:
            for rel in family.tp_rng_core:  # pass-through cores where only the core may fork
                if rel in layer:
                    _common.install_hf_core(layer[rel])
            _common.fork_sharded_rng(layer, family.tp_rng, family.tp_rng_core)
    n_ckpt = _common.checkpoint_layers(layers, ckpt_ratio,
                                       policy=None if ckpt_policy == "full" else ckpt_policy)
    if n_ckpt:
        training_without_cache(sch)  # recomputation would append to a KV cache twice
    _common.offload_layers(layers, offload_ratio, after=n_ckpt)
    if fused_loss:
        from .fused_loss import fuse_loss

        fuse_loss(sch)
    if compile_blocks:
        compile_layers(sch, layers, compile_blocks)
    if pp_stages > 1:
        _cut_pipeline(sch, layers, pp_stages)
    return sch


def _validate_plan(sch, family, tp, attention, fuse, kernels, pp_stages, sp) -> None:
    """The checks that need the model (its layers, heads, plans), before any mutation."""
    layers = layers_of(sch, family)  # a missing layer list fails here, before anything changes
    if tp > 1:
        if family.tp_plan is None:
            raise SchedulingError(sch.path, f"family {family.name!r} has no tensor-parallel "
                                  f"plan, so tp={tp} cannot shard it.",
                                  "use tp=1, or give the Family a tp_plan=TPPlan(...) "
                                  "(docs/model_schedule.md).")
        family.tp_plan.validate(layers, tp, sequence_parallel=sp)  # the heads, every row
    if attention == "flash":
        from ..op import flash_attn_available

        if not flash_attn_available():
            raise SchedulingError(sch.path, "attention='flash' needs the flash-attn package and "
                                  "a CUDA GPU.", "use attention='sdpa' (PyTorch's fused kernels).")
    if attention == "eager":
        _check_eager_settable(sch)
    if attention in ("sdpa", "flash"):
        _check_core_computes(sch, attention)
    if fuse:
        _check_fusable(sch, family)
    if kernels:
        from .kernels import plan_targets

        plan_targets(sch, family.name)  # mutates nothing; raises for an unknown family
    if pp_stages > 1:
        _check_pipeline(sch, layers, pp_stages)


def _check_pipeline(sch: Schedule, layers: list[Schedule], stages: int) -> None:
    from ..runtime.partition import check_partitionable

    check_partitionable(sch.mod)  # the model kind `build` could not partition, before any cut
    if len(layers) < stages:
        raise SchedulingError(sch.path, f"{len(layers)} layers cannot make {stages} stages.",
                              "use fewer pipeline stages.")


def _validate(sch, family, tp, ws, sequence_parallel, pp_stages, vocab_parallel,
              fused_loss) -> None:
    """The checks that need the schedule's group and the family (values: `ScheduleKnobs`)."""
    if tp not in (1, ws):
        raise SchedulingError(sch.path, f"tp={tp} but the schedule's tensor-parallel group has "
                              f"{ws} rank(s).", "create the schedule on a group (or mesh 'tp' "
                              "dimension) of that size, or pass tp=None.")
    if sequence_parallel:
        _sp.check_supported(sch, family, pp_stages,
                            [f.name for f in _FAMILIES.values() if f.sequence_plan is not None])
    if fused_loss:
        if vocab_parallel and tp > 1:  # tp=None resolved to the group: checked again here
            raise SchedulingError(sch.path, "fused_loss needs an unsharded LM head, and "
                                  "vocab_parallel=True shards it under tp > 1.",
                                  "pass vocab_parallel=False with fused_loss=True.")
        from .fused_loss import check_fusable

        check_fusable(sch)


def compile_layers(sch: Schedule, layers: list[Schedule], compile_blocks: bool | Any) -> None:
    """Regional compilation (the `compile_blocks` knob: True is inductor, else the backend):
    every layer (a transformer layer, a ResNet block) with the same options, so identical
    layers share one graph. HF layers read `layer_idx` only to fill a KV cache; without a
    cache they are identical to dynamo, so training turns the cache off (as HF's gradient
    checkpointing does)."""
    backend = "inductor" if compile_blocks is True else compile_blocks
    training_without_cache(sch)
    for layer in layers:
        layer.compile(backend=backend)


def _set_attention(sch: Schedule, attention: str) -> None:
    """"eager": HF's eager attention (the model's config says so, every attention module reads
    it); "sdpa" / "flash": Slapo's attention core in every HF attention module."""
    if attention == "eager":
        configured = getattr(getattr(sch.mod, "config", None), "_attn_implementation", None)
        if configured not in (None, "eager"):
            warnings.warn(f"attention='eager' replaces the model's configured "
                          f"{configured!r} attention with HF's eager one, and the two differ on "
                          "a query that sees no key (left padding under a causal mask): eager "
                          "gives it uniform weights over every key, later ones too, SDPA zeros. "
                          "A left-padded batch whose labels supervise the first real token "
                          "from a padding position then has another loss (by ~1e-3 in the "
                          "tests' models); leave attention unset, or pass 'sdpa', to compute "
                          "what the model as configured computes (docs/ops.md).", stacklevel=4)
        _force_hf_eager(sch.mod)
        return
    from ..op import SDPAttention, is_hf_attention, use_attention_core

    swapped = 0
    for _, node in list(sch.named_schedules()):
        if node.parent is not None and is_hf_attention(node.mod):
            node.replace(use_attention_core(node.mod, SDPAttention(use_flash=attention ==
                                                                   "flash"), node.path))
            swapped += 1
    if not swapped:  # e.g. GPT-Neo: its attention computes scores itself, outside HF's registry
        warnings.warn(f"attention={attention!r} changed nothing in {type(sch.mod).__name__}: "
                      "none of its attention modules calls HF's attention-function registry, "
                      "where Slapo's core goes, so the model keeps its own attention.",
                      stacklevel=4)


def _force_hf_eager(model: nn.Module) -> None:
    """`set_attn_implementation("eager")` where HF has it (sub-configs too), else the config
    attribute HF reads (older transformers, or models that cannot switch dynamically)."""
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "_attn_implementation", "eager") != "eager":
        cfg._attn_implementation = "eager"


def _check_eager_settable(sch: Schedule) -> None:
    """attention="eager" means eager everywhere; attention modules that already run Slapo
    cores keep their own config copy (`op.use_attention_core`), which the model-level switch
    does not reach: rejected before any mutation rather than half applied."""
    from ..op.hf_attention import SLAPO_ATTN

    for name, mod in sch.mod.named_modules():
        if getattr(getattr(mod, "config", None), "_attn_implementation", None) == SLAPO_ATTN:
            raise SchedulingError(sch.path, f"attention='eager' on a model whose attention "
                                  f"modules already run Slapo attention cores ({name}).",
                                  "schedule a fresh model, or leave attention unset to keep "
                                  "the installed cores.")


def _check_core_computes(sch: Schedule, attention: str) -> None:
    """Slapo's SDPA core computes softmax(q k^T * scale + mask) v: an attention module that
    passes its attention function more (Gemma 2's logit soft-cap, GPT-OSS's sinks, a sparse
    indexer's selection: `op.hf_attention.uncomputed_inputs`) would lose it. Refused for the
    whole model before any module is swapped (the core would raise at the first forward)."""
    from ..op import is_hf_attention
    from ..op.hf_attention import uncomputed_inputs

    for name, mod in sch.mod.named_modules():
        dropped = uncomputed_inputs(mod) if is_hf_attention(mod) else []
        if dropped:
            model = type(sch.mod).__name__
            kind = getattr(getattr(sch.mod, "config", None), "model_type", None)
            raise SchedulingError(sch.path, f"attention={attention!r} on {model} "
                                  f"(model_type={kind!r}): its attention {name} "
                                  f"({type(mod).__name__}) passes {', '.join(dropped)} to its "
                                  "attention function, which Slapo's SDPA core does not "
                                  "compute: the model would attend differently.",
                                  "leave attention unset (the model's own attention computes "
                                  "it), or pass attention='eager' for HF's eager attention.")


def _check_fusable(sch: Schedule, family: Family) -> None:
    """Every MLP checked before the first is traced: a rejection mutates nothing."""
    from .fusion import PLANS, unfusable

    if family.name not in PLANS or not family.mlp_paths:
        raise SchedulingError(sch.path, f"fuse=True has no fusion plan for the {family.name} "
                              "family.", f"pass fuse=False (plans: {', '.join(sorted(PLANS))}).")
    for mlp in _mlps(sch, family):
        reason = unfusable(mlp, family.name)
        if reason is not None:
            raise SchedulingError(sch.path, f"fuse=True: {reason}.",
                                  f"pass fuse=False (plans: {', '.join(sorted(PLANS))}).")


def _mlps(sch: Schedule, family: Family) -> list[Schedule]:
    return [layer[rel] for layer in layers_of(sch, family) for rel in family.mlp_paths
            if rel in layer]


def _kernel_fuses_mlp(family: Family) -> bool:
    """With `kernels=True`, the LLaMA family's whole gated MLP becomes `FusedLlamaMLP` (its
    SwiGLU kernel), which supersedes `fuse`'s compiler-fused `silu(gate) * up` of the same MLP;
    both at once would trace the MLP and then find no SiLU module left to swap."""
    from .kernels import PLANS

    return "swiglu_mlp" in PLANS.get(family.name, ())


def _fuse_mlps(sch: Schedule, family: Family, compiler: str) -> None:
    from .fusion import fuse_mlp

    _check_fusable(sch, family)
    for mlp in _mlps(sch, family):
        fuse_mlp(mlp, family.name, compiler)


def _cut_pipeline(sch: Schedule, layers: list[Schedule], stages: int) -> None:
    """Cut `stages` stages (checked by `_check_pipeline` before any change)."""
    per = len(layers) / stages
    for s in range(1, stages):
        layers[round(s * per) - 1].cut_pipeline_stage()
