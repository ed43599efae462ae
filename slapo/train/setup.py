"""Where a `slapo train` run executes: its parallel degrees, mesh, device and random streams.

The run's placement (`ParallelDims`: degrees, data-parallel style, device) is made here once, by
`ParallelDims.for_world` from `--tp`, `--pp-stages`, `--dp-shard`, `--device` and the job's size,
and the mesh by `init_mesh`: `slapo.runtime.mesh` checks the degrees, decides the device and
builds the process groups; nothing here builds a group by hand or checks a degree itself. A single process (no torchrun, no process group) gets no mesh and no process group, as
the CPU tests expect; under torchrun every rank gets the ("dp", "pp", "tp") mesh.

Faults (`faults.py`, docs/train.md "Faults"): a run that creates its process group also starts a
`PeerWatch` (heartbeats through the job's store), and `teardown` records how the rank ends; a
rank that stops on a communication error raises a `PeerFailure` naming the rank that died or
failed. `SLAPO_FAULT` (a test hook) is armed here, for every run.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..data import check_tokenizer_dir
from ..data.prepared import check_prepared, prepared_dir
from ..data.sources import InputError, is_saved_dataset
from ..data.sources import _expand as expand_source
from ..distributed.group import leave_process_group
from ..errors import SchedulingError
from ..runtime.mesh import ParallelDims, device_type, init_mesh, job_world_size, local_device
from . import checkpoints, fault_injection, faults, pretrained, run_owner
from . import run_state as ckpt
from .config_checks import PROGRESSIVE_INPUTS
from .metrics_log import check_sinks
from .models import check_unambiguous, get_model_spec

__all__ = ["Env", "check_inputs", "check_out", "claim_out", "data_parallel", "local_device",
           "seed_training_rng", "setup", "teardown"]


@dataclass
class Env:
    """The run's place in the job: rank, world, device, mesh (None for one process), and the
    placement (`dims`) they were made from."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: Any = None          # DeviceMesh ("dp", "pp", "tp") under torchrun, else None
    dims: ParallelDims = field(default_factory=ParallelDims)
    owns_process_group: bool = False
    watch: faults.PeerWatch | None = None  # heartbeats, when this run made the process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp(self) -> int:
        """Data-parallel ranks (`dims.dp`)."""
        return self.dims.dp


def _check_batch(cfg: Any, dims: ParallelDims) -> None:
    """The global batch must split evenly into dp ranks x accumulation x micro-batches."""
    parts = dims.dp * cfg.grad_accum * cfg.microbatches()
    if cfg.batch_size % parts:
        raise ValueError(f"--batch-size {cfg.batch_size} is not divisible into {dims.dp} "
                         f"data-parallel ranks x {cfg.grad_accum} accumulation steps x "
                         f"{cfg.microbatches()} micro-batches = {parts}; use a multiple of it.")


# ---- the checks that touch files, devices or imports (the value checks: TrainConfig.check) ----
def check_inputs(cfg: Any) -> None:
    """What `TrainConfig.check` cannot see without touching the machine: --model, --data and
    --tokenizer exist and hold what they should (cheap: the data is read in `build`, which
    reports a bad line or field the same way; a path raises InputError, exit status 2), --out is
    a directory, --resume finds a checkpoint (a typo in --out must not silently start over),
    --device cuda has a GPU, `--precision fp8` has torchao and a device with FP8, and the
    asked-for loggers import. Run by `slapo train` and
    `train(cfg)` after `cfg.check()`, before anything is built."""
    _check_model_and_data(cfg)
    if cfg.out is not None and Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out} is a file, not a directory")
    _check_resume_target(cfg)
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available here (use --device cpu "
                         "or auto)")
    _check_fp8(cfg)
    check_sinks(cfg.tensorboard, cfg.wandb)


def _check_fp8(cfg: Any) -> None:
    """`--precision fp8`: torchao imports and the device has FP8 (or is the CPU, emulated),
    before anything is built; the same check `build` makes (`runtime.fp8.check_fp8`)."""
    if cfg.precision != "fp8":
        return
    from ..runtime.fp8 import check_fp8

    try:
        check_fp8(None, device_type(cfg.device))
    except SchedulingError as e:
        raise ValueError(f"--precision fp8: {e.problem} {e.fix}") from None


def _check_model_and_data(cfg: Any) -> None:
    if pretrained.is_model_path(cfg.model):
        source = pretrained.model_source(cfg.model)
        if cfg.progressive:
            raise ValueError(PROGRESSIVE_INPUTS)
        if cfg.ep > 1 and not source.weight_files():
            raise InputError(cfg.model, f"--ep {cfg.ep} needs the model's weights "
                             "(model.safetensors): a fresh init from a config alone is not "
                             "replayed per expert shard yet.", "pass a directory with weights "
                             "(save_pretrained), or a registry model (mixtral, qwen3_moe).")
    else:
        get_model_spec(cfg.model)
        check_unambiguous(cfg.model)  # `slapo train` and `train(cfg)` alike
    if cfg.data is not None and prepared_dir(cfg.data) is not None:
        check_prepared(prepared_dir(cfg.data))  # meta.json and file sizes, no read
    elif cfg.data is not None:
        entries = [e.strip() for e in cfg.data.split(",") if e.strip()]
        if not (len(entries) == 1 and is_saved_dataset(Path(entries[0]))):
            for entry in entries or [""]:
                expand_source(entry)
    if cfg.tokenizer is not None:
        check_tokenizer_dir(cfg.tokenizer)


def _check_resume_target(cfg: Any) -> None:
    target = cfg.resume_target()
    if target is None or target == "latest" and cfg.resume_or_start:
        return
    if target != "latest" and not Path(target).is_dir():
        raise ValueError(f"--resume {target}: no such checkpoint directory")
    if target == "latest" and not checkpoints.candidates(Path(cfg.out)):
        raise ValueError(f"--resume: no checkpoint in {Path(cfg.out) / checkpoints.CHECKPOINTS}; "
                         "drop --resume to start a fresh run there, or pass "
                         "--resume-or-start to resume when a checkpoint exists and start "
                         "fresh otherwise")


def setup(cfg: Any) -> Env:
    """One process, or join torchrun's job through `init_mesh` (gloo on CPU, NCCL on CUDA;
    collectives time out after --dist-timeout seconds, so a dead rank fails its peers instead of
    hanging them). A bad --tp / --pp-stages for the job's size is a SchedulingError naming the
    torchrun command to launch."""
    world = job_world_size()
    dims = placement(cfg, world)
    _check_batch(cfg, dims)
    check_out(cfg)  # every rank, before anything is written
    env = Env(world=world, dims=dims)
    if world == 1 and not dist.is_initialized():
        env.device = dims.local_device()
        fault_injection.install(0)
        return env
    owns = not dist.is_initialized()
    env.mesh = init_mesh(dims=dims, timeout_s=cfg.dist_timeout)
    env.rank, env.owns_process_group = dist.get_rank(), owns
    env.device = dims.local_device()
    fault_injection.install(env.rank)
    if owns:
        env.watch = faults.start_watch(env.rank, world)
    if cfg.out is not None:
        check_shared_out(Path(cfg.out), env.rank)
    return env


def placement(cfg: Any, world: int) -> ParallelDims:
    """The run's one placement: `--tp`, `--pp-stages` and `--cp` as given (None: 1), the other ranks
    data parallel (FSDP2 with `--dp-shard`, else DDP), `--ep` of them per expert-parallel
    group, on `--device`. `ParallelDims` checks the
    degrees; nothing before it does (a DDP pipeline is refused by `data_parallel`)."""
    return ParallelDims.for_world(world, tp=1 if cfg.tp is None else cfg.tp,
                                  pp=1 if cfg.pp_stages is None else cfg.pp_stages,
                                  cp=cfg.cp, ep=cfg.ep, dp_shard=bool(cfg.dp_shard),
                                  device=cfg.device)


def _trains_into_out(cfg: Any) -> bool:
    return cfg.out is not None and not getattr(cfg, "progressive", False)


def check_out(cfg: Any) -> None:
    """A fresh run (no --resume) must not start in a directory that holds a run: it would
    overwrite the run's metrics and mix its checkpoints with the old run's, after which
    `--resume` and `slapo export` could pick the other run's. Refused (InputError: exit status
    2), naming the directory, what it holds and the three ways on, before anything is written
    (every rank, in `setup`, before the process group is used). `--overwrite` replaces the old
    run (`claim_out`); the user's own files never count."""
    if not _trains_into_out(cfg) or cfg.overwrite or cfg.resume_target() is not None:
        return
    found = run_owner.holds_run(Path(cfg.out))
    if found:
        raise InputError(str(cfg.out), f"already holds a run ({', '.join(found)}); a fresh run "
                         "there would overwrite its metrics and mix its checkpoints with the "
                         "new run's.", "pass --resume to continue that run, --overwrite to "
                         "replace it, or another --out directory.")


def claim_out(cfg: Any, env: Env) -> None:
    """Collective; the loop calls it once the run is built (so bad input found while building
    still leaves --out untouched) and before anything is written there. Rank 0: a fresh run
    writes a new run id into `OUT/run.json` (`run_owner.claim`; with --overwrite it then removes
    the old run's outputs), so its checkpoints carry that id and `--resume` / `slapo export`
    take only them. A resumed run keeps the directory's id; a directory without run id and
    without checkpoints (a `--resume DIR` fork, a `--resume-or-start` with nothing to resume)
    gets a new one. Every rank learns how rank 0 fared: a failure there stops every rank now,
    naming it, instead of leaving them waiting in the next collective."""
    if not _trains_into_out(cfg):
        return
    failure, error = None, None
    if env.is_main:
        try:
            out = Path(cfg.out)
            if cfg.resume_target() is None or (run_owner.run_id(out) is None
                                               and not checkpoints.candidates(out)):
                run_owner.claim(out, overwrite=cfg.overwrite)
        except Exception as e:  # noqa: BLE001 - re-raised below, on rank 0 as itself
            failure, error = f"{type(e).__name__}: {e}", e
    failure = ckpt._broadcast(failure)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"rank 0 could not prepare --out {cfg.out}: {failure}")


def check_shared_out(out: Path, rank: int) -> None:
    """Collective. Every rank must see the same --out directory: each writes its shards of a
    checkpoint there and rank 0 publishes it (several nodes need a shared filesystem). Rank 0
    writes a token file; a rank that cannot read it stops the job, on every rank, with the
    ranks named (instead of a missing-file error inside the first checkpoint save)."""
    token = out / f".slapo-shared-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}-{os.getpid()}"
    name = [token.name]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        token.write_text("slapo: --out shared-filesystem check\n")
    dist.broadcast_object_list(name, src=0)
    seen = (out / name[0]).is_file()
    flags: list = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (rank, seen, socket.gethostname()))
    dist.barrier()
    if rank == 0:
        token.unlink(missing_ok=True)
    blind = [f"rank {r} on {host}" for r, ok, host in flags if not ok]
    if blind:
        raise ValueError(f"--out {out} is not shared: {', '.join(blind)} cannot see the files "
                         "rank 0 writes there. Every rank writes its part of each checkpoint "
                         "into --out: on several nodes put it on a filesystem all of them "
                         "mount (the same path everywhere).")


def teardown(env: Env) -> None:
    """Destroy the process group if this run created it (a caller's group stays).

    Called from the loop's `finally`: the exception in flight, if any, is how this rank ends.
    It is recorded for the peers; one caused by a peer (a closed connection, a timeout, the
    launcher's SIGTERM) becomes a `PeerFailure` naming the rank that died or failed. The group
    is then left alone (destroying it can block on a dead peer under NCCL; the process exits)."""
    exc = sys.exc_info()[1]
    comm = faults.is_comm_failure(exc)
    try:
        faults.finish_watch(env.watch, exc)
    finally:
        env.watch = None
        if env.owns_process_group and not comm:
            leave_process_group()


def data_parallel(cfg: Any, env: Env) -> str | None:
    """The placement's data-parallel style: "fsdp" (--dp-shard) or "ddp" over more than one
    data-parallel rank, else None.

    A pipeline with several data-parallel ranks needs --dp-shard, refused here before anything
    is built: DDP cannot hold a pipeline stage (see `slapo.build`). With --cp the cp ranks hold
    the same weights too, so --dp-shard shards over dp x cp even when there is one
    data-parallel rank (`ParallelDims` counts dp_shard in dp ranks only, and would say DDP)."""
    dims = env.dims
    if getattr(cfg, "dp_shard", False) and dims.dp * dims.cp > 1:
        return "fsdp"
    if dims.pp > 1 and dims.data_parallel == "ddp":
        held = f"{dims.dp} data-parallel" + (f" x {dims.cp} cp" if dims.cp > 1 else "")
        raise ValueError(f"--pp-stages {dims.pp} on {env.world} processes leaves {held} "
                         "ranks holding each stage's weights, and DDP cannot hold a pipeline "
                         "stage: add --dp-shard (FSDP2 over those ranks of each stage), or "
                         "run pp_stages x tp processes")
    return dims.data_parallel


def seed_training_rng(seed: int, env: Env) -> None:
    """Training randomness (dropout): Megatron's streams, distinct per dp/pp/cp rank and per tp
    rank inside tensor-parallel regions, so replicas (and cp ranks, which hold other tokens of
    the same rows) do not draw identical masks."""
    from ..distributed.rng import set_random_seed

    if env.mesh is None:
        set_random_seed(seed + 1)
        return
    cp_rank = env.mesh.get_local_rank("cp") if "cp" in env.mesh.mesh_dim_names else 0
    set_random_seed(seed + 1, tp_rank=env.mesh.get_local_rank("tp"),
                    dp_rank=env.mesh.get_local_rank("dp"),
                    pp_rank=env.mesh.get_local_rank("pp"), cp_rank=cp_rank)
