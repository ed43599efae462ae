"""`TrainConfig`: every option of `slapo train`, in its section, read flat or by section.

The config is nested, as torchtitan's `JobConfig` is: one dataclass per concern (`ArchOptions`,
`CorpusOptions`, `TrainingOptions`, `OptimizerOptions`, `ParallelismOptions`,
`CheckpointOptions`, `LoggingOptions`) and the schedule section, which *is*
`model_schedule.knobs.ScheduleKnobs` (the knob schema, not a copy). Each field's
`metadata["help"]` is its only help text: the `--flags` and `--help` (`slapo.cli`), the TOML keys
and `slapo tune`'s knob spaces derive from the fields. An option's name is unique across the
sections, so it is also its flag (`--seq-len`), its TOML key (`seq-len`/`seq_len`, at top level
or in any table, e.g. `[training]`), its key in a checkpoint's saved config (`options()`), and
its flat attribute: `cfg.seq_len` reads `cfg.training.seq_len`, `cfg.tp` reads
`cfg.schedule.tp`, and `TrainConfig(model="gpt2", tp=2)` fills the sections.

A schedule knob can be *not given* (`--tp` absent): `cfg.tp` is then None and `knobs()` leaves
it out, so `apply` uses its default; `cfg.schedule` holds the value `apply` runs with either way.

The sections are declared in `train/options.py`; `check()` checks values only
(`train/config_checks.py`: no file, device or import is touched), the checks that need the
filesystem or a device live in `train/setup.py` (`check_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from ..model_schedule.knobs import CKPT_POLICIES, DEGREE_KNOBS, KnobError, ScheduleKnobs
from ..runtime.mesh import DEVICES, MULTI_STAGE, PP_SCHEDULES
from ..runtime.mesh import stages_per_rank as _stages_per_rank
from ..runtime.precision import PRECISIONS
from .config_checks import PROGRESSIVE_INPUTS, check_values
from .models import ModelSize
from .options import (
    DIST_TIMEOUT_S,
    OWNER,
    SECTIONS,
    ArchOptions,
    CheckpointOptions,
    CorpusOptions,
    LoggingOptions,
    LoraOptions,
    OptimizerOptions,
    ParallelismOptions,
    TrainingOptions,
    config_fields,
    default_of,
    flag,
    knob_names,
    option_fields,
)

__all__ = ["CKPT_POLICIES", "DEVICES", "DIST_TIMEOUT_S", "MULTI_STAGE", "PP_SCHEDULES",
           "PRECISIONS", "PROGRESSIVE_INPUTS", "RUN_IDENTITY", "RUN_LAYOUT", "SECTIONS",
           "ArchOptions", "CheckpointOptions", "CorpusOptions", "LoggingOptions", "LoraOptions",
           "OptimizerOptions", "ParallelismOptions", "TrainConfig", "TrainingOptions",
           "config_fields", "default_of", "flag", "knob_names", "option_fields"]

# The sections and their fields are declared in `train/options.py`, their value checks are
# `train/config_checks.py`; DEVICES, PP_SCHEDULES and MULTI_STAGE are the placement's
# (`slapo.runtime.mesh`), re-exported.

# Options that must match a checkpoint for resuming to continue the same run.
RUN_IDENTITY = ("model", "batch_size", "seq_len", "seed", "hidden_size", "num_layers",
                "num_heads", "dropout", "num_experts", "experts_per_token", "data", "text_field",
                "tokenizer", "val_fraction", "sft", "lora_r", "lora_alpha", "lora_dropout",
                "lora_targets", "lora_4bit")
# How the run is laid out on the ranks (with the number of processes): a resume may change
# them (the loader reads each tensor into this job's layout), but then the per-rank random
# streams restart (`slapo.train.resume`), so only an equal layout resumes bit for bit.
RUN_LAYOUT = ("tp", "pp_stages", "cp", "ep", "sequence_parallel", "vocab_parallel")


# ---- the config -------------------------------------------------------------------------------
@dataclass(init=False, eq=False)
class TrainConfig:
    """Every option of `slapo train`, in its section (see the module docstring).

    `TrainConfig(steps=5, tp=2)` takes options by name; `TrainConfig(training=TrainingOptions(
    steps=5))` takes sections (a knob of a `schedule=ScheduleKnobs(...)` section counts as
    given where it differs from the schema's default). Read either way: `cfg.steps` is
    `cfg.training.steps`."""

    arch: ArchOptions
    corpus: CorpusOptions
    training: TrainingOptions
    optimizer: OptimizerOptions
    lora: LoraOptions
    parallelism: ParallelismOptions
    schedule: ScheduleKnobs
    checkpoint: CheckpointOptions
    logging: LoggingOptions

    def __init__(self, **given: Any):
        sections = {s: given.pop(s) for s in SECTIONS if s in given}
        unknown = sorted(set(given) - set(OWNER))
        if unknown:
            raise TypeError(f"TrainConfig() got unexpected option(s) {', '.join(unknown)}")
        knobs_given = {k for k in given if OWNER[k] == "schedule" and given[k] is not None}
        if "schedule" in sections:
            default = ScheduleKnobs()
            knobs_given |= {k for k in knob_names()
                            if getattr(sections["schedule"], k) != getattr(default, k)}
        for s, cls in SECTIONS.items():
            section = sections.get(s) or cls()
            mine = {k: v for k, v in given.items() if OWNER[k] == s
                    and not (s == "schedule" and v is None)}
            object.__setattr__(self, s, _replaced(section, mine))
        object.__setattr__(self, "_given_knobs", frozenset(knobs_given))

    def __getattr__(self, name: str) -> Any:
        """`cfg.<option>`: the value in its section (a knob not given: None)."""
        section = OWNER.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} has no option {name!r}")
        if section == "schedule" and name not in self.__dict__.get("_given_knobs", ()):
            return None
        return getattr(self.__dict__[section], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """`cfg.<option> = v` sets it in its section (a knob: given, or not given for None)."""
        section = OWNER.get(name)
        if section is None:
            object.__setattr__(self, name, value)
            return
        if section == "schedule":
            given = self.__dict__["_given_knobs"]
            if value is None:
                given, value = given - {name}, getattr(ScheduleKnobs(), name)
            else:
                given = given | {name}
            object.__setattr__(self, "_given_knobs", given)
        setattr(self.__dict__[section], name, value)

    def __eq__(self, other: object) -> bool:
        """Equal options, a knob given or not included (`--tp 1` is not "no --tp")."""
        if not isinstance(other, TrainConfig):
            return NotImplemented
        return self.options() == other.options()

    def options(self) -> dict[str, Any]:
        """{option name: value}, flat (a knob not given: None): what a checkpoint, the metrics
        and the logs record as the run's config, and what `TrainConfig(**options)` rebuilds."""
        return {f.name: getattr(self, f.name) for _, f in option_fields()}

    def check(self) -> None:
        """Reject bad values before anything is built, with the option's `--flag` in the
        message (`train/config_checks.py`). The checks that touch files or devices are
        `train.setup.check_inputs`."""
        check_values(self)

    def resume_target(self) -> str | None:
        """What to resume from: "latest" (in `out`), a checkpoint directory, or None."""
        return "latest" if self.resume_or_start and self.resume is None else self.resume

    # ---- derived values -----------------------------------------------------------------------
    def pipeline_schedule(self) -> str | None:
        """The torch.distributed.pipelining schedule, None without a pipeline."""
        return (self.pp_schedule or "1F1B") if (self.pp_stages or 1) > 1 else None

    def stages_per_rank(self) -> int:
        """Multi-stage schedules (Interleaved1F1B, ...) run 2 stages per rank, so the model is
        cut into pp * 2 stages (`runtime.mesh.stages_per_rank`)."""
        return _stages_per_rank(self.pipeline_schedule())

    def microbatches(self) -> int:
        """torch's default: one micro-batch per stage."""
        return (self.pp_stages or 1) * self.stages_per_rank() if self.pipeline_schedule() else 1

    def peak_lr(self) -> float:
        """`--lr`, or its default for this model (`config_checks.default_lr`: pre-training,
        fine-tuning a pretrained directory, LoRA)."""
        from .config_checks import default_lr

        return self.lr if self.lr is not None else default_lr(self)

    def optimizer_kwargs(self) -> dict[str, Any]:
        """AdamW's arguments: the one definition `slapo train` and tune trials step with."""
        return {"lr": self.peak_lr(), "weight_decay": self.weight_decay, "betas": (0.9, 0.95)}

    def knobs(self) -> dict[str, Any]:
        """The `model_schedule.apply` keyword arguments that were given, less the parallel
        degrees (`--tp`, `--pp-stages`): those are the run's placement (`train.setup.placement`),
        and `apply` reads them from the mesh (tp) and the placement (the stage count) instead
        of a second copy. `--fused-loss` needs an unsharded LM head, so with `--tp` > 1 it also
        turns vocabulary parallelism off unless `--vocab-parallel` was given (which the schema
        then rejects, naming both)."""
        knobs = {k: getattr(self, k) for k in knob_names()
                 if getattr(self, k) is not None and k not in DEGREE_KNOBS}
        if knobs.get("fused_loss") and (self.tp or 1) > 1 and "vocab_parallel" not in knobs:
            knobs["vocab_parallel"] = False
        return knobs

    def schedule_knobs(self) -> ScheduleKnobs:
        """The given knobs and degrees as the schema object, validated (a degree by the
        placement's one check, `runtime.mesh.check_degree`); a bad value is a ValueError naming
        its `--flag` and the fix."""
        degrees = {k: getattr(self, k) for k in DEGREE_KNOBS if getattr(self, k) is not None}
        try:
            return ScheduleKnobs.from_given({**self.knobs(), **degrees}).validate()
        except KnobError as e:
            raise ValueError(f"--{flag(e.knob)}: {e.problem} Fix: {e.fix}") from None

    def size(self, tokenizer=None) -> ModelSize:
        """A registry model's size, with the vocabulary of `tokenizer` (default: bytes)."""
        vocab = {} if tokenizer is None else dict(
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        return ModelSize(self.hidden_size, self.num_layers, self.num_heads,
                         max_positions=max(1024, 2 * self.seq_len), dropout=self.dropout,
                         experts=self.num_experts, experts_per_token=self.experts_per_token,
                         **vocab)


def _replaced(section: Any, values: dict[str, Any]) -> Any:
    """A copy of `section` with `values` set (the caller's section object is not changed)."""
    kwargs = {f.name: getattr(section, f.name) for f in fields(section) if f.init}
    return type(section)(**{**kwargs, **values})
