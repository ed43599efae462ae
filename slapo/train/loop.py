"""The `slapo train` loop, top to bottom: setup -> build -> (resume) -> steps -> finish.

    env = setup(cfg)                      # torch.distributed from torchrun's env, or one process
    run = build(cfg, env)                 # model, schedule knobs, optimizer, data, one step fn
    resume(run, path)                     # optional: model, optimizer, RNG, sampler, history
    for each step: batch -> lr -> step -> log -> (checkpoint)
    finish(run)                           # metrics.json, metrics.png

Exact resume: a checkpoint holds everything the next step depends on (weights, optimizer
moments, every RNG stream, the data sampler's position, the LR is a function of the step), so a
run resumed from step k computes bit-for-bit the losses the uninterrupted run computed after k.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..data import Data, InputError, TokenLoader, check_tokenizer_dir, make_data
from ..data.sources import is_saved_dataset
from . import checkpoint as ckpt
from . import pretrained
from .models import ModelSize, build_model, get_model_spec

KNOBS = ("tp", "ckpt_ratio", "attention", "fuse", "fuse_compiler", "tempo", "pp_stages",
         "ckpt_policy", "compile_blocks", "fused_loss", "kernels")
CKPT_POLICIES = ("full", "selective")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
DIST_TIMEOUT_S = 60.0   # --dist-timeout default: long saves or first compiles may need more
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                "ZBVZeroBubble", "DualPipeV")
MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
               "DualPipeV")  # two stages per rank (torch's PipelineScheduleMulti)


@dataclass
class TrainConfig:
    """Every option of `slapo train`; the CLI flags and TOML keys have the same names."""

    model: str = "gpt2"         # a registry name, a local HF model directory or a config.json
    data: str | None = None     # text files / globs / .jsonl / saved dataset (None: the corpus)
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
    save_every: int = 0         # 0: only at the end (when `out` is given)
    keep_last: int = 0          # keep the N newest checkpoints (0: keep all)
    dist_timeout: float = DIST_TIMEOUT_S  # seconds a collective may wait for a peer
    eval_batches: int = 4       # val-loss batches at the end (0: skip)
    progress: bool = True
    plot: bool = True
    # schedule knobs, passed to slapo.model_schedule.apply (None: not given)
    tp: int | None = None
    ckpt_ratio: float | None = None
    attention: str | None = None
    fuse: bool | None = None
    fuse_compiler: str | None = None   # torch.compile backend for --fuse (default: inductor)
    tempo: bool | None = None
    pp_stages: int | None = None
    ckpt_policy: str | None = None     # full / selective (SAC) for the --ckpt-ratio layers
    compile_blocks: bool | None = None
    fused_loss: bool | None = None
    kernels: bool | None = None
    progressive: bool = False   # run the progressive-optimization demo instead of training
    precision: str = "fp32"     # fp32, or bf16 / fp16 mixed precision (fp32 master weights)
    device: str = "auto"        # auto (CUDA when available), cpu or cuda
    dp_shard: bool = False      # data-parallel ranks shard weights and optimizer (FSDP2), not DDP
    pp_schedule: str | None = None  # pipeline schedule with --pp-stages > 1 (default 1F1B)
    grad_accum: int = 1         # slices of each batch, one backward each, one optimizer step

    def check(self) -> None:
        """Reject bad values before anything is built, with the option's name in the message.
        Paths (--model, --data, --tokenizer) raise InputError (exit status 2) naming the path."""
        self._check_inputs()
        for name in ("steps", "batch_size", "seq_len", "hidden_size", "num_layers", "num_heads",
                     "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("save_every", "warmup", "eval_batches", "keep_last"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--dropout must be in [0, 1), got {self.dropout}")
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist-timeout must be > 0 seconds, got {self.dist_timeout}")
        self._check_resume()
        if self.save_every and self.out is None:
            raise ValueError("--save-every needs --out DIR (where checkpoints are written)")
        for name in ("tp", "pp_stages"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {v}")
        if self.ckpt_ratio is not None and not 0 <= self.ckpt_ratio <= 1:
            raise ValueError(f"--ckpt-ratio must be in [0, 1], got {self.ckpt_ratio}")
        if self.attention is not None and self.attention not in ("eager", "sdpa", "flash"):
            raise ValueError(f"--attention must be eager, sdpa or flash, got {self.attention!r}")
        if self.ckpt_policy is not None and self.ckpt_policy not in CKPT_POLICIES:
            raise ValueError(f"--ckpt-policy must be one of {', '.join(CKPT_POLICIES)}, got "
                             f"{self.ckpt_policy!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got "
                             f"{self.precision!r}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available here (use --device cpu "
                             "or auto)")
        self._check_engine()

    def _check_inputs(self) -> None:
        """--model, --data, --tokenizer: the paths exist and hold what they should (cheap: the
        data is read in `build`, which reports a bad line or field the same way)."""
        if pretrained.is_model_path(self.model):
            pretrained.model_source(self.model)
        else:
            get_model_spec(self.model)
        if self.data is not None:
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
        if self.dp_shard and ((self.tp or 1) > 1 or (self.pp_stages or 1) > 1):
            raise ValueError("--dp-shard combines with neither --tp > 1 nor --pp-stages > 1 in "
                             "slapo train yet: checkpoints of TP shards inside FSDP2 shards "
                             "would not hold the full tensors, and pipelined FSDP2 optimizer "
                             "state does not resume; drop --dp-shard for TP runs (DDP), and "
                             "run pipelines without data parallelism")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by --grad-accum "
                             f"{self.grad_accum}")

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

    def mixed_precision(self) -> str | None:
        """The `slapo.build(mixed_precision=...)` value: None for fp32."""
        return None if self.precision == "fp32" else self.precision

    def knobs(self) -> dict[str, Any]:
        """`model_schedule.apply` keyword arguments. `--fused-loss` needs an unsharded LM head,
        so with `--tp` > 1 it also turns vocabulary parallelism off (the user asked for it)."""
        knobs = {k: getattr(self, k) for k in KNOBS if getattr(self, k) is not None}
        if knobs.get("fused_loss") and (self.tp or 1) > 1:
            knobs["vocab_parallel"] = False
        if "pp_stages" in knobs and knobs["pp_stages"] > 1:
            knobs["pp_stages"] *= self.stages_per_rank()  # stages to cut, not pipeline ranks
        return knobs

    def size(self, tokenizer=None) -> ModelSize:
        """A registry model's size, with the vocabulary of `tokenizer` (default: bytes)."""
        vocab = {} if tokenizer is None else dict(
            vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id)
        return ModelSize(self.hidden_size, self.num_layers, self.num_heads,
                         max_positions=max(1024, 2 * self.seq_len), dropout=self.dropout,
                         **vocab)


# Options that must match a checkpoint for resuming to continue the same run.
RUN_IDENTITY = ("model", "batch_size", "seq_len", "seed", "hidden_size", "num_layers",
                "num_heads", "dropout", "tp", "pp_stages", "data", "text_field", "tokenizer",
                "val_fraction")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def config_fields() -> dict[str, Any]:
    """{option name: its type annotation string}, for the CLI and TOML parsers."""
    return {f.name: f.type for f in fields(TrainConfig)}


# ---- setup ------------------------------------------------------------------------------------
@dataclass
class Env:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None          # DeviceMesh ("dp", "pp", "tp") under torchrun, else None
    dp: int = 1
    owns_process_group: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(cfg: TrainConfig) -> Env:
    """One process, or join torchrun's job (gloo on CPU, NCCL on CUDA; collectives time out
    after --dist-timeout seconds, so a dead rank fails its peers instead of hanging them)."""
    tp, pp = cfg.tp or 1, cfg.pp_stages or 1
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else (
        dist.get_world_size() if dist.is_initialized() else 1)
    if world % (tp * pp):
        raise ValueError(f"--tp {tp} x --pp-stages {pp} = {tp * pp} does not divide the "
                         f"{world} processes of this job; launch `torchrun --nproc-per-node "
                         f"{tp * pp} -m slapo.cli train ...` (or a multiple of it).")
    dp = world // (tp * pp)
    parts = dp * cfg.grad_accum * cfg.microbatches()
    if cfg.batch_size % parts:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible into {dp} "
                         f"data-parallel ranks x {cfg.grad_accum} accumulation steps x "
                         f"{cfg.microbatches()} micro-batches = {parts}; use a multiple of it.")
    env = Env(world=world, dp=dp)
    if world == 1 and not dist.is_initialized():
        env.device = _local_device(cfg.device)
        return env
    owns = not dist.is_initialized()
    if owns:
        backend = "nccl" if _use_cuda(cfg.device) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout))
    from torch.distributed.device_mesh import init_device_mesh

    env.rank, env.owns_process_group = dist.get_rank(), owns
    env.device = _local_device(cfg.device)
    env.mesh = init_device_mesh(env.device.type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    return env


def _use_cuda(device: str = "auto") -> bool:
    """--device: "cuda" (checked to exist by TrainConfig.check), "cpu", or "auto": CUDA if
    available, or, when a process group already exists, what its backend runs on (NCCL: CUDA)."""
    if device != "auto":
        return device == "cuda"
    if dist.is_initialized():
        return "nccl" in str(dist.get_backend())
    return torch.cuda.is_available()


def _local_device(device: str = "auto") -> torch.device:
    if _use_cuda(device):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def teardown(env: Env) -> None:
    if env.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


# ---- build ------------------------------------------------------------------------------------
@dataclass
class Run:
    """Everything the loop carries from step to step."""

    cfg: TrainConfig
    env: Env
    model: nn.Module            # the (scheduled) HF model: state-dict keys are the HF keys
    optimizer: torch.optim.Optimizer
    step_fn: Any                # batch -> float loss: the runtime's TrainModule.train_step
    data: TokenLoader           # the train loader (its state is saved in checkpoints)
    task: str
    schedule_note: str
    dataset: Data | None = None  # tokenizer, val tokens, where the data came from
    step: int = 0
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    resumed_from: int | None = None
    resume_skipped: list[dict[str, str]] = field(default_factory=list)  # damaged checkpoints

    @property
    def precision(self):
        """The step's `slapo.runtime.precision.Precision` (autocast context, fp16 scaler)."""
        from slapo.runtime.precision import Precision

        owner = getattr(self.step_fn, "__self__", None)
        return getattr(owner, "precision", None) or Precision()


def build(cfg: TrainConfig, env: Env, log=print) -> Run:
    """Data (tokenizer, split, packing), the model (registry config, or a local HF directory
    / config file; same init on every rank), schedule knobs, pretrained weights (each rank
    reads its shards), optimizer."""
    source = pretrained.model_source(cfg.model) if pretrained.is_model_path(cfg.model) else None
    task = source.task() if source is not None else get_model_spec(cfg.model).task
    tokenizer = cfg.tokenizer
    if tokenizer is None and source is not None and source.has_tokenizer():
        tokenizer = str(source.directory)  # the model's own tokenizer
    data = make_data(task, cfg.seq_len, cfg.seed, data=cfg.data, text_field=cfg.text_field,
                     tokenizer=tokenizer, val_fraction=cfg.val_fraction)
    fresh = _model_factory(cfg, source, data)
    torch.manual_seed(cfg.seed)
    model = fresh()
    model, sch, note = schedule(model, cfg, env, log, fresh)
    if source is not None:
        _load_pretrained(sch.mod, source, cfg, env, log)
    model.to(env.device).train()
    optimizer, step_fn = make_trainable(sch, cfg, env)
    _seed_training_rng(cfg.seed, env)
    return Run(cfg, env, model, optimizer, step_fn, data.train, task, note, dataset=data)


def _model_factory(cfg: TrainConfig, source, data: Data):
    """A callable building the model (again, if a schedule knob is not implemented)."""
    if source is None:
        return lambda: build_model(cfg.model, cfg.size(data.tokenizer))[0]
    _check_fits(cfg, source, data)
    return lambda: source.build_empty(dropout=cfg.dropout)


def _check_fits(cfg: TrainConfig, source, data: Data) -> None:
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


def _load_pretrained(model: nn.Module, source, cfg: TrainConfig, env: Env, log) -> None:
    """Fill the (scheduled, maybe sharded) meta model from the source's safetensors; a source
    without weights gets the model's own init (seeded per module, identical on every rank)."""
    from ..init import has_meta_tensors, materialize

    counts = pretrained.load_weights(model, source)
    if counts:
        log(f"loaded {counts['loaded']} tensors from {source.path}"
            + (f" ({counts['unused_keys']} checkpoint tensors unused)"
               if counts["unused_keys"] else ""))
    elif source.directory is not None:
        log(f"{source.path} holds no weights (no model.safetensors): training from a fresh init")
    if has_meta_tensors(model):
        materialize(model, env.device, seed=cfg.seed)


def schedule(model: nn.Module, cfg: TrainConfig, env: Env, log, fresh=None
             ) -> tuple[nn.Module, Any, str]:
    """Apply the schedule knobs with `slapo.model_schedule.apply`, when it exists.

    A missing `apply`, or one that raises NotImplementedError for a knob, is reported and the
    model trains unscheduled (rebuilt from the same seed by `fresh()`, in case the failed apply
    touched it); any other error (an unknown architecture, a bad value) stops the run with its
    message.
    """
    import slapo

    knobs = cfg.knobs()
    if not knobs:
        return model, slapo.create_schedule(model, mesh=env.mesh), \
            "none (no schedule knobs given: HF eager)"
    shown = ", ".join(f"{k}={v}" for k, v in knobs.items())
    try:
        from slapo.model_schedule import apply
    except ImportError:
        note = f"not applied: slapo.model_schedule.apply is not available ({shown} ignored)"
        log(f"warning: schedule {note}; training unscheduled")
        return model, slapo.create_schedule(model, mesh=env.mesh), note
    extra = {"mesh": env.mesh} if env.mesh is not None else {}
    try:
        sch = apply(model, **knobs, **extra)
    except NotImplementedError as e:
        note = f"not applied: {e} ({shown} ignored)"
        log(f"warning: schedule {note}; training unscheduled")
        torch.manual_seed(cfg.seed)
        model = fresh() if fresh is not None else build_model(cfg.model, cfg.size())[0]
        return model, slapo.create_schedule(model, mesh=env.mesh), note
    return sch.mod, sch, f"applied: {shown}"


def make_trainable(sch: Any, cfg: TrainConfig, env: Env
                   ) -> tuple[torch.optim.Optimizer, Any]:
    """`slapo.build` the schedule with AdamW on the mesh; return (optimizer, step fn).

    The step is the runtime's `train_step(batch) -> float`: the same call for one process,
    data parallelism (DDP over the mesh's dp ranks, or FSDP2 with `--dp-shard`, each rank
    taking its slice of the global batch), tensor parallelism (already in the schedule) and
    pipelines (`--pp-stages`, `--pp-schedule`, default 1F1B), `--grad-accum` slices per step,
    with gradient clipping over the whole mesh, in `--precision` (bf16/fp16: autocast on fp32
    master weights; fp16 with a gradient scaler).
    """
    import slapo

    pipeline = cfg.pipeline_schedule()
    trainable, optimizer = slapo.build(
        sch, optimizer=torch.optim.AdamW, seed=cfg.seed, mesh=env.mesh,
        optimizer_kwargs={"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": (0.9, 0.95)},
        grad_clip=cfg.grad_clip, data_parallel=data_parallel(cfg, env),
        pipeline=pipeline, virtual_stages=cfg.stages_per_rank() if pipeline else None,
        grad_accum=cfg.grad_accum, mixed_precision=cfg.mixed_precision())
    return optimizer, trainable.train_step


def data_parallel(cfg: TrainConfig, env: Env) -> str | None:
    """"fsdp" (--dp-shard) or "ddp" over more than one data-parallel rank, else None.

    A pipeline with several data-parallel ranks is refused here, before anything is built:
    `slapo.build` refuses DDP under a pipeline, and `--dp-shard` with one does not resume."""
    if env.dp == 1:
        return None
    if (cfg.pp_stages or 1) > 1:
        raise ValueError(f"--pp-stages {cfg.pp_stages} on {env.world} processes leaves "
                         f"{env.dp} data-parallel ranks, which slapo train cannot combine with "
                         "a pipeline yet (DDP cannot hold a stage; pipelined FSDP2 does not "
                         "resume); run pp_stages x tp processes, or drop --pp-stages")
    return "fsdp" if cfg.dp_shard else "ddp"


def _seed_training_rng(seed: int, env: Env) -> None:
    """Training randomness (dropout): Megatron's streams, distinct per dp/pp rank and per tp
    rank inside tensor-parallel regions, so replicas do not draw identical masks."""
    import slapo

    if env.mesh is None:
        slapo.set_random_seed(seed + 1)
        return
    slapo.set_random_seed(seed + 1, tp_rank=env.mesh.get_local_rank("tp"),
                          dp_rank=env.mesh.get_local_rank("dp"),
                          pp_rank=env.mesh.get_local_rank("pp"))


# ---- step -------------------------------------------------------------------------------------
def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to lr * min_lr_ratio at cfg.steps (step is 0-based).
    A pure function of the step, so resuming needs no scheduler state."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup, 1)
    progress = min((step - cfg.warmup) / span, 1.0)
    ratio = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * ratio


def train_one_step(run: Run) -> float:
    """Draw the next global batch, set the LR, take one optimizer step; return the loss."""
    batch = {k: v.to(run.env.device) for k, v in run.data.next_batch(run.cfg.batch_size).items()}
    for group in run.optimizer.param_groups:
        group["lr"] = lr_at(run.step, run.cfg)
    t0 = time.perf_counter()
    loss = run.step_fn(batch)
    run.step_times.append(time.perf_counter() - t0)
    run.step += 1
    run.losses.append(float(loss))
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at step {run.step}; lower --lr "
                                 "(or check the schedule).")
    return loss


# ---- log --------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    """Start peak-memory accounting now (after build), so it measures training."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 resets the VmHWM (peak resident set) of this process
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated by torch. CPU: peak resident set (VmHWM) of this process."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def trained_parameters(run: Run) -> int:
    """Parameters this rank trains (its TP shards, its pipeline stages, its FSDP2 shards: a
    DTensor counts its local part), counted once."""
    params = {id(p): p for g in run.optimizer.param_groups for p in g["params"]}
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params.values())


def tokens_per_step(cfg: TrainConfig) -> int:
    return cfg.batch_size * cfg.seq_len


def throughput(run: Run) -> float:
    """Tokens/s over this process's steps, skipping the first (warm-up) when there are more."""
    times = run.step_times[1:] if len(run.step_times) > 1 else run.step_times
    return tokens_per_step(run.cfg) * len(times) / sum(times) if times else 0.0


def progress_bar(run: Run):
    from tqdm import tqdm

    return tqdm(total=run.cfg.steps, initial=run.step, desc=f"train {run.cfg.model}",
                disable=not (run.env.is_main and run.cfg.progress), file=sys.stderr,
                dynamic_ncols=True, leave=True)


def log_step(run: Run, bar) -> None:
    tok_s = tokens_per_step(run.cfg) / run.step_times[-1]
    mem = peak_memory_bytes(run.env.device) / 2**20
    skipped = run.precision.skipped_steps
    bar.set_postfix_str(f"loss {run.losses[-1]:.4f}  {tok_s:,.0f} tok/s  peak {mem:,.0f} MiB"
                        + (f"  skipped {skipped}" if skipped else ""), refresh=False)
    bar.update(1)


@torch.no_grad()
def val_loss(run: Run) -> float | None:
    """Mean loss on the first `eval_batches` val batches (fixed, independent of the step)."""
    if run.cfg.eval_batches == 0 or (run.cfg.pp_stages or 1) > 1 or run.dataset is None:
        return None  # with a pipeline no rank holds the whole model
    val = run.dataset.val_loader()
    if val is None:
        _warn(run, f"no val loss: the val split ({len(run.dataset.val_tokens)} tokens) is too "
              f"small for blocks of {run.cfg.seq_len}; raise --val-fraction")
        return None
    was_training = run.model.training
    run.model.eval()
    total = 0.0
    try:
        for _ in range(run.cfg.eval_batches):
            batch = {k: v.to(run.env.device)
                     for k, v in val.next_batch(run.cfg.batch_size).items()}
            with run.precision.autocast():  # evaluate as trained
                total += float(run.model(**batch).loss)
    finally:
        run.model.train(was_training)
    return total / run.cfg.eval_batches


# ---- checkpoint -------------------------------------------------------------------------------
def save(run: Run) -> Path:
    path = ckpt.checkpoint_dir(Path(run.cfg.out), run.step)
    trainer = {"step": run.step, "losses": run.losses, "step_times": run.step_times,
               "data": run.data.state_dict(), "config": asdict(run.cfg),
               "precision": run.precision.state_dict()}  # fp16: the loss scale
    ckpt.save(path, run.model, run.optimizer, trainer, run.env.rank, keep_last=run.cfg.keep_last)
    return path


def _warn(run: Run, message: str) -> None:
    if run.env.is_main:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def pick_checkpoint(run: Run) -> Path | None:
    """Collective. The checkpoint to resume from, verified (marker, sizes, sha256).

    `--resume` (latest): the newest intact checkpoint in --out; newer damaged ones are skipped
    with a warning naming each and why (and recorded in metrics.json as `resume_skipped`).
    None only with --resume-or-start and no checkpoint at all. `--resume DIR`: that checkpoint,
    or an error saying what is wrong with it.
    """
    cfg, env = run.cfg, run.env
    target = cfg.resume_target()
    if target != "latest":
        reason = ckpt.verify_all(Path(target), env.rank, env.world)
        if reason is not None:
            raise ckpt.CheckpointError(target, f"cannot resume: {reason}. `--resume` with no "
                                       "directory picks the newest intact checkpoint in --out.")
        return Path(target)
    path, skipped = ckpt.find_resumable(Path(cfg.out), env.rank, env.world)
    for bad, why in skipped:
        _warn(run, f"skipping checkpoint {bad}: {why}")
        run.resume_skipped.append({"checkpoint": str(bad), "reason": why})
    if path is None and skipped:
        raise ckpt.CheckpointError(Path(cfg.out) / ckpt.CHECKPOINTS, "no intact checkpoint to "
                                   "resume from (every one is listed above with its fault); "
                                   "start a fresh run in another --out, or repair one")
    if path is not None and skipped:
        _warn(run, f"resuming from {path.name}, the newest intact checkpoint")
    return path


def check_identity(cfg: TrainConfig, path: Path, saved: dict[str, Any]) -> None:
    """The options that define the run must match the checkpoint's; checked before any tensor
    is read, so a different model or size gets this message, not a loader error."""
    defaults = TrainConfig()  # a key a checkpoint predates had its default value
    diff = {k: (saved.get(k, getattr(defaults, k)), getattr(cfg, k)) for k in RUN_IDENTITY
            if saved.get(k, getattr(defaults, k)) != getattr(cfg, k)}
    if diff:
        shown = ", ".join(f"--{_flag(k)} {new} (checkpoint: {old})" for k, (old, new) in
                          diff.items())
        raise ValueError(f"cannot resume from {path}: it is a different run: {shown}.")


def resume(run: Run, log=print) -> None:
    """Resume from cfg.resume ("latest" in cfg.out, or a directory): verify, check identity,
    then load weights, optimizer, RNG streams, sampler and history."""
    path = pick_checkpoint(run)
    if path is None:
        log(f"--resume-or-start: no checkpoint in {run.cfg.out}/checkpoints; starting from "
            "step 0")
        return
    trainer = ckpt.read_trainer(path)
    check_identity(run.cfg, path, trainer["config"])
    ckpt.check_world(path, run.env.world)
    ckpt.load(path, run.model, run.optimizer, run.env.rank)
    run.step = trainer["step"]
    run.losses = list(trainer["losses"])
    run.data.load_state_dict(trainer["data"])
    if "precision" in trainer:
        run.precision.load_state_dict(trainer["precision"])
    run.resumed_from = run.step
    log(f"resumed from {path} at step {run.step}")


# ---- finish -----------------------------------------------------------------------------------
def metrics(run: Run, val: float | None, peak: int) -> dict[str, Any]:
    return {
        "losses": run.losses,
        "val_loss": val,
        "tokens_per_s": throughput(run),
        "tokens_per_step": tokens_per_step(run.cfg),
        "step_times_s": run.step_times,
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda max_memory_allocated" if run.env.device.type == "cuda"
        else "process peak RSS (VmHWM)",
        "parameters_on_rank0": trained_parameters(run),
        "steps": run.step,
        "resumed_from": run.resumed_from,
        "resume_skipped": run.resume_skipped,
        "schedule": run.schedule_note,
        "task": run.task,
        "data": run.dataset.source if run.dataset is not None else None,
        "tokenizer": run.dataset.tokenizer.name if run.dataset is not None else None,
        "train_tokens": len(run.data.tokens),
        "precision": run.precision.name,
        "skipped_steps": run.precision.skipped_steps,
        "world_size": run.env.world,
        "device": str(run.env.device),
        "torch": torch.__version__,
        "config": asdict(run.cfg),
    }


def write_metrics(out: Path, data: dict[str, Any]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "metrics.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def plot(out: Path, data: dict[str, Any]) -> Path | None:
    """metrics.png: loss and tokens/s per step (matplotlib, imported only here)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    losses = data["losses"]
    times = data["step_times_s"]
    first = len(losses) - len(times) + 1  # step number of times[0] (after a resume)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(range(1, len(losses) + 1), losses)
    ax1.set(xlabel="step", ylabel="loss", title=f"{data['config']['model']}: training loss")
    ax2.plot(range(first, first + len(times)), [data["tokens_per_step"] / t for t in times])
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    fig.tight_layout()
    path = out / "metrics.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


# ---- the loop ---------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run training as configured; return the metrics (also written to cfg.out on rank 0)."""
    cfg.check()
    env = setup(cfg)
    log = print if env.is_main else (lambda *a, **k: None)
    try:
        run = build(cfg, env, log)
        log(f"slapo train: {cfg.model} ({trained_parameters(run):,} parameters on rank 0), "
            f"{env.world} process(es), device {env.device}, precision {cfg.precision}"
            f"{' (autocast, fp32 master weights)' if cfg.precision != 'fp32' else ''}, "
            f"schedule {run.schedule_note}")
        if cfg.resume_target() is not None:
            resume(run, log)
        reset_peak_memory(env.device)
        bar = progress_bar(run)
        while run.step < cfg.steps:
            train_one_step(run)
            log_step(run, bar)
            if cfg.out and cfg.save_every and run.step % cfg.save_every == 0:
                save(run)
        bar.close()
        if cfg.out and (run.resumed_from != run.step) and not (
                cfg.save_every and run.step % cfg.save_every == 0):
            save(run)  # the final state, unless just saved (or nothing was trained)
        data = metrics(run, val_loss(run), peak_memory_bytes(env.device))
        if cfg.out and env.is_main:
            out = Path(cfg.out)
            write_metrics(out, data)
            if cfg.plot:
                plot(out, data)
        if data["losses"]:
            log(f"done: {run.step} steps, loss {data['losses'][0]:.4f} -> "
                f"{data['losses'][-1]:.4f}, {data['tokens_per_s']:,.0f} tokens/s, peak memory "
                f"{data['peak_memory_bytes'] / 2**20:,.0f} MiB" + (f"; wrote {cfg.out}"
                                                                   if cfg.out else ""))
        return data
    finally:
        teardown(env)
