"""Ready search spaces for the model schedules, written as Slapo's `update_space(args, space)`.

Every knob name, default candidate list and baseline comes from the schedule-knob schema
(`slapo.model_schedule.knobs.ScheduleKnobs`): a space declares the batch size (and
`slapo.build`'s `mixed_precision`) plus fields of the schema, so a config from the space is
what a trial passes to `model_schedule.apply` (see `schedule_knobs`). Candidate lists come
from `args` so the CLI and the tests can shrink a space without writing a new function;
`SpaceArgs` holds the defaults (the schema's tuning candidates), and `args.extra` adds
any other knob of the schema as a symbol (`slapo tune --knob NAME=V1,V2`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..model_schedule import knobs as _schema
from .space import Config, Space

__all__ = ["BUILD_KNOBS", "GPUModelSpec", "GPUSpaceArgs", "GPU_MODELS", "SPACES", "SpaceArgs",
           "add_extra_knobs", "apply_knobs", "build_knobs", "cpu_space_knobs", "gpu_space",
           "make_space", "parse_knob_option", "schedule_knobs", "update_space_gpt2",
           "update_space_gpu"]

# Knobs of slapo.build (a config's "mixed_precision" is build's argument, not apply's).
BUILD_KNOBS = ("mixed_precision",)


def apply_knobs() -> dict[str, Any]:
    """{name: default} of the schedule knobs (`model_schedule.apply`'s keywords), from the
    schema: the one declaration every space's knob names come from."""
    return {f.name: f.default for f in _schema.knob_fields()}


def build_knobs(config: Config) -> dict[str, Any]:
    """The `slapo.build` keyword arguments of a config: its "mixed_precision" symbol (the
    space's name of build's `precision`, kept for the records databases hold) as `precision`."""
    return {"precision": config.get("mixed_precision", "fp32")}


def _tune(name: str) -> Callable[[], tuple]:
    return lambda: tuple(_schema.tune_candidates(name))


@dataclass
class SpaceArgs:
    """Candidate values of each knob (defaults: the schema's tuning candidates). The defaults
    give 3 x 2 x 3 x 2 x 2 = 72 configs. `extra`: (knob, candidates) pairs of other schema
    knobs to search too."""

    batch_sizes: tuple[int, ...] = (2, 4, 8)
    attention: tuple[str, ...] = field(default_factory=_tune("attention"))
    ckpt_ratios: tuple[float, ...] = field(default_factory=_tune("ckpt_ratio"))
    fuse: tuple[bool, ...] = field(default_factory=_tune("fuse"))
    tempo: tuple[bool, ...] = field(default_factory=_tune("tempo"))
    num_layers: int = 2
    extra: tuple[tuple[str, tuple], ...] = ()


def _ckpt_candidates(args: SpaceArgs) -> list[float]:
    """Ratios that checkpoint distinct layer counts (0.25 and 0.5 of 2 layers are the same)."""
    seen: dict[int, float] = {}
    for r in args.ckpt_ratios:
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"ckpt ratio {r} is not in [0, 1].")
        seen.setdefault(int(r * args.num_layers + 0.5), float(r))  # apply() rounds half up
    return sorted(seen.values())


def update_space_gpt2(args: SpaceArgs, space: Space) -> Space:
    """GPT-2: batch size x attention core x checkpoint ratio x fused bias+GELU x Tempo.

    Every combination is legal for GPT-2, so there are no constraints; ratios that would
    checkpoint the same number of layers are merged so no config is measured twice under two
    names.
    """
    space.create_symbol("batch_size", list(args.batch_sizes))
    space.create_symbol("attention", list(args.attention))
    space.create_symbol("ckpt_ratio", _ckpt_candidates(args))
    space.create_symbol("fuse", list(args.fuse))
    space.create_symbol("tempo", list(args.tempo))
    return add_extra_knobs(space, args.extra)


SPACES: dict[str, Callable[[Any, Space], Space]] = {"gpt2": update_space_gpt2}


# ------------------------------------------------------------------------------------------------
# GPU space
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUModelSpec:
    """An HF model as `benchmarks/gpu_train.py` builds it: config and model class names of
    `transformers`, config keywords, and the benchmark's batch and sequence length."""

    name: str
    config_class: str
    model_class: str
    kwargs: dict
    batch: int
    seq: int

    @property
    def model_type(self) -> str:
        return {"GPT2Config": "gpt2", "LlamaConfig": "llama", "BertConfig": "bert"}.get(
            self.config_class, self.config_class.removesuffix("Config").lower())


# The three models of benchmarks/gpu_train.py (tests/test_tune_gpu.py checks they are equal).
GPU_MODELS = {
    "gpt2-medium": GPUModelSpec("gpt2-medium", "GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024), 16, 1024),
    "llama-1b": GPUModelSpec("llama-1b", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=32000, max_position_embeddings=2048,
        tie_word_embeddings=False), 8, 2048),
    "bert-large": GPUModelSpec("bert-large", "BertConfig", "BertForMaskedLM", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
        vocab_size=30522, max_position_embeddings=512), 32, 512),
}


@dataclass
class GPUSpaceArgs:
    """Candidates of the GPU space. `fits(config)` (e.g. the cost model's predicted memory
    under the cap) prunes batch sizes before anything runs; None keeps every batch."""

    model_class: str = "LlamaForCausalLM"
    model_type: str = "llama"
    batch_sizes: tuple[int, ...] = (4, 8, 16)
    mixed_precision: tuple[str, ...] = ("fp32", "bf16")  # of runtime.precision.PRECISIONS
    attention: tuple[str, ...] = ("sdpa",)
    ckpt_ratios: tuple[float, ...] = field(default_factory=_tune("ckpt_ratio"))
    ckpt_policies: tuple[str, ...] = field(default_factory=_tune("ckpt_policy"))
    offload_ratios: tuple[float, ...] = (0.0,)  # (0.0,): not searched (e.g. 0, 0.25, 0.5)
    num_layers: int = 16
    fits: Callable[[Config], bool] | None = None
    extra: tuple[tuple[str, tuple], ...] = ()


def _has_loss_plan(model_class: str) -> bool:
    from ..model_schedule.fused_loss import PLANS

    return model_class in PLANS


def _has_kernels(model_type: str) -> bool:
    """`kernels` is offered when Slapo has kernels for the model type's family (Mistral's and
    Qwen's are LLaMA's, mT5's T5's)."""
    from ..model_schedule import supported
    from ..model_schedule.kernels import PLANS

    return any(model_type in types for name, types in supported().items() if name in PLANS)


def _offload_candidates(args: GPUSpaceArgs, ckpt_ratio: float) -> list[float]:
    """Offload ratios that fit beside `ckpt_ratio` (the knob schema's rule: ckpt_ratio +
    offload_ratio <= 1, a layer is recomputed or offloaded) and offload distinct layer counts:
    `apply` offloads round-half-up(ratio * L) layers after the checkpointed ones, at most the
    layers left."""
    left = args.num_layers - int(ckpt_ratio * args.num_layers + 0.5)
    seen: dict[int, float] = {}
    for r in sorted(args.offload_ratios):
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"offload ratio {r} is not in [0, 1].")
        if ckpt_ratio + r <= 1.0 + 1e-9:
            seen.setdefault(min(int(r * args.num_layers + 0.5), left), float(r))
    return list(seen.values())


def _within_layers(config: Config) -> bool:
    return config.get("ckpt_ratio", 0.0) + config.get("offload_ratio", 0.0) <= 1.0 + 1e-9


def update_space_gpu(args: GPUSpaceArgs, space: Space) -> Space:
    """One GPU: precision x compiled layers x fused loss x kernels x checkpointing x offload x
    attention x batch. Names are `model_schedule.apply`'s (and build's `mixed_precision`: "fp8"
    is bf16 with torchao's FP8 GEMMs, which the trials' `build` and the cost model's fake step
    install).

    `ckpt_policy` exists only when some layer is checkpointed; `offload_ratio` only when
    `args.offload_ratios` offers a ratio above 0 and some fits beside the checkpoint ratio
    (recompute the first layers, offload the next, keep the rest); `fused_loss` and `kernels`
    only where the family has a plan (otherwise apply would refuse the config).
    """
    space.create_symbol("mixed_precision", list(args.mixed_precision))
    space.create_symbol("attention", list(args.attention))
    space.create_symbol("compile_blocks", [False, True])
    space.create_symbol("fused_loss", [False, True] if _has_loss_plan(args.model_class)
                        else [False])
    if _has_kernels(args.model_type):
        space.create_symbol("kernels", [False, True])
    space.create_symbol("ckpt_ratio", _ckpt_candidates(SpaceArgs(
        ckpt_ratios=args.ckpt_ratios, num_layers=args.num_layers)))
    space.create_symbol("ckpt_policy", list(args.ckpt_policies),
                        condition=lambda c: c["ckpt_ratio"] > 0)
    if any(r > 0 for r in args.offload_ratios):
        space.create_symbol("offload_ratio", lambda c: _offload_candidates(args, c["ckpt_ratio"]),
                            condition=lambda c: bool(_offload_candidates(args, c["ckpt_ratio"])))
    space.create_symbol("batch_size", list(args.batch_sizes))
    add_extra_knobs(space, args.extra)
    space.add_constraint(_within_layers, "ckpt_ratio + offload_ratio <= 1")
    if args.fits is not None:
        space.add_constraint(args.fits, "fits the memory cap (cost model)")
    return space


def gpu_space(spec: GPUModelSpec, args: GPUSpaceArgs | None = None) -> Space:
    """The GPU space of one model (`GPU_MODELS`), its family's plans filled in."""
    from dataclasses import replace

    args = args or GPUSpaceArgs()
    args = replace(args, model_class=spec.model_class, model_type=spec.model_type,
                   num_layers=_num_layers(spec))
    return Space.from_function(update_space_gpu, args)


def _num_layers(spec: GPUModelSpec) -> int:
    kw = spec.kwargs
    return int(kw.get("num_hidden_layers", kw.get("n_layer", 1)))


def make_space(model: str, args: SpaceArgs | None = None) -> Space:
    """The ready space of `model` (a key of `SPACES`)."""
    if model not in SPACES:
        raise ValueError(f"no tuning space for model {model!r}; spaces exist for: "
                         f"{', '.join(sorted(SPACES))}. Fix: write an update_space(args, space) "
                         "function and add it to slapo.tune.model_spaces.SPACES.")
    return Space.from_function(SPACES[model], args or SpaceArgs())


def cpu_space_knobs() -> tuple[str, ...]:
    """The schedule knobs the CPU space searches (its symbols that are schema fields)."""
    names = set(_schema.names())
    return tuple(n for n in make_space("gpt2").names() if n in names)


def schedule_knobs(config: Config) -> dict[str, Any]:
    """The `model_schedule.apply` keyword arguments of a config: the CPU space's knobs (at
    their tuning baseline when absent: e.g. attention "eager", the trials' HF eager model) and
    every other schema knob the config names."""
    known = set(_schema.names())
    out = {k: config.get(k, _schema.baseline(k)) for k in cpu_space_knobs()}
    out.update({k: v for k, v in config.items() if k in known})
    out["ckpt_ratio"] = float(out["ckpt_ratio"])
    out["fuse"], out["tempo"] = bool(out["fuse"]), bool(out["tempo"])
    return out


def parse_knob_option(text: str) -> tuple[str, tuple]:
    """`NAME=V1,V2` (`slapo tune --knob`) as (knob, candidates), values parsed and checked
    by the schema; raises ValueError naming the knob and what it accepts."""
    name, sep, values = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not values.strip():
        raise ValueError(f"--knob {text!r}: write NAME=V1,V2 (e.g. kernels=false,true)")
    if name not in _schema.names():
        raise ValueError(f"--knob {text!r}: {name!r} is no schedule knob; knobs: "
                         f"{', '.join(_schema.names())}")
    cands = tuple(_schema.parse_value(name, v) for v in values.split(",") if v.strip())
    for v in cands:
        try:
            _schema.ScheduleKnobs.from_given({name: v}).validate()
        except _schema.KnobError as e:
            raise ValueError(f"--knob {text!r}: {e.problem} Fix: {e.fix}") from None
    return name, cands


def add_extra_knobs(space: Space, extra: tuple[tuple[str, tuple], ...]) -> Space:
    """Add each (knob, candidates) as a symbol; a knob the space already searches is an error
    (its own option sets its candidates)."""
    have = set(space.symbols)  # declared so far in this pass of the space program
    for name, cands in extra:
        if name in have:
            raise ValueError(f"the space already searches {name!r}; set its candidates with its "
                             "own option instead of --knob")
        if name not in _schema.names():
            raise ValueError(f"{name!r} is no schedule knob; knobs: {', '.join(_schema.names())}")
        space.create_symbol(name, list(cands))
    return space
