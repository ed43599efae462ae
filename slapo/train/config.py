"""`TrainConfig`: every option of `slapo train`, and the checks that run before anything is built.

The schedule knobs are not declared here: `TrainConfig` is `RunOptions` (the options of the run
itself) plus one field per `model_schedule.knobs.ScheduleKnobs` field, generated from the schema
with `None` ("not given": `apply`'s default) as the default and the schema's help text, kind and
choices as field metadata. So the CLI flags, TOML keys and `--help` (`slapo.cli`) cover every knob
`apply` takes, under the same name, with one meaning; `cfg.tp`-style reads and flat
`TrainConfig(model=..., attention="sdpa", tp=2)` construction work as before.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from ..data import check_tokenizer_dir
from ..data.prepared import check_prepared, prepared_dir
from ..data.sources import is_saved_dataset
from ..model_schedule.knobs import CKPT_POLICIES, KnobError, ScheduleKnobs, knob_fields
from . import pretrained
from . import run_state as ckpt
from .metrics_log import check_sinks
from .models import ModelSize, check_unambiguous, get_model_spec

__all__ = ["CKPT_POLICIES", "DEVICES", "DIST_TIMEOUT_S", "MULTI_STAGE", "PP_SCHEDULES",
           "PRECISIONS", "RUN_IDENTITY", "RUN_LAYOUT", "RunOptions", "TrainConfig", "config_fields", "flag",
           "knob_names"]

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
DIST_TIMEOUT_S = 60.0   # --dist-timeout default: long saves or first compiles may need more
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
               "DualPipeV")  # two stages per rank (torch's PipelineScheduleMulti)

# Options that must match a checkpoint for resuming to continue the same run.
RUN_IDENTITY = ("model", "batch_size", "seq_len", "seed", "hidden_size", "num_layers",
                "num_heads", "dropout", "data", "text_field", "tokenizer", "val_fraction")
# How the run is laid out on the ranks (with the number of processes): a resume may change
# them (the loader reads each tensor into this job's layout), but then the per-rank random
# streams restart (`slapo.train.resume`), so only an equal layout resumes bit for bit.
RUN_LAYOUT = ("tp", "pp_stages", "sequence_parallel", "vocab_parallel")


def flag(name: str) -> str:
    """The `--flag` spelling of an option name (without the dashes)."""
    return name.replace("_", "-")


def knob_names() -> tuple[str, ...]:
    """The schedule knobs, in the schema's order: the TrainConfig fields passed to `apply`."""
    return tuple(f.name for f in knob_fields())


@dataclass
class RunOptions:
    """The options of the run itself (data, model, optimizer, engine, output). `TrainConfig`
    adds the schedule knobs; the CLI flags and TOML keys have the same names."""

    model: str = "gpt2"         # a registry name, a local HF model directory or a config.json
    data: str | None = None     # files / globs / .jsonl / saved or prepared dir (None: corpus)
    text_field: str = "text"    # the JSONL field / dataset column holding the text
    tokenizer: str | None = None  # a local AutoTokenizer directory (None: bytes, or the model's)
    val_fraction: float = 0.1   # share of the data held out for the val loss
    steps: int = 50
    batch_size: int = 8
    seq_len: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.1   # cosine decay to lr * min_lr_ratio at `steps` (1.0: constant)
    warmup: int = 0             # linear warm-up steps
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    dropout: float = 0.0
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    out: str | None = None
    resume: str | None = None   # "latest" (the newest intact checkpoint in `out`) or a dir
    resume_or_start: bool = False  # resume from `out` if it has a checkpoint, else start fresh
    overwrite: bool = False     # a fresh run replaces the run in `out` (else: refused)
    save_every: int = 0         # 0: only at the end (when `out` is given)
    keep_last: int = 0          # keep the N newest checkpoints (0: keep all)
    dist_timeout: float = DIST_TIMEOUT_S  # seconds a collective may wait for a peer
    eval_batches: int = 4       # val-loss batches per evaluation (0: no val loss)
    eval_every: int = 0         # also evaluate every N steps (0: only at the end)
    tensorboard: bool = False   # also log to TensorBoard, in OUT/tensorboard
    wandb: str | None = None    # also log to this Weights & Biases project
    progress: bool = True
    plot: bool = True
    progressive: bool = False   # run the progressive-optimization demo instead of training
    precision: str = "fp32"     # fp32, or bf16 / fp16 mixed precision (fp32 master weights)
    device: str = "auto"        # auto (CUDA when available), cpu or cuda
    dp_shard: bool = False      # data-parallel ranks shard weights and optimizer (FSDP2), not DDP
    pp_schedule: str | None = None  # pipeline schedule with --pp-stages > 1 (default 1F1B)
    grad_accum: int = 1         # slices of each batch, one backward each, one optimizer step

    # ---- checks -------------------------------------------------------------------------------
    def check(self) -> None:
        """Reject bad values before anything is built, with the option's name in the message.
        Paths (--model, --data, --tokenizer) raise InputError (exit status 2) naming the path."""
        self._check_inputs()
        self._check_numbers()
        self._check_out()
        self._check_resume()
        if self.save_every and self.out is None:
            raise ValueError("--save-every needs --out DIR (where checkpoints are written)")
        self._check_logging()
        self.schedule_knobs()  # the knob values, by the schema
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available here (use --device cpu "
                             "or auto)")
        self._check_engine()
        self._check_shape()

    def _check_numbers(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "hidden_size", "num_layers", "num_heads",
                     "grad_accum"):
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

    def _check_shape(self) -> None:
        """A registry model's size against itself and the parallel degrees, here rather than
        when the model is built (a raw HF error) or sharded (after the job started): the
        width splits into heads, the heads over --tp ranks, the layers over the stages."""
        if pretrained.is_model_path(self.model):
            return  # its sizes are in its config.json; `apply` checks them before any change
        if self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-heads {self.num_heads}")
        tp = self.tp or 1
        if isinstance(tp, int) and tp > 1 and self.num_heads % tp:
            raise ValueError(f"--num-heads {self.num_heads} is not divisible by --tp {tp}: "
                             "tensor parallelism gives each rank num_heads / tp heads")
        stages = (self.pp_stages or 1) * self.stages_per_rank()
        if isinstance(stages, int) and stages > self.num_layers:
            raise ValueError(f"--pp-stages {self.pp_stages} cuts the model into {stages} "
                             f"stages, but --num-layers {self.num_layers} gives fewer layers "
                             "than stages")

    def _check_logging(self) -> None:
        for name in ("tensorboard", "wandb"):
            if getattr(self, name) and self.out is None:
                raise ValueError(f"--{name} needs --out DIR (the run directory its log goes "
                                 "to, beside metrics.jsonl)")
        if self.eval_every and not self.eval_batches:
            raise ValueError("--eval-every needs --eval-batches >= 1 (the batches each "
                             "evaluation averages over)")
        check_sinks(self.tensorboard, self.wandb)

    def _check_out(self) -> None:
        if self.out is not None and Path(self.out).exists() and not Path(self.out).is_dir():
            raise ValueError(f"--out {self.out} is a file, not a directory")
        if self.overwrite and self.out is None:
            raise ValueError("--overwrite needs --out DIR (the run directory to replace)")
        if self.overwrite and self.resume_target() is not None:
            raise ValueError("--overwrite replaces the run in --out, --resume / "
                             "--resume-or-start continue it: pass one of them")

    def _check_inputs(self) -> None:
        """--model, --data, --tokenizer: the paths exist and hold what they should (cheap: the
        data is read in `build`, which reports a bad line or field the same way)."""
        if pretrained.is_model_path(self.model):
            pretrained.model_source(self.model)
        else:
            get_model_spec(self.model)
            check_unambiguous(self.model)  # `slapo train` and `train(cfg)` alike
        if self.data is not None and prepared_dir(self.data) is not None:
            check_prepared(prepared_dir(self.data))  # meta.json and file sizes, no read
        elif self.data is not None:
            from ..data.sources import _expand

            entries = [e.strip() for e in self.data.split(",") if e.strip()]
            if not (len(entries) == 1 and is_saved_dataset(Path(entries[0]))):
                for entry in entries or [""]:
                    _expand(entry)
        if self.tokenizer is not None:
            check_tokenizer_dir(self.tokenizer)
        if not self.text_field:
            raise ValueError("--text-field must not be empty")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")

    def _check_engine(self) -> None:
        if self.progressive and (self.data or self.tokenizer
                                 or pretrained.is_model_path(self.model)):
            raise ValueError("--progressive compares schedules on a registry model and the "
                             "shipped corpus; drop --data, --tokenizer and a --model path")
        if self.pp_schedule is not None:
            if self.pp_schedule not in PP_SCHEDULES:
                raise ValueError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, "
                                 f"got {self.pp_schedule!r}")
            if (self.pp_stages or 1) < 2:
                raise ValueError("--pp-schedule needs --pp-stages 2 or more (a pipeline)")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum "
                             f"{self.grad_accum}")

    def resume_target(self) -> str | None:
        """What to resume from: "latest" (in `out`), a checkpoint directory, or None."""
        return "latest" if self.resume_or_start and self.resume is None else self.resume

    def _check_resume(self) -> None:
        """--resume must find something: a typo in --out must not silently start over."""
        target = self.resume_target()
        if target is None:
            return
        if self.resume_or_start and target != "latest":
            raise ValueError("--resume-or-start resumes from the newest checkpoint in --out; "
                             f"it cannot be combined with a checkpoint directory ({target})")
        if target == "latest" and self.out is None:
            raise ValueError("--resume needs --out DIR (the run directory holding checkpoints)")
        if target != "latest" and not Path(target).is_dir():
            raise ValueError(f"--resume {target}: no such checkpoint directory")
        if target == "latest" and not self.resume_or_start and not ckpt.candidates(
                Path(self.out)):
            raise ValueError(f"--resume: no checkpoint in {Path(self.out) / ckpt.CHECKPOINTS}; "
                             "drop --resume to start a fresh run there, or pass "
                             "--resume-or-start to resume when a checkpoint exists and start "
                             "fresh otherwise")

    # ---- derived values -----------------------------------------------------------------------
    def pipeline_schedule(self) -> str | None:
        """The torch.distributed.pipelining schedule, None without a pipeline."""
        return (self.pp_schedule or "1F1B") if (self.pp_stages or 1) > 1 else None

    def stages_per_rank(self) -> int:
        """Multi-stage schedules (Interleaved1F1B, ...) run 2 stages per rank, so the model is
        cut into pp * 2 stages."""
        return 2 if self.pipeline_schedule() in MULTI_STAGE else 1

    def microbatches(self) -> int:
        """torch's default: one micro-batch per stage."""
        return (self.pp_stages or 1) * self.stages_per_rank() if self.pipeline_schedule() else 1

    def optimizer_kwargs(self) -> dict[str, Any]:
        """AdamW's arguments: the one definition `slapo train` and tune trials step with."""
        return {"lr": self.lr, "weight_decay": self.weight_decay, "betas": (0.9, 0.95)}

    def mixed_precision(self) -> str | None:
        """The `slapo.build(mixed_precision=...)` value: None for fp32."""
        return None if self.precision == "fp32" else self.precision

    def knobs(self) -> dict[str, Any]:
        """The `model_schedule.apply` keyword arguments that were given. `--fused-loss` needs an
        unsharded LM head, so with `--tp` > 1 it also turns vocabulary parallelism off unless
        `--vocab-parallel` was given (which the schema then rejects, naming both)."""
        knobs = {k: getattr(self, k) for k in knob_names() if getattr(self, k) is not None}
        if knobs.get("fused_loss") and (self.tp or 1) > 1 and "vocab_parallel" not in knobs:
            knobs["vocab_parallel"] = False
        if "pp_stages" in knobs and knobs["pp_stages"] > 1:
            knobs["pp_stages"] *= self.stages_per_rank()  # stages to cut, not pipeline ranks
        return knobs

    def schedule_knobs(self) -> ScheduleKnobs:
        """The given knobs as the schema object, validated; a bad value is a ValueError naming
        its `--flag` and the fix."""
        try:
            return ScheduleKnobs.from_given(self.knobs()).validate()
        except KnobError as e:
            raise ValueError(f"--{flag(e.knob)}: {e.problem} Fix: {e.fix}") from None

    def size(self, tokenizer=None) -> ModelSize:
        """A registry model's size, with the vocabulary of `tokenizer` (default: bytes)."""
        vocab = {} if tokenizer is None else dict(
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        return ModelSize(self.hidden_size, self.num_layers, self.num_heads,
                         max_positions=max(1024, 2 * self.seq_len), dropout=self.dropout,
                         **vocab)


def _given_field(f: dataclasses.Field) -> tuple[str, str, dataclasses.Field]:
    """A schema knob as an optional TrainConfig option: None means "not given"."""
    return f.name, f"{f.metadata['kind']} | None", dataclasses.field(
        default=None, metadata={**f.metadata, "knob": True})


TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [_given_field(f) for f in knob_fields()], bases=(RunOptions,))
TrainConfig.__module__ = __name__
TrainConfig.__doc__ = """Every option of `slapo train`: `RunOptions` plus one optional field per
schedule knob of `model_schedule.knobs.ScheduleKnobs` (None: not given). The CLI flags and TOML
keys have the same names."""


def config_fields() -> dict[str, Any]:
    """{option name: its type annotation string}, for the CLI and TOML parsers."""
    return {f.name: f.type for f in fields(TrainConfig)}
