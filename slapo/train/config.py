"""`TrainConfig`: every option of `slapo train`, declared once, in sections, and its value checks.

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

`check()` checks values only (no file, device or import is touched): the checks that need the
filesystem or a device live in `train/setup.py` (`check_inputs`).
"""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from ..errors import SchedulingError
from ..model_schedule.knobs import (
    CKPT_POLICIES,
    DEGREE_KNOBS,
    KnobError,
    ScheduleKnobs,
    knob_fields,
)
from ..runtime.mesh import DEVICES, MULTI_STAGE, PP_SCHEDULES, ParallelDims
from ..runtime.mesh import stages_per_rank as _stages_per_rank
from ..runtime.precision import PRECISIONS, check_precision
from .models import REGISTRY, ModelSize

__all__ = ["CKPT_POLICIES", "DEVICES", "DIST_TIMEOUT_S", "MULTI_STAGE", "PP_SCHEDULES",
           "PRECISIONS", "RUN_IDENTITY", "RUN_LAYOUT", "SECTIONS", "ArchOptions",
           "CheckpointOptions", "CorpusOptions", "LoggingOptions", "LoraOptions", "OptimizerOptions",
           "ParallelismOptions", "TrainConfig", "TrainingOptions", "config_fields", "flag",
           "knob_names", "option_fields"]

DIST_TIMEOUT_S = 60.0   # --dist-timeout default: long saves or first compiles may need more
# DEVICES, PP_SCHEDULES and MULTI_STAGE are the placement's (`slapo.runtime.mesh`), re-exported.

# Options that must match a checkpoint for resuming to continue the same run.
RUN_IDENTITY = ("model", "batch_size", "seq_len", "seed", "hidden_size", "num_layers",
                "num_heads", "dropout", "num_experts", "experts_per_token", "data", "text_field",
                "tokenizer", "val_fraction", "lora_r", "lora_alpha", "lora_dropout",
                "lora_targets")
# How the run is laid out on the ranks (with the number of processes): a resume may change
# them (the loader reads each tensor into this job's layout), but then the per-rank random
# streams restart (`slapo.train.resume`), so only an equal layout resumes bit for bit.
RUN_LAYOUT = ("tp", "pp_stages", "cp", "ep", "sequence_parallel", "vocab_parallel")


PROGRESSIVE_INPUTS = ("--progressive compares schedules on a registry model and the shipped "
                      "corpus; drop --data, --tokenizer and a --model path")


def flag(name: str) -> str:
    """The `--flag` spelling of an option name (without the dashes)."""
    return name.replace("_", "-")


def knob_names() -> tuple[str, ...]:
    """The schedule knobs, in the schema's order: the options passed to `apply`."""
    return tuple(f.name for f in knob_fields())


def _opt(default: Any, help: str, *, choices: tuple | None = None, check: Any = None) -> Any:
    """An option: its default and its one help text (`choices`: the values `check()` and the
    CLI accept; `check`: the one validator of the option, when it is not a `choices` test)."""
    return field(default=default, metadata={"help": help, "choices": choices, "check": check})


# ---- the sections -----------------------------------------------------------------------------
@dataclass
class ArchOptions:
    """What is trained: a registry architecture at a small size, or a local HF model."""

    model: str = _opt("gpt2", "architecture (small config): gpt2, llama, opt, gpt_neo, bert, "
                      "roberta, albert, t5, and the mixtures of experts mixtral, qwen3_moe; "
                      "or a local HF model directory (config.json + optional "
                      "model.safetensors: fine-tune it) or a config.json file")
    hidden_size: int = _opt(128, "model width")
    num_layers: int = _opt(4, "number of layers (T5: split between encoder and decoder)")
    num_heads: int = _opt(4, "attention heads")
    dropout: float = _opt(0.0, "dropout probability of the model")
    num_experts: int = _opt(4, "experts per MoE layer of a registry mixture of experts "
                            "(mixtral, qwen3_moe)")
    experts_per_token: int = _opt(2, "experts each token is routed to (top-k) in a registry "
                                  "mixture of experts (mixtral, qwen3_moe)")


@dataclass
class CorpusOptions:
    """The training text and how it is tokenised and split."""

    data: str | None = _opt(None, "training text: files, globs, directories of *.txt, .jsonl "
                            "files (comma-separated), or a dataset directory saved with "
                            "`datasets` save_to_disk, or a directory written by `slapo "
                            "prepare-data` (default: the shipped corpus)")
    text_field: str = _opt("text", "the JSONL field / dataset column that holds the text")
    tokenizer: str | None = _opt(None, "a local AutoTokenizer directory (default: the model "
                                 "directory's tokenizer if it has one, else byte tokens)")
    val_fraction: float = _opt(0.1, "share of the data held out for the val loss (JSONL/"
                               "dataset: of the records; text files: each file's tail; 0: none)")


@dataclass
class TrainingOptions:
    """The steps: how many, how big, in which precision, on which device."""

    steps: int = _opt(50, "total optimizer steps (a resumed run continues up to this)")
    batch_size: int = _opt(8, "global batch size (samples per step, over all data-parallel "
                           "ranks)")
    seq_len: int = _opt(64, "tokens per sample")
    grad_accum: int = _opt(1, "gradient accumulation: slices of each batch, one optimizer step")
    seed: int = _opt(0, "seed of the model init, data order and dropout")
    precision: str = _opt("fp32", "fp32, or bf16 / fp16 mixed precision: autocast forward and "
                          "loss on fp32 master weights and optimizer state (fp16 adds a "
                          "gradient scaler; fp8 is bf16 plus torchao's FP8 GEMMs in the large "
                          "linears, emulated on CPU: pip install slapo[fp8])",
                          choices=PRECISIONS, check=check_precision)
    device: str = _opt("auto", "auto (CUDA when available), cpu or cuda", choices=DEVICES)
    dist_timeout: float = _opt(DIST_TIMEOUT_S, "seconds a collective waits for a peer before "
                               "the job fails (raise it for long checkpoint saves or "
                               "first-step compiles)")
    progressive: bool = _opt(False, "apply the schedule steps one at a time (SDPA, fusion, "
                             "Tempo, checkpointing, TP with several processes), verify each "
                             "against HF eager and print a table of speed, memory and "
                             "correctness; --steps is per step")


@dataclass
class OptimizerOptions:
    """AdamW and its learning-rate schedule (linear warm-up, cosine decay)."""

    lr: float = _opt(1e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _opt(0.1, "cosine decay to lr * this at the last step (1: constant "
                               "LR)")
    warmup: int = _opt(0, "linear warm-up steps")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    grad_clip: float | None = _opt(1.0, "clip the gradient norm to this (0: no clipping)")


@dataclass
class LoraOptions:
    """LoRA fine-tuning: PEFT's low-rank adapters on the projections, the base model frozen."""

    lora_r: int = _opt(0, "LoRA rank: wrap the model with PEFT's LoRA adapters of this rank "
                       "before it is scheduled; only the adapters train (0: off, every weight "
                       "trains); needs the peft package")
    lora_alpha: float | None = _opt(None, "LoRA scaling: each adapter adds B(A(x)) * alpha / r "
                                    "(default: PEFT's, 8)")
    lora_dropout: float = _opt(0.0, "dropout on each adapter's input (0 with --tp > 1: not yet "
                               "exact across tensor-parallel ranks)")
    lora_targets: str | None = _opt(None, "the modules that get adapters, comma-separated "
                                    "names or path suffixes (q_proj,v_proj); default: the "
                                    "projections the family's tensor-parallel plan splits "
                                    "(attention q/k/v/o and the MLP linears)")

    def targets(self) -> list[str] | None:
        """`--lora-targets` as a list (None: the family's default)."""
        if self.lora_targets is None:
            return None
        return [t.strip() for t in self.lora_targets.split(",") if t.strip()]


@dataclass
class ParallelismOptions:
    """How the data-parallel ranks hold the model and how a pipeline is scheduled (the degrees
    `--tp` and `--pp-stages` are schedule knobs: the schedule section)."""

    dp_shard: bool = _opt(False, "data-parallel ranks shard weights, gradients and optimizer "
                          "state (FSDP2) instead of replicating them (DDP)")
    cp: int = _opt(1, "context parallelism: each of N ranks holds 1/N of every sequence "
                   "(zig-zag chunks, causal load balanced) from the embedding to the loss; "
                   "LLaMA/Qwen2/Qwen3 and GPT-2, with DDP (--cp-attention: ring or allgather)")
    ep: int = _opt(1, "expert parallelism: each MoE layer's experts split over N of the "
                   "data-parallel ranks (E/N each), every token sent to its top-k experts by "
                   "all-to-all, exact and dropless; N divides the data-parallel ranks and the "
                   "experts; mixtures of experts only, with DDP (--dp-shard, --pp-stages > 1, "
                   "--cp > 1, --tp > 1 and --lora-r are refused)")
    pp_schedule: str | None = _opt(None, "pipeline schedule with --pp-stages > 1 (default "
                                   "1F1B); Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                                   "ZBVZeroBubble, DualPipeV run 2 stages per rank",
                                   choices=PP_SCHEDULES)


@dataclass
class CheckpointOptions:
    """The run directory: where checkpoints go, and where a run resumes from."""

    out: str | None = _opt(None, "run directory: metrics.json, metrics.png, checkpoints/")
    resume: str | None = _opt(None, "resume from the newest intact checkpoint in --out (or from "
                              "the checkpoint directory given); an error if there is none. The "
                              "number of processes, --tp, --pp-stages, SP and vocabulary "
                              "parallelism may differ from the run's (the random streams then "
                              "restart)")
    resume_or_start: bool = _opt(False, "resume from the newest intact checkpoint in --out if "
                                 "there is one, else start a fresh run there (for restartable "
                                 "job scripts)")
    overwrite: bool = _opt(False, "replace the run already in --out (its checkpoints, metrics "
                           "and run id are removed first); without it a fresh run into a "
                           "directory holding a run is refused")
    save_every: int = _opt(0, "checkpoint every N steps (0: only at the end); needs --out")
    keep_last: int = _opt(0, "keep only the N newest checkpoints (0: keep all; keep 2 or more "
                          "so a damaged newest one can fall back)")


@dataclass
class LoggingOptions:
    """What the run reports: val loss, logs, progress bar, plot."""

    eval_batches: int = _opt(4, "val-loss batches per evaluation (0: no val loss)")
    eval_every: int = _opt(0, "also evaluate every N steps (0: only at the end); val loss and "
                           "perplexity go to the progress bar and metrics.jsonl")
    tensorboard: bool = _opt(False, "also log to TensorBoard (OUT/tensorboard; needs the "
                             "tensorboard package)")
    wandb: str | None = _opt(None, "also log to this Weights & Biases project (needs the wandb "
                             "package; WANDB_MODE=offline works)")
    progress: bool = _opt(True, "show the progress bar")
    plot: bool = _opt(True, "write metrics.png")


# {section attribute: its dataclass}, in the order `--help` and `options()` list them.
SECTIONS: dict[str, type] = {
    "arch": ArchOptions, "corpus": CorpusOptions, "training": TrainingOptions,
    "optimizer": OptimizerOptions, "lora": LoraOptions, "parallelism": ParallelismOptions,
    "schedule": ScheduleKnobs, "checkpoint": CheckpointOptions, "logging": LoggingOptions}


def option_fields() -> list[tuple[str, Field]]:
    """(section, field) of every option, in `SECTIONS` order; the schedule section's fields are
    the knob schema's (`metadata["kind"]`, `choices`, `help`)."""
    return [(s, f) for s, cls in SECTIONS.items() for f in fields(cls)]


_OWNER = {f.name: s for s, f in option_fields()}  # option name -> its section
assert len(_OWNER) == len(option_fields()), "an option name must be unique across sections"


def config_fields() -> dict[str, str]:
    """{option name: its type annotation string}, for the CLI and TOML parsers. A knob may be
    not given, so its type admits None."""
    return {f.name: (f"{f.metadata['kind']} | None" if s == "schedule" else f.type)
            for s, f in option_fields()}


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
        unknown = sorted(set(given) - set(_OWNER))
        if unknown:
            raise TypeError(f"TrainConfig() got unexpected option(s) {', '.join(unknown)}")
        knobs_given = {k for k in given if _OWNER[k] == "schedule" and given[k] is not None}
        if "schedule" in sections:
            default = ScheduleKnobs()
            knobs_given |= {k for k in knob_names()
                            if getattr(sections["schedule"], k) != getattr(default, k)}
        for s, cls in SECTIONS.items():
            section = sections.get(s) or cls()
            mine = {k: v for k, v in given.items() if _OWNER[k] == s
                    and not (s == "schedule" and v is None)}
            object.__setattr__(self, s, _replaced(section, mine))
        object.__setattr__(self, "_given_knobs", frozenset(knobs_given))

    def __getattr__(self, name: str) -> Any:
        """`cfg.<option>`: the value in its section (a knob not given: None)."""
        section = _OWNER.get(name)
        if section is None or section not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} has no option {name!r}")
        if section == "schedule" and name not in self.__dict__.get("_given_knobs", ()):
            return None
        return getattr(self.__dict__[section], name)

    def __setattr__(self, name: str, value: Any) -> None:
        """`cfg.<option> = v` sets it in its section (a knob: given, or not given for None)."""
        section = _OWNER.get(name)
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

    # ---- checks (values only: no file, device or import) --------------------------------------
    def check(self) -> None:
        """Reject bad values before anything is built, with the option's `--flag` in the
        message. The checks that touch files or devices are `train.setup.check_inputs`."""
        self._check_numbers()
        self._check_choices()
        self._check_out()
        self._check_resume()
        if self.save_every and self.out is None:
            raise ValueError("--save-every needs --out DIR (where checkpoints are written)")
        self._check_logging()
        self.schedule_knobs()  # the knob values, by the schema
        self._check_engine()
        self._check_shape()
        self._check_lora()

    def _check_numbers(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "hidden_size", "num_layers", "num_heads",
                     "grad_accum", "cp", "ep", "num_experts", "experts_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "warmup", "eval_batches", "eval_every", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{flag(name)} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        if not self.weight_decay >= 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise ValueError(f"--grad-clip must be > 0 (or 0: no clipping), got "
                             f"{self.grad_clip}")
        if not self.text_field:
            raise ValueError("--text-field must not be empty")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")

    def _check_choices(self) -> None:
        """An option with `choices` (or its own validator: --precision) holds one of them."""
        for s, f in option_fields():
            meta, value = f.metadata, getattr(self, f.name)
            if s == "schedule" or value is None or meta["choices"] is None:
                continue
            if not _holds_choice(meta, value):
                raise ValueError(f"--{flag(f.name)} must be one of {', '.join(meta['choices'])}"
                                 f", got {value!r}")

    def _check_shape(self) -> None:
        """A registry model's width against its heads, here rather than when the model is
        built (a raw HF error). The parallel degrees against the model (heads over --tp ranks,
        layers over the stages) are checked once, by the family's plan in `apply`, before any
        change (docs/architecture.md: one validation per degree)."""
        spec = REGISTRY.get(self.model.lower().replace("-", "_"))
        self._check_experts(spec)
        if spec is None:
            return  # a path, or an unknown name: `setup.check_inputs` says which
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-heads {self.num_heads}")

    def _check_experts(self, spec) -> None:
        """--num-experts / --experts-per-token size a registry mixture of experts only (a
        model directory's config.json says its own; a dense model has none): given anywhere
        else they are refused, never ignored."""
        given = [n for n in ("num_experts", "experts_per_token")
                 if getattr(self, n) != default_of(n)]
        if given and not (spec is not None and spec.moe):
            moe = ", ".join(n for n, s in REGISTRY.items() if s.moe)
            raise ValueError(f"--{flag(given[0])} sizes a registry mixture of experts ({moe}); "
                             f"--model {self.model} is not one: drop it")
        if self.progressive and spec is not None and spec.moe:
            raise ValueError(f"--progressive compares the dense registry's schedules; "
                             f"--model {self.model} is a mixture of experts: drop one")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"--experts-per-token {self.experts_per_token} is more than "
                             f"--num-experts {self.num_experts}")
        if self.ep > 1:
            self._check_ep(spec)

    def _check_ep(self, spec) -> None:
        """`--ep N` against the model and the other options, before any process group: a
        registry model must be a mixture of experts whose experts N divides (a model
        directory's experts are checked by `apply`, before any change); the degrees it does
        not compose with are the placement's one check (`ParallelDims`, here on the ep ranks
        alone; the job's size is checked when the job runs), tp > 1 the expert plan's
        (`model_schedule.moe.check_expert_parallel`, before any change)."""
        if spec is not None and not spec.moe:
            raise ValueError(f"--ep {self.ep} splits the experts of a mixture of experts; "
                             f"--model {self.model} has none (use mixtral or qwen3_moe)")
        if spec is not None and self.num_experts % self.ep:
            raise ValueError(f"--ep {self.ep} does not divide --num-experts {self.num_experts} "
                             f"(each ep rank holds num_experts / ep experts)")
        if self.lora_r:  # the experts' gradient hooks need trained experts
            raise ValueError(f"--ep {self.ep} with --lora-r is not supported yet; drop one")
        try:
            ParallelDims(**{"dp_shard" if self.dp_shard else "dp_replicate": self.ep},
                         pp=self.pp_stages or 1, cp=self.cp, ep=self.ep)
        except SchedulingError as e:
            raise ValueError(f"--ep {self.ep}: {e.problem} Fix: {e.fix}") from None

    def _check_logging(self) -> None:
        for name in ("tensorboard", "wandb"):
            if getattr(self, name) and self.out is None:
                raise ValueError(f"--{name} needs --out DIR (the run directory its log goes "
                                 "to, beside metrics.jsonl)")
        if self.eval_every and not self.eval_batches:
            raise ValueError("--eval-every needs --eval-batches >= 1 (the batches each "
                             "evaluation averages over)")

    def _check_out(self) -> None:
        if self.overwrite and self.out is None:
            raise ValueError("--overwrite needs --out DIR (the run directory to replace)")
        if self.overwrite and self.resume_target() is not None:
            raise ValueError("--overwrite replaces the run in --out, --resume / "
                             "--resume-or-start continue it: pass one of them")

    def _check_engine(self) -> None:
        if self.progressive and (self.data or self.tokenizer):
            raise ValueError(PROGRESSIVE_INPUTS)
        if self.pp_schedule is not None and (self.pp_stages or 1) < 2:
            raise ValueError("--pp-schedule needs --pp-stages 2 or more (a pipeline)")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum "
                             f"{self.grad_accum}")

    def _check_lora(self) -> None:
        """The LoRA options' values, and what they do not compose with yet (each refused by
        `model_schedule.lora` too, later; here it is a usage error before anything is built)."""
        if self.lora_r < 0:
            raise ValueError(f"--lora-r must be >= 0 (0: no LoRA), got {self.lora_r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise ValueError(f"--lora-alpha must be > 0, got {self.lora_alpha}")
        if self.lora_targets is not None and not self.lora.targets():
            raise ValueError("--lora-targets names no module (give e.g. q_proj,v_proj)")
        given = [n for n in ("lora_alpha", "lora_targets") if getattr(self, n) is not None]
        given += ["lora_dropout"] if self.lora_dropout else []
        if not self.lora_r:
            if given:
                raise ValueError(f"--{flag(given[0])} needs --lora-r N (LoRA is off)")
            return
        if (self.pp_stages or 1) > 1:
            raise ValueError("--lora-r does not compose with --pp-stages > 1 yet (the pipeline "
                             "stages do not know PEFT's wrapper); drop one of them")
        if self.lora_dropout and (self.tp or 1) > 1:
            raise ValueError("--lora-dropout must be 0 with --tp > 1 (LoRA dropout is not yet "
                             "exact across tensor-parallel ranks)")
        for knob in ("fuse", "kernels"):
            if getattr(self, knob):
                raise ValueError(f"--{knob} does not compose with --lora-r yet (it would "
                                 "replace the MLPs holding the adapters); drop one of them")

    def resume_target(self) -> str | None:
        """What to resume from: "latest" (in `out`), a checkpoint directory, or None."""
        return "latest" if self.resume_or_start and self.resume is None else self.resume

    def _check_resume(self) -> None:
        """The --resume combinations (whether there is something to resume: `check_inputs`)."""
        target = self.resume_target()
        if target is None:
            return
        if self.resume_or_start and target != "latest":
            raise ValueError("--resume-or-start resumes from the newest checkpoint in --out; "
                             f"it cannot be combined with a checkpoint directory ({target})")
        if target == "latest" and self.out is None:
            raise ValueError("--resume needs --out DIR (the run directory holding checkpoints)")

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

    def optimizer_kwargs(self) -> dict[str, Any]:
        """AdamW's arguments: the one definition `slapo train` and tune trials step with."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, "betas": (0.9, 0.95)}

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


def _holds_choice(meta: dict[str, Any], value: Any) -> bool:
    """`value` is one of the option's choices, asked of its own validator if it has one (the
    precision's one check is `runtime.precision.check_precision`)."""
    if meta["check"] is None:
        return value in meta["choices"]
    try:
        meta["check"](value)
    except SchedulingError:
        return False
    return True


def _replaced(section: Any, values: dict[str, Any]) -> Any:
    """A copy of `section` with `values` set (the caller's section object is not changed)."""
    kwargs = {f.name: getattr(section, f.name) for f in fields(section) if f.init}
    return type(section)(**{**kwargs, **values})


def default_of(name: str) -> Any:
    """The default of option `name` (a knob: the schema's, what `apply` runs with)."""
    f = next(f for _, f in option_fields() if f.name == name)
    return None if f.default is MISSING else f.default
