"""Assemble a `slapo train` run: data, model, schedule knobs, pretrained weights, and the one
training step (the `Trainer` of `slapo.runtime.build.build_trainer`: optimizer, runner,
precision, `train_step`, `eval_step`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..data import Data, InputError, TokenLoader, make_data
from ..data.sft_loader import check_packable
from ..init import has_meta_tensors
from ..runtime.trainer import Trainer
from . import pretrained, qlora
from .models import build_model, get_model_spec
from .moe_metrics import ExpertLoad, watch_experts
from .setup import Env, data_parallel, seed_training_rng

__all__ = ["Run", "build", "hf_model", "make_trainer", "schedule", "with_lora"]


@dataclass
class Run:
    """Everything the loop carries from step to step."""

    cfg: Any                    # TrainConfig
    env: Env
    model: nn.Module            # the (scheduled) HF model: state-dict keys are the HF keys
    trainer: Trainer            # the step: train_step, eval_step, optimizer, precision
    data: TokenLoader           # the train loader (its state is saved in checkpoints)
    task: str
    schedule_note: str
    dataset: Data | None = None  # tokenizer, val tokens, where the data came from
    step: int = 0
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # {step, val_loss, val_ppl}
    resumed_from: int | None = None
    resume_skipped: list[dict[str, str]] = field(default_factory=list)  # damaged checkpoints
    # dynamo's graph-break counts when the run was built (the counters are per process: the
    # run reports only the breaks it added, `report.graph_breaks`)
    graph_breaks_before: dict[str, int] = field(default_factory=dict)
    # a mixture of experts' routing counters (`moe_metrics.ExpertLoad`; None: dense model) and
    # the last step's numbers from them (tokens per expert, load imbalance, aux loss)
    experts: ExpertLoad | None = None
    expert_stats: dict[str, Any] = field(default_factory=dict)

    @property
    def lrs(self) -> list[float]:
        """The learning rate of every step taken (a function of the step: see loop.lr_at)."""
        from .loop import lr_at

        return [lr_at(i, self.cfg) for i in range(self.step)]

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.trainer.optimizer

    @property
    def precision(self):
        """The step's `slapo.runtime.precision.Precision` (autocast context, fp16 scaler)."""
        return self.trainer.precision


def build(cfg: Any, env: Env, log=print) -> Run:
    """Data (tokenizer, split, packing), the model (registry config, or a local HF directory
    / config file; same init on every rank), schedule knobs, pretrained weights (each rank
    reads its shards), optimizer."""
    from .report import graph_break_counts

    breaks_before = graph_break_counts()
    if cfg.lr is None:  # its default for this model, recorded in the run's config
        cfg.lr = cfg.peak_lr()
    source = pretrained.model_source(cfg.model) if pretrained.is_model_path(cfg.model) else None
    if cfg.lora_4bit:  # the directory's weights and bitsandbytes, before anything is built
        qlora.check_source(cfg, source)
    task = source.task() if source is not None else get_model_spec(cfg.model).task
    tokenizer = cfg.tokenizer
    if tokenizer is None and source is not None and source.has_tokenizer():
        tokenizer = str(source.directory)  # the model's own tokenizer
    if cfg.sft is not None:
        data = _sft_data(cfg, task, tokenizer)
    else:
        data = make_data(task, cfg.seq_len, cfg.seed, data=cfg.data, text_field=cfg.text_field,
                         tokenizer=tokenizer, val_fraction=cfg.val_fraction)
    log(epoch_note(data.train, cfg))  # --epochs sets cfg.steps here
    torch.manual_seed(cfg.seed)
    model = with_lora(_new_model(cfg, source, data, env), cfg)
    if cfg.sft == "pack":
        check_packable(getattr(getattr(hf_model(model), "config", None), "model_type", None))
    if cfg.lora_4bit:
        log(qlora.note(model, source, cfg))
    if cfg.lora_r:
        log(lora_note(model, cfg))
    model, sch, note = schedule(model, cfg, env)
    if cfg.sft == "pack":  # a KV cache would make HF skip the packed documents' mask
        from ..model_schedule.no_cache import training_without_cache

        training_without_cache(sch)
    stages = None  # the pipeline, planned once: read by the loader, then built
    if source is not None and not cfg.lora_4bit:  # a 4-bit base: read by from_pretrained
        stages = pipeline_stages(sch, cfg, env)
        _load_pretrained(hf_model(sch.mod), source, cfg, env, log, stages,
                         _inner_prefix(sch.mod))
    if not has_meta_tensors(model) and not cfg.lora_4bit:  # a pipeline rank's other stages
        model.to(env.device)  # stay on meta: build materialises and moves only its own
    # (a 4-bit base and its adapters were made on the device)
    model.train()
    trainer = make_trainer(sch, cfg, env, stages)
    if cfg.router_bias_rate:  # DeepSeek-V3's bias balancing, after each optimizer step
        from ..runtime.router_bias import RouterBiasBalance

        RouterBiasBalance(model, cfg.router_bias_rate,
                          trainer.step_config.info.replica_group()).attach(trainer.optimizer)
    seed_training_rng(cfg.seed, env)
    return Run(cfg, env, model, trainer, data.train, task, note, dataset=data,
               graph_breaks_before=breaks_before,
               experts=watch_experts(model, env.device, getattr(trainer.runner, "last", None)))


def epoch_note(loader: Any, cfg: Any) -> str:
    """The train data's size in samples per epoch and the steps an epoch takes; with
    `--epochs`, `cfg.steps` set from them (before the LR schedule reads it)."""
    samples = loader.samples_per_epoch()
    per_epoch = -(-samples // cfg.batch_size)
    note = f"data: {samples:,} samples per epoch, {per_epoch:,} steps per epoch"
    if cfg.epochs is not None:
        cfg.steps = max(1, math.ceil(cfg.epochs * samples / cfg.batch_size))
        note += f"; --epochs {cfg.epochs:g}: {cfg.steps:,} steps"
    return note


def _sft_data(cfg: Any, task: str, tokenizer: str | None):
    """`--sft`: the rows as the run's loader (`slapo.data.sft_loader`); causal LMs only."""
    from ..data import load_tokenizer
    from ..data.sft_loader import make_sft_data

    if task != "causal":
        raise InputError(f"--sft with --model {cfg.model}", f"supervised fine-tuning rows train "
                         f"a causal LM on its responses; this model's task is {task!r}.",
                         "use a causal LM (gpt2, llama, or a *ForCausalLM directory).")
    return make_sft_data(cfg.data, cfg.sft, cfg.seq_len, load_tokenizer(tokenizer), cfg.seed,
                         cfg.val_fraction)


def _new_model(cfg: Any, source, data: Data, env: Env | None = None) -> nn.Module:
    """The registry model at `cfg`'s size, or the source's architecture on the meta device;
    with `--lora-4bit` the source's pretrained model, quantized to 4-bit on the run's device
    (`qlora.load_4bit`)."""
    if source is None:
        return build_model(cfg.model, cfg.size(data.tokenizer))[0]
    _check_fits(cfg, source, data)
    if cfg.lora_4bit:
        return qlora.load_4bit(source, cfg, (env or Env()).device)
    return source.build_empty(dropout=cfg.dropout)


def with_lora(model: nn.Module, cfg: Any) -> nn.Module:
    """`--lora-r N`: the model wrapped by PEFT's LoRA (`model_schedule.lora_wrap.add_lora`:
    the family's projections, or `--lora-targets`), before it is scheduled, so the schedule
    shards base and adapters together; the model itself without it. A target that matches no
    module is bad input (exit status 2), found before anything is written."""
    if not cfg.lora_r:
        return model
    from ..errors import SchedulingError
    from ..model_schedule.lora_wrap import add_lora

    try:
        return add_lora(model, cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                        targets=cfg.lora.targets())
    except SchedulingError as e:
        raise InputError("--lora-targets" if "target" in e.problem else "--lora-r", e.problem,
                         e.fix) from None


def lora_note(model: nn.Module, cfg: Any) -> str:
    """One line: the adapters and what stays frozen (counted before any sharding)."""
    from ..model_schedule.lora import is_tuner_layer

    layers = sum(1 for m in model.modules() if is_tuner_layer(m))
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(_numel(p) for p in model.parameters() if not p.requires_grad)
    return (f"LoRA r={cfg.lora_r}: adapters on {layers} modules, {trained:,} trained "
            f"parameters; the base's {frozen:,} are frozen")


def _numel(p: torch.Tensor) -> int:
    """A parameter's element count; a bitsandbytes 4-bit weight's (two per stored byte) from
    the shape it quantized."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def hf_model(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside a PEFT wrapper (its parameter names are the pretrained
    checkpoint's, up to PEFT's `base_layer`); `model` itself otherwise."""
    from ..model_schedule.lora import peft_inner_path

    path = peft_inner_path(model)
    return model if path is None else model.get_submodule(path)


def _check_fits(cfg: Any, source, data: Data) -> None:
    """The tokenizer's ids and the block length must fit the model's config."""
    config = source.config()
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and data.tokenizer.vocab_size > vocab:
        raise InputError(str(source.path), f"the model's vocabulary has {vocab} entries, the "
                         f"tokenizer ({data.tokenizer.name}) {data.tokenizer.vocab_size}.",
                         "pass --tokenizer with the model's own tokenizer.")
    limit = pretrained.max_positions(config)
    need = cfg.seq_len + (cfg.seq_len // 2 if data.task == "seq2seq" else 0)
    if limit is not None and cfg.seq_len > limit:
        raise InputError(str(source.path), f"the model takes at most {limit} positions, "
                         f"--seq-len is {cfg.seq_len} ({need} tokens per sample).",
                         f"pass --seq-len {limit} or less.")


def _inner_prefix(model: nn.Module) -> str:
    """The prefix (with its dot) of the HF model's names in `model`'s: PEFT's
    `base_model.model.` for a LoRA-wrapped model, "" otherwise."""
    from ..model_schedule.lora import peft_inner_path

    path = peft_inner_path(model)
    return "" if path is None else path + "."


def _load_pretrained(model: nn.Module, source, cfg: Any, env: Env, log, stages=None,
                     prefix: str = "") -> None:
    """Fill the (scheduled, maybe sharded) meta model from the source's safetensors; a source
    without weights gets the model's own init (seeded per module, identical on every rank).
    A pipeline rank reads only its own stages' tensors (the others stay on meta: `build`
    materialises only this rank's stages). The stages name their tensors as the whole
    (wrapped) model does; `prefix` is what those names carry before `model`'s (a PEFT
    wrapper's `base_model.model.`): without removing it a LoRA run's stages matched no
    tensor, and the pretrained base of a pipelined LoRA run was silently a fresh init."""
    from ..init import materialize

    only = None
    if stages is not None:
        only = {n[len(prefix):] for n in _stage_names(stages) if n.startswith(prefix)}
    counts = pretrained.load_weights(model, source, only=only)
    if counts:
        log(f"loaded {counts['loaded']} tensors from {source.path}"
            + (f" ({counts['unused_keys']} checkpoint tensors unused)"
               if counts["unused_keys"] else "")
            + (" for this rank's pipeline stages" if only is not None else ""))
    elif source.directory is not None:
        log(f"{source.path} holds no weights (no model.safetensors): training from a fresh init")
    if only is None and has_meta_tensors(model):
        materialize(model, env.device, seed=cfg.seed)


def pipeline_stages(sch: Any, cfg: Any, env: Env):
    """The run's pipeline (`runtime.build.PipelineStages`: plan and stage modules), or None
    without one. Planned once per run: the pretrained loader reads this rank's stages from
    it and `build_trainer` runs it (`pipeline=stages`)."""
    pipeline = cfg.pipeline_schedule()
    if pipeline is None:
        return None
    from ..runtime.build import plan_stages

    return plan_stages(sch, mesh=env.mesh, pipeline=pipeline,
                       virtual_stages=cfg.stages_per_rank())


def _stage_names(stages) -> set[str]:
    """The parameter and buffer names of this rank's pipeline stages."""
    names: set[str] = set()
    for i in stages.local_ids():
        names |= {n for n, _ in stages.stages[i].named_parameters(remove_duplicate=False)}
        names |= {n for n, _ in stages.stages[i].named_buffers(remove_duplicate=False)}
    return names


def schedule(model: nn.Module, cfg: Any, env: Env) -> tuple[nn.Module, Any, str]:
    """Apply the given schedule knobs with `slapo.model_schedule.apply` on the run's mesh.

    The degrees are the placement's: `apply` shards over the mesh's "tp" group (its size is
    `--tp`) and cuts as many stages as the placement's pipeline runs (`ParallelDims.stages`);
    no second copy of either is passed. No knobs, tp 1 and no pipeline: the model as built.
    Any error of `apply` stops the run: a bad value or an unsupported model with its
    SchedulingError, a knob not implemented for this model with a ValueError carrying apply's
    message (never a silent unsharded or unscheduled run).
    """
    from .. import model_schedule
    from ..schedule import create_schedule
    from .config import knob_names

    knobs = cfg.knobs()
    if env.dims.pp > 1:
        knobs["pp_stages"] = env.dims.stages(cfg.pipeline_schedule())  # stages, not ranks
    if not knobs and env.dims.tp == 1 and env.dims.cp == 1 and env.dims.ep == 1:
        return model, create_schedule(model, mesh=env.mesh), \
            "none (no schedule knobs given: the HF model as built)"
    applied = {**knobs, **({"tp": env.dims.tp} if env.dims.tp > 1 else {})}
    shown = ", ".join(f"{k}={applied[k]}" for k in knob_names() if k in applied)
    for dim in ("cp", "ep"):  # degrees of the mesh: apply installs cp attention / ep experts
        if getattr(env.dims, dim) > 1:
            shown = ", ".join(filter(None, (shown, f"{dim}={getattr(env.dims, dim)}")))
    extra = {"mesh": env.mesh} if env.mesh is not None else {}
    try:
        sch = model_schedule.apply(model, **knobs, **extra)
    except NotImplementedError as e:
        raise ValueError(f"the schedule ({shown}) cannot be applied: {e}") from e
    return sch.mod, sch, f"applied: {shown}"


def make_trainer(sch: Any, cfg: Any, env: Env, stages=None) -> Trainer:
    """Build the schedule's `Trainer` with AdamW on the mesh (`build_trainer`: what
    `slapo.build` makes).

    The step is the trainer's `train_step(batch) -> float`: the same call for one process,
    data parallelism (DDP over the mesh's dp ranks, or FSDP2 with `--dp-shard`, each rank
    taking its slice of the global batch), tensor parallelism (already in the schedule) and
    pipelines (`--pp-stages`, `--pp-schedule`, default 1F1B), `--grad-accum` slices per step,
    with gradient clipping over the whole mesh, in `--precision` (bf16/fp16: autocast on fp32
    master weights; fp16 with a gradient scaler), `--optimizer-offload`: AdamW's state and step
    in host memory.
    """
    from ..runtime.build import build_trainer

    if stages is None:  # the pipeline, planned here unless the loader needed it first
        stages = pipeline_stages(sch, cfg, env)
    return build_trainer(
        sch, optimizer=torch.optim.AdamW, seed=cfg.seed, mesh=env.mesh,
        optimizer_kwargs=cfg.optimizer_kwargs(),
        grad_clip=cfg.grad_clip, data_parallel=data_parallel(cfg, env),
        pipeline=stages, grad_accum=cfg.grad_accum, precision=cfg.precision,
        optimizer_offload=cfg.optimizer_offload)
