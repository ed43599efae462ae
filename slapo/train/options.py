"""The options of `slapo train`, declared once: one dataclass per section, one help text per
field (`metadata["help"]`), from which the `--flags`, `--help`, the TOML keys, a checkpoint's
saved config and `slapo tune`'s knob spaces derive (`train/config.py`'s `TrainConfig` holds one
of each section; `train/config_checks.py` checks their values)."""

from __future__ import annotations

from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from ..model_schedule.knobs import ScheduleKnobs, knob_fields
from ..runtime.mesh import DEVICES, PP_SCHEDULES
from ..runtime.precision import PRECISIONS, check_precision

DIST_TIMEOUT_S = 60.0   # --dist-timeout default: long saves or first compiles may need more


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
    sft: str | None = _opt(None, "supervised fine-tuning: --data holds rows of prompt/response "
                           "or chat messages (rendered with the tokenizer's chat template), the "
                           "loss on the responses only; pack: documents packed behind a "
                           "document mask, pad: one document per row", choices=("pack", "pad"))


@dataclass
class TrainingOptions:
    """The steps: how many, how big, in which precision, on which device."""

    steps: int = _opt(50, "total optimizer steps (a resumed run continues up to this)")
    epochs: float | None = _opt(None, "passes over the train data instead of --steps: steps = "
                                "epochs x samples per epoch / --batch-size, rounded up (the "
                                "samples per epoch and steps per epoch are printed at start)")
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

    lr: float | None = _opt(None, "peak learning rate (AdamW); default 1e-3 for a model "
                            "trained from its init, 2e-5 for fine-tuning a pretrained "
                            "directory (weights in it), 2e-4 with --lora-r")
    min_lr_ratio: float = _opt(0.1, "cosine decay to lr * this at the last step (1: constant "
                               "LR)")
    warmup: int = _opt(0, "linear warm-up steps")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    grad_clip: float | None = _opt(1.0, "clip the gradient norm to this (0: no clipping)")
    optimizer_offload: bool = _opt(False, "keep AdamW's state in host memory and step it there "
                                   "(gradients copied to the host after clipping, the updated "
                                   "weights copied back): frees 2x the weights' bytes of GPU "
                                   "memory for PCIe traffic each step; same numbers as without "
                                   "it")
    router_bias_rate: float = _opt(0.0, "DeepSeek-V3's auxiliary-loss-free balancing: after "
                                   "each optimizer step move every router's score-correction "
                                   "bias by this towards balance (the step's global token "
                                   "counts; DeepSeek-V3 used 0.001); 0: off (HF's model never "
                                   "updates it)")


@dataclass
class LoraOptions:
    """LoRA fine-tuning: PEFT's low-rank adapters on the projections, the base model frozen."""

    lora_r: int = _opt(0, "LoRA rank: wrap the model with PEFT's LoRA adapters of this rank "
                       "before it is scheduled; only the adapters train (0: off, every weight "
                       "trains); needs the peft package")
    lora_alpha: float | None = _opt(None, "LoRA scaling: each adapter adds B(A(x)) * alpha / r "
                                    "(default: PEFT's, 8)")
    lora_dropout: float = _opt(0.0, "dropout on each adapter's input (under --tp: one mask "
                               "for a replicated input, per-rank masks for a split one)")
    lora_targets: str | None = _opt(None, "the modules that get adapters, comma-separated "
                                    "names or path suffixes (q_proj,v_proj); default: the "
                                    "projections the family's tensor-parallel plan splits "
                                    "(attention q/k/v/o and the MLP linears)")
    lora_4bit: bool = _opt(False, "QLoRA: load the --model directory's base quantized to 4-bit "
                           "NF4 by bitsandbytes (double quantization; compute in bf16 under "
                           "--precision bf16, else fp32) and train the --lora-r adapters on "
                           "it; one process or DDP; needs pip install slapo[qlora]")

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
                   "LLaMA/Mistral/Qwen2/Qwen3, GPT-2, OPT, BERT and RoBERTa, with DDP or "
                   "--dp-shard, and --tp (--cp-attention: allgather, ring or ulysses)")
    ep: int = _opt(1, "expert parallelism: each MoE layer's experts split over N of the "
                   "data-parallel ranks (E/N each), every token sent to its top-k experts by "
                   "all-to-all, exact and dropless; N divides the data-parallel ranks and the "
                   "experts; mixtures of experts only, with DDP or --dp-shard (FSDP2 shards the "
                   "rest) and --tp (--pp-stages > 1: the aux loss, --cp > 1 and --lora-r are "
                   "refused)")
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
    keep_best: bool = _opt(False, "evaluate at every save and keep the checkpoint with the "
                           "lowest val loss whatever --keep-last removes; OUT/best.json names "
                           "it (step, val loss)")


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


OWNER = {f.name: s for s, f in option_fields()}  # option name -> its section
assert len(OWNER) == len(option_fields()), "an option name must be unique across sections"


def config_fields() -> dict[str, str]:
    """{option name: its type annotation string}, for the CLI and TOML parsers. A knob may be
    not given, so its type admits None."""
    return {f.name: (f"{f.metadata['kind']} | None" if s == "schedule" else f.type)
            for s, f in option_fields()}


def default_of(name: str) -> Any:
    """The default of option `name` (a knob: the schema's, what `apply` runs with)."""
    f = next(f for _, f in option_fields() if f.name == name)
    return None if f.default is MISSING else f.default
