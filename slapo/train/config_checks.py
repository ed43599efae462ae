"""The value checks of `slapo train`'s options (`TrainConfig.check()`): each bad value is a
ValueError naming its `--flag` and the fix, before anything is built. Values only: no file,
device or import is touched (those checks are `train/setup.py`'s `check_inputs`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import SchedulingError
from ..runtime.mesh import ParallelDims
from .models import REGISTRY
from .options import default_of, flag, option_fields

if TYPE_CHECKING:
    from .config import TrainConfig

PROGRESSIVE_INPUTS = ("--progressive compares schedules on a registry model and the shipped "
                      "corpus; drop --data, --tokenizer and a --model path")


def check_values(cfg: TrainConfig) -> None:
    """Reject bad values before anything is built, with the option's `--flag` in the
    message. The checks that touch files or devices are `train.setup.check_inputs`."""
    _check_numbers(cfg)
    _check_choices(cfg)
    _check_out(cfg)
    _check_resume(cfg)
    if cfg.save_every and cfg.out is None:
        raise ValueError("--save-every needs --out DIR (where checkpoints are written)")
    _check_logging(cfg)
    cfg.schedule_knobs()  # the knob values, by the schema
    _check_engine(cfg)
    _check_shape(cfg)
    _check_lora(cfg)


PRETRAIN_LR, FINETUNE_LR, LORA_LR = 1e-3, 2e-5, 2e-4


def default_lr(cfg: TrainConfig) -> float:
    """`--lr`'s default: a pre-training rate for a model from its init, the usual full
    fine-tuning rate (HF Trainer's examples, TRL's SFT) for a pretrained directory, and LoRA's
    usual rate with adapters (they start at zero and are small)."""
    from .pretrained import SAFETENSORS, SAFETENSORS_INDEX, is_model_path

    if cfg.lora_r:
        return LORA_LR
    path = Path(cfg.model)
    weights = is_model_path(cfg.model) and path.is_dir() and any(
        (path / f).is_file() for f in (SAFETENSORS, SAFETENSORS_INDEX))
    return FINETUNE_LR if weights else PRETRAIN_LR


def _check_numbers(cfg: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "hidden_size", "num_layers", "num_heads",
                 "grad_accum", "cp", "ep", "num_experts", "experts_per_token"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{flag(name)} must be >= 1, got {getattr(cfg, name)}")
    for name in ("save_every", "warmup", "eval_batches", "eval_every", "keep_last"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"--{flag(name)} must be >= 0, got {getattr(cfg, name)}")
    if cfg.epochs is not None and not cfg.epochs > 0:
        raise ValueError(f"--epochs must be > 0, got {cfg.epochs}")
    if cfg.lr is not None and not cfg.lr > 0:  # unset: `default_lr`, when the run is built
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if not 0 <= cfg.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    if not 0 <= cfg.dropout < 1:
        raise ValueError(f"--dropout must be in [0, 1), got {cfg.dropout}")
    if not cfg.dist_timeout > 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {cfg.dist_timeout}")
    if not cfg.weight_decay >= 0:
        raise ValueError(f"--weight-decay must be >= 0, got {cfg.weight_decay}")
    if not cfg.router_bias_rate >= 0:
        raise ValueError(f"--router-bias-rate must be >= 0, got {cfg.router_bias_rate}")
    if cfg.grad_clip is not None and not cfg.grad_clip >= 0:
        raise ValueError(f"--grad-clip must be > 0 (or 0: no clipping), got "
                         f"{cfg.grad_clip}")
    if not cfg.text_field:
        raise ValueError("--text-field must not be empty")
    if not 0 <= cfg.val_fraction < 1:
        raise ValueError(f"--val-fraction must be in [0, 1), got {cfg.val_fraction}")


def _check_choices(cfg: TrainConfig) -> None:
    """An option with `choices` (or its own validator: --precision) holds one of them."""
    for s, f in option_fields():
        meta, value = f.metadata, getattr(cfg, f.name)
        if s == "schedule" or value is None or meta["choices"] is None:
            continue
        if not _holds_choice(meta, value):
            raise ValueError(f"--{flag(f.name)} must be one of {', '.join(meta['choices'])}"
                             f", got {value!r}")


def _check_shape(cfg: TrainConfig) -> None:
    """A registry model's width against its heads, here rather than when the model is
    built (a raw HF error). The parallel degrees against the model (heads over --tp ranks,
    layers over the stages) are checked once, by the family's plan in `apply`, before any
    change (docs/architecture.md: one validation per degree)."""
    spec = REGISTRY.get(cfg.model.lower().replace("-", "_"))
    _check_experts(cfg, spec)
    if spec is None:
        return  # a path, or an unknown name: `setup.check_inputs` says which
    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"--hidden-size {cfg.hidden_size} is not divisible by "
                         f"--num-heads {cfg.num_heads}")


def _check_experts(cfg: TrainConfig, spec) -> None:
    """--num-experts / --experts-per-token size a registry mixture of experts only (a
    model directory's config.json says its own; a dense model has none): given anywhere
    else they are refused, never ignored."""
    given = [n for n in ("num_experts", "experts_per_token")
             if getattr(cfg, n) != default_of(n)]
    if given and not (spec is not None and spec.moe):
        moe = ", ".join(n for n, s in REGISTRY.items() if s.moe)
        raise ValueError(f"--{flag(given[0])} sizes a registry mixture of experts ({moe}); "
                         f"--model {cfg.model} is not one: drop it")
    if cfg.progressive and spec is not None and spec.moe:
        raise ValueError(f"--progressive compares the dense registry's schedules; "
                         f"--model {cfg.model} is a mixture of experts: drop one")
    if cfg.experts_per_token > cfg.num_experts:
        raise ValueError(f"--experts-per-token {cfg.experts_per_token} is more than "
                         f"--num-experts {cfg.num_experts}")
    if cfg.router_bias_rate and spec is not None and spec.name != "deepseek_v3":
        raise ValueError(f"--router-bias-rate balances DeepSeek-V3's router biases; --model "
                         f"{cfg.model} has none (use deepseek_v3, or a model directory whose "
                         "routers have e_score_correction_bias)")
    if spec is not None and spec.moe and spec.name != "deepseek_v3" and cfg.cp > 1 and \
            (cfg.pp_stages or 1) > 1:  # model_schedule.context_parallel refuses it too
        raise ValueError(f"--cp {cfg.cp} with --pp-stages {cfg.pp_stages} on --model "
                         f"{cfg.model}: its loss adds the router's auxiliary loss, whose "
                         "statistics pipeline stages do not sum over the cp ranks yet; drop "
                         "one (or use deepseek_v3, which has no auxiliary loss)")
    if cfg.ep > 1:
        _check_ep(cfg, spec)


def _check_ep(cfg: TrainConfig, spec) -> None:
    """`--ep N` against the model and the other options, before any process group: a
    registry model must be a mixture of experts whose experts N divides (a model
    directory's experts are checked by `apply`, before any change); the degrees it does
    not compose with are the placement's one check (`ParallelDims`, here on the ep ranks
    alone; the job's size is checked when the job runs). Pipelines compose: the stages carry
    the router's statistics for its auxiliary loss (`runtime/stage_router.py`)."""
    if spec is not None and not spec.moe:
        raise ValueError(f"--ep {cfg.ep} splits the experts of a mixture of experts; "
                         f"--model {cfg.model} has none (use mixtral, qwen3_moe or deepseek_v3)")
    if spec is not None and cfg.num_experts % cfg.ep:
        raise ValueError(f"--ep {cfg.ep} does not divide --num-experts {cfg.num_experts} "
                         f"(each ep rank holds num_experts / ep experts)")
    if cfg.lora_r:  # the experts' gradient hooks need trained experts
        raise ValueError(f"--ep {cfg.ep} with --lora-r is not supported yet; drop one")
    try:
        ParallelDims(**{"dp_shard" if cfg.dp_shard else "dp_replicate": cfg.ep},
                     pp=cfg.pp_stages or 1, cp=cfg.cp, ep=cfg.ep)
    except SchedulingError as e:
        raise ValueError(f"--ep {cfg.ep}: {e.problem} Fix: {e.fix}") from None


def _check_logging(cfg: TrainConfig) -> None:
    for name in ("tensorboard", "wandb"):
        if getattr(cfg, name) and cfg.out is None:
            raise ValueError(f"--{name} needs --out DIR (the run directory its log goes "
                             "to, beside metrics.jsonl)")
    if cfg.keep_best and (cfg.out is None or not cfg.eval_batches):
        raise ValueError("--keep-best needs --out DIR and --eval-batches >= 1 (the val loss "
                         "that picks the checkpoint)")
    if cfg.eval_every and not cfg.eval_batches:
        raise ValueError("--eval-every needs --eval-batches >= 1 (the batches each "
                         "evaluation averages over)")


def _check_out(cfg: TrainConfig) -> None:
    if cfg.overwrite and cfg.out is None:
        raise ValueError("--overwrite needs --out DIR (the run directory to replace)")
    if cfg.overwrite and cfg.resume_target() is not None:
        raise ValueError("--overwrite replaces the run in --out, --resume / "
                         "--resume-or-start continue it: pass one of them")


def _check_engine(cfg: TrainConfig) -> None:
    if cfg.progressive and (cfg.data or cfg.tokenizer):
        raise ValueError(PROGRESSIVE_INPUTS)
    if cfg.sft is not None and cfg.data is None:
        raise ValueError("--sft needs --data ROWS (a JSONL file or saved dataset of "
                         "prompt/response or chat messages rows)")
    if cfg.progressive and cfg.optimizer_offload:
        raise ValueError("--optimizer-offload applies to a training run; --progressive "
                         "compares schedules with their own optimizer: drop one of them")
    if cfg.pp_schedule is not None and (cfg.pp_stages or 1) < 2:
        raise ValueError("--pp-schedule needs --pp-stages 2 or more (a pipeline)")
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible by --grad-accum "
                         f"{cfg.grad_accum}")


def _check_lora(cfg: TrainConfig) -> None:
    """The LoRA options' values, and what they do not compose with yet (each refused by
    `model_schedule.lora` too, later; here it is a usage error before anything is built)."""
    if cfg.lora_r < 0:
        raise ValueError(f"--lora-r must be >= 0 (0: no LoRA), got {cfg.lora_r}")
    if not 0 <= cfg.lora_dropout < 1:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise ValueError(f"--lora-alpha must be > 0, got {cfg.lora_alpha}")
    if cfg.lora_targets is not None and not cfg.lora.targets():
        raise ValueError("--lora-targets names no module (give e.g. q_proj,v_proj)")
    given = [n for n in ("lora_alpha", "lora_targets") if getattr(cfg, n) is not None]
    given += ["lora_dropout"] if cfg.lora_dropout else []
    given += ["lora_4bit"] if cfg.lora_4bit else []
    if not cfg.lora_r:
        if given:
            raise ValueError(f"--{flag(given[0])} needs --lora-r N (LoRA is off)")
        return
    for knob in ("fuse", "kernels"):
        if getattr(cfg, knob):
            raise ValueError(f"--{knob} does not compose with --lora-r yet (it would "
                             "replace the MLPs holding the adapters); drop one of them")
    if cfg.lora_4bit:
        _check_qlora(cfg)


# What --lora-4bit does not compose with: (flag, given?, why). The splits of tp, pp, cp and
# FSDP2 act on float weights; a 4-bit base weight is a packed uint8 tensor with its
# quantization state beside it (`slapo/train/qlora.py`).
_QLORA_DEGREES = (
    ("tp", lambda c: (c.tp or 1) > 1, "tensor parallelism would split the packed 4-bit "
     "weights"),
    ("pp-stages", lambda c: (c.pp_stages or 1) > 1, "pipeline stages are cut from a model "
     "built on the meta device, and the 4-bit base is loaded whole by from_pretrained"),
    ("cp", lambda c: c.cp > 1, "context parallelism is not tested with the 4-bit base"),
    ("dp-shard", lambda c: c.dp_shard, "FSDP2 would shard the packed 4-bit weights"),
)


def _check_qlora(cfg: TrainConfig) -> None:
    """`--lora-4bit`'s values (the model directory and bitsandbytes are checked by
    `qlora.check_source` when the run is built, before anything is written)."""
    if cfg.model.lower().replace("-", "_") in REGISTRY:
        raise ValueError(f"--lora-4bit quantizes a pretrained model's weights; --model "
                         f"{cfg.model} is a registry model trained from its init (nothing to "
                         "quantize): pass --model DIR (a save_pretrained directory with "
                         "model.safetensors), or drop --lora-4bit")
    for name, given, why in _QLORA_DEGREES:
        if given(cfg):
            raise ValueError(f"--lora-4bit with --{name}: {why}; QLoRA runs in one process "
                             f"or DDP (several processes without --tp / --pp-stages / --cp / "
                             f"--dp-shard): drop --{name}")
    # not a validation of the name (`check_precision` does that): two valid precisions that
    # do not compose with a 4-bit base
    if cfg.precision == "fp16" or cfg.precision == "fp8":
        raise ValueError(f"--lora-4bit with --precision {cfg.precision}: the 4-bit base "
                         "computes in bf16 or fp32 (fp8 would replace its Linear4bit layers, "
                         "fp16 is not tested with it): use --precision bf16 or fp32")


def _check_resume(cfg: TrainConfig) -> None:
    """The --resume combinations (whether there is something to resume: `check_inputs`)."""
    target = cfg.resume_target()
    if target is None:
        return
    if cfg.resume_or_start and target != "latest":
        raise ValueError("--resume-or-start resumes from the newest checkpoint in --out; "
                         f"it cannot be combined with a checkpoint directory ({target})")
    if target == "latest" and cfg.out is None:
        raise ValueError("--resume needs --out DIR (the run directory holding checkpoints)")


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
