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

# Knobs of a config that go to model_schedule.apply (everything else is a training setting).
SCHEDULE_KNOBS = ("attention", "ckpt_ratio", "fuse", "tempo")


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


def make_space(model: str, args: SpaceArgs | None = None) -> Space:
    """The ready space of ``model`` (a key of :data:`SPACES`)."""
    if model not in SPACES:
        raise ValueError(f"no tuning space for model {model!r}; spaces exist for: "
                         f"{', '.join(sorted(SPACES))}. Fix: write an update_space(args, space) "
                         "function and add it to slapo.tune.spaces.SPACES.")
    return Space.from_function(SPACES[model], args or SpaceArgs())


def schedule_knobs(config: Config) -> dict[str, Any]:
    """The ``model_schedule.apply`` keyword arguments of a config (defaults for absent knobs)."""
    return {
        "attention": config.get("attention", "eager"),
        "ckpt_ratio": float(config.get("ckpt_ratio", 0.0)),
        "fuse": bool(config.get("fuse", False)),
        "tempo": bool(config.get("tempo", False)),
    }
