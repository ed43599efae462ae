"""Ready search spaces for the model schedules, written as Slapo's ``update_space(args, space)``.

Each space declares exactly the knobs that :func:`slapo.model_schedule.apply` takes plus the
batch size, so a config from the space is what a trial passes to ``apply`` (see
:func:`schedule_knobs`). Candidate lists come from ``args`` so the CLI and the tests can shrink
a space without writing a new function; :class:`SpaceArgs` holds the defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .space import Config, Space

# The CPU space's knobs; schedule_knobs fills in apply's defaults for them. Every other
# keyword of model_schedule.apply that a config names is passed on too (see apply_knobs).
SCHEDULE_KNOBS = ("attention", "ckpt_ratio", "fuse", "tempo")
# Knobs of slapo.build (a config's "mixed_precision" is build's argument, not apply's).
BUILD_KNOBS = ("mixed_precision",)


def apply_knobs() -> dict[str, Any]:
    """{name: default} of ``model_schedule.apply``'s keyword-only knobs: the one schema every
    space's knob names come from (a knob apply does not take, e.g. ``kernels`` on an older
    checkout, is simply absent)."""
    import inspect

    from .. import model_schedule

    sig = inspect.signature(model_schedule.apply)
    return {n: p.default for n, p in sig.parameters.items() if p.kind is p.KEYWORD_ONLY}


def build_knobs(config: Config) -> dict[str, Any]:
    """The ``slapo.build`` keyword arguments of a config ("fp32" is build's None)."""
    prec = config.get("mixed_precision", "fp32")
    return {"mixed_precision": None if prec in (None, "fp32") else prec}


@dataclass
class SpaceArgs:
    """Candidate values of each knob. The defaults give 3 x 2 x 3 x 2 x 2 = 72 configs."""

    batch_sizes: tuple[int, ...] = (2, 4, 8)
    attention: tuple[str, ...] = ("eager", "sdpa")
    ckpt_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    fuse: tuple[bool, ...] = (False, True)
    tempo: tuple[bool, ...] = (False, True)
    num_layers: int = 2


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
    return space


SPACES: dict[str, Callable[[Any, Space], Space]] = {"gpt2": update_space_gpt2}


# ------------------------------------------------------------------------------------------------
# GPU space
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUModelSpec:
    """An HF model as ``benchmarks/gpu_train.py`` builds it: config and model class names of
    ``transformers``, config keywords, and the benchmark's batch and sequence length."""

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
    """Candidates of the GPU space. ``fits(config)`` (e.g. the cost model's predicted memory
    under the cap) prunes batch sizes before anything runs; None keeps every batch."""

    model_class: str = "LlamaForCausalLM"
    model_type: str = "llama"
    batch_sizes: tuple[int, ...] = (4, 8, 16)
    mixed_precision: tuple[str, ...] = ("fp32", "bf16")
    attention: tuple[str, ...] = ("sdpa",)
    ckpt_ratios: tuple[float, ...] = (0.0, 0.5, 1.0)
    ckpt_policies: tuple[str, ...] = ("full", "selective")
    num_layers: int = 16
    fits: Callable[[Config], bool] | None = None


def _has_loss_plan(model_class: str) -> bool:
    from ..model_schedule.fused_loss import PLANS

    return model_class in PLANS


def _has_kernels(model_type: str) -> bool:
    """`kernels` is offered when apply takes it and Slapo has kernels for the family."""
    if "kernels" not in apply_knobs():
        return False
    try:
        from ..model_schedule.kernels import PLANS
    except ImportError:
        return False
    return model_type in PLANS


def update_space_gpu(args: GPUSpaceArgs, space: Space) -> Space:
    """One GPU: precision x compiled layers x fused loss x kernels x checkpointing x attention x
    batch. Names are ``model_schedule.apply``'s (and build's ``mixed_precision``).

    ``ckpt_policy`` exists only when some layer is checkpointed; ``fused_loss`` and ``kernels``
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
    space.create_symbol("batch_size", list(args.batch_sizes))
    if args.fits is not None:
        space.add_constraint(args.fits, "fits the memory cap (cost model)")
    return space


def gpu_space(spec: GPUModelSpec, args: GPUSpaceArgs | None = None) -> Space:
    """The GPU space of one model (:data:`GPU_MODELS`), its family's plans filled in."""
    from dataclasses import replace

    args = args or GPUSpaceArgs()
    args = replace(args, model_class=spec.model_class, model_type=spec.model_type,
                   num_layers=_num_layers(spec))
    return Space.from_function(update_space_gpu, args)


def _num_layers(spec: GPUModelSpec) -> int:
    kw = spec.kwargs
    return int(kw.get("num_hidden_layers", kw.get("n_layer", 1)))


def make_space(model: str, args: SpaceArgs | None = None) -> Space:
    """The ready space of ``model`` (a key of :data:`SPACES`)."""
    if model not in SPACES:
        raise ValueError(f"no tuning space for model {model!r}; spaces exist for: "
                         f"{', '.join(sorted(SPACES))}. Fix: write an update_space(args, space) "
                         "function and add it to slapo.tune.spaces.SPACES.")
    return Space.from_function(SPACES[model], args or SpaceArgs())


def schedule_knobs(config: Config) -> dict[str, Any]:
    """The ``model_schedule.apply`` keyword arguments of a config: the CPU space's knobs (with
    apply's defaults when absent) and every other apply knob the config names."""
    knobs = apply_knobs()
    out = {k: config.get(k, knobs[k]) for k in SCHEDULE_KNOBS}
    out.update({k: v for k, v in config.items() if k in knobs})
    out["ckpt_ratio"] = float(out["ckpt_ratio"])
    out["fuse"], out["tempo"] = bool(out["fuse"]), bool(out["tempo"])
    return out
