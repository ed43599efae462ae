"""Run checkpoints of `slapo train` (DCP): crash-safe to write, verified before use, loaded.

(Activation checkpointing is another thing: `slapo.primitives.checkpoint`.) What one checkpoint
holds: `checkpoints.py`; which run it belongs to: `run_owner.py`; reading it back without
running code: `checkpoint_read.py`; the RNG files: `run_rng.py`.

Crash safety. Every rank writes into `step_000010.tmp/`; once all are done, each rank hashes its
share of the files, rank 0 writes `COMPLETE.json` (fsynced) and renames the directory to
`step_000010` (an atomic rename on POSIX). A process killed mid-save leaves only a `.tmp`
directory, which nothing reads. On `--resume`, `find_resumable` checks the newest checkpoint
(marker, file list, sizes, checksums) and falls back to the newest intact one, reporting what
it skipped and why. Checksums catch accidents (a truncated copy, a flipped bit, a lost file),
not attacks: anyone who can write a checkpoint can write a matching marker.

Tensor-parallel parameters are local shards (see `slapo.sharding`), identical in name and shape
on every rank; DCP would take them for replicas and keep one. They are handed to DCP as DTensors
of the full tensor, over their TP group, or over the (dp, tp) mesh when FSDP2 shards them
further (`--dp-shard` with `--tp`): see `shard_layout`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from .. import faultpoints
from ..files import fsync_dir, write_synced
from . import shard_layout
from .checkpoint_read import SafeLoadPlanner, SafeReader, error_reason, first_checkpoint_error
from .checkpoints import (
    CHECKPOINTS,
    DCP_METADATA,
    FORMAT,
    MARKER,
    TRAINER_FILE,
    VERSION,
    CheckpointError,
    candidates,
    plain_name,
    read_json,
    rng_file,
    sha256,
    step_of,
)
from .run_owner import manifest_run_id, own_candidates, owner_problem, run_id
from .run_rng import load_rng, rng_state


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes one process when torch.distributed is not initialised: that
    is exactly our single-process case, so the warning is noise."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---- collectives (no-ops in one process) ------------------------------------------------------
def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (a small Python value; pickled between the job's own processes)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _broadcast(obj: Any) -> Any:
    """Rank 0's `obj` on every rank, so all ranks act on one directory listing."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- the state handed to DCP ------------------------------------------------------------------
def _state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True,
           parts: list[nn.Module] | None = None
           ) -> tuple[dict, dict, bool, shard_layout.Layout]:
    """{"model", "optim"} state dicts to hand DCP (TP shards as DTensors of the full tensors:
    `shard_layout`), the shard specs, whether the model part is partial, and the layout that
    restores loaded values. Only the parameters this rank trains (those in its optimizer) are
    included: with a pipeline, a rank also holds other stages' untrained copies, which must not
    be saved. Likewise the buffers that none of this rank's `parts` (its pipeline stages: the
    trainer's parts) holds (`_foreign_buffers`). A collective (the layout may gather over
    data-parallel ranks).

    `flat`: the optimizer's hyper-parameters keyed by parameter name (`param_groups.<fqn>.lr`,
    as torchtitan saves them), not by group index. Pipeline stages hold different parameters
    under the same group index, and DCP keeps one rank's copy of an equal key: with index keys
    a stage resumed another stage's group (its parameter list and all), which FSDP2 turned into
    a group without hyper-parameters. Checkpoints written before this (index keys) still load
    (`_flat_optimizer`)."""
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=flat))
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    foreign = {name for name, p in model.named_parameters(remove_duplicate=False)
               if id(p) not in owned}
    if foreign:  # a pipeline rank (or a LoRA run): some of the model is not this rank's
        foreign |= _foreign_buffers(model, parts)
    model_sd = {k: v for k, v in model_sd.items() if k not in foreign}
    specs = shard_layout.shard_specs(model)
    state = {"model": model_sd, "optim": optim_sd}
    layout = shard_layout.Layout()
    if specs:
        with torch.no_grad():
            state = shard_layout.convert(state, specs, layout.to_saved)
    return state, specs, bool(foreign), layout


def _foreign_buffers(model: nn.Module, parts: list[nn.Module] | None) -> set[str]:
    """The names of `model`'s buffers that none of `parts` holds: with a pipeline, another
    stage's. A rank keeps such a buffer at its constructor value (its stage never loads or
    updates it: DeepSeek-V3's router `e_score_correction_bias`, which `--router-bias-rate`
    moves every step), while the owning stage's rank holds the trained value under the same
    name. DCP keeps *one* rank's copy of an equal key (the rank with the fewest bytes planned so
    far, not the owner), so saving both wrote the stale copy for some layers: export and resume
    then silently had the initial biases. `parts` None: every buffer is this rank's (so is
    every buffer of a rank that trains all of the model's parameters: `_state` asks only
    otherwise)."""
    if parts is None:
        return set()
    held = {id(b) for part in parts for b in part.buffers()}
    return {name for name, b in model.named_buffers(remove_duplicate=False)
            if id(b) not in held}


# ---- completion marker and verification -------------------------------------------------------
def _hash_share(tmp: Path, names: list[str], rank: int, world: int) -> dict[str, dict]:
    """{name: {size, sha256}} for this rank's share of the files (every world-th)."""
    return {n: {"size": (tmp / n).stat().st_size, "sha256": sha256(tmp / n)}
            for n in names[rank::world]}


def _write_marker(tmp: Path, step: int, world: int, files: dict[str, dict],
                  run: str | None = None) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
                "hash": "sha256", "files": dict(sorted(files.items()))}
    if run is not None:
        manifest["run_id"] = run
    write_synced(tmp / MARKER, json.dumps(manifest, indent=1))
    fsync_dir(tmp)


def read_manifest(path: Path) -> dict[str, Any]:
    """The checkpoint's `COMPLETE.json`, checked for shape; CheckpointError if absent or bad."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        raise CheckpointError(path, f"no {MARKER} (a save that never finished, or a checkpoint "
                              "from an older Slapo, whose RNG files are unsafe pickles)")
    m = read_json(marker)
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") == VERSION
          and isinstance(m.get("step"), int) and isinstance(m.get("world_size"), int)
          and m["world_size"] >= 1 and isinstance(m.get("files"), dict))
    if not ok:
        raise CheckpointError(marker, f"not a {FORMAT} v{VERSION} completion marker")
    files = m["files"]
    for name, entry in files.items():
        if not (plain_name(name) and isinstance(entry, dict) and isinstance(entry.get("size"),
                int) and isinstance(entry.get("sha256"), str)):
            raise CheckpointError(marker, f"bad file entry {name!r}: {entry!r}")
    needed = [DCP_METADATA, TRAINER_FILE, *(rng_file(r) for r in range(m["world_size"]))]
    missing = [n for n in needed if n not in files]
    if missing:
        raise CheckpointError(marker, f"does not list {', '.join(missing)}")
    return m


def verify(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Why the checkpoint at `path` is not intact, or None. Checks the marker, that every
    listed file exists with its size, and the sha256 of this rank's share of the files (with
    `world` ranks each hashing every world-th file; `verify_all` combines them)."""
    try:
        files = read_manifest(path)["files"]
    except CheckpointError as e:
        return e.problem if e.path == Path(path) else f"{e.path.name}: {e.problem}"
    for name in sorted(files):
        f = Path(path) / name
        if not f.is_file():
            return f"missing file {name}"
        size, want = f.stat().st_size, files[name]["size"]
        if size != want:
            return f"{name} has {size} bytes, {want} expected ({'truncated' if size < want else 'grown'})"
    for name in sorted(files)[rank::world]:
        if sha256(Path(path) / name) != files[name]["sha256"]:
            return f"{name} does not match its sha256 in {MARKER} (corrupted: flipped bytes?)"
    return None


def verify_all(path: Path, rank: int = 0, world: int = 1) -> str | None:
    """Collective `verify`: every rank hashes its share; all ranks get the same answer."""
    reasons = _all_gather(verify(path, rank, world))
    return next((r for r in reasons if r is not None), None)


def find_resumable(out: Path, rank: int = 0, world: int = 1
                   ) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Collective. The newest intact checkpoint in `out` (or None), and the newer ones skipped
    with the reason each was skipped (newest first)."""
    root = Path(out) / CHECKPOINTS
    # decided on rank 0 for all: every rank must make the same `verify_all` calls
    names, foreign = _broadcast(_listing(Path(out)))
    skipped: list[tuple[Path, str]] = []
    for name in names:
        reason = foreign.get(name) or verify_all(root / name, rank, world)
        if reason is None:
            return root / name, skipped
        skipped.append((root / name, reason))
    return None, skipped


def _listing(out: Path) -> tuple[list[str], dict[str, str]]:
    """The checkpoint names in `out` (newest first) and, by name, why one is another run's."""
    owner = run_id(out)
    paths = candidates(out)
    foreign = {p.name: why for p in paths if (why := owner_problem(p, owner)) is not None}
    return [p.name for p in paths], foreign


# ---- save -------------------------------------------------------------------------------------
def _publish(tmp: Path, path: Path) -> None:
    """Rename the finished `tmp` to `path` atomically; an existing `path` (the same step saved
    by an earlier run) is moved aside first and removed after. One of another run (see
    `owner_problem`) is not this run's to delete: it is kept, renamed `step_N.other-run-ID`
    (a name no resume or export reads)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists() and owner_problem(path, run_id(path.parent.parent)) is not None:
        other = manifest_run_id(path) or "unknown"
        path.rename(path.with_name(f"{path.name}.other-run-{other}"))
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def prune(out: Path, step: int, keep_last: int, keep_step: int | None = None) -> list[Path]:
    """Retention: keep the `keep_last` newest checkpoints up to `step` (0: keep all); remove
    older ones and stale `.tmp`/`.old` directories of earlier steps. Checkpoints of later steps
    (from a run this one resumed behind) and other runs' checkpoints are left alone, and so is
    the one of `keep_step` (`--keep-best`). Returns what was removed."""
    root = Path(out) / CHECKPOINTS
    removed = []
    for p in root.iterdir() if root.is_dir() else ():
        stem, _, suffix = p.name.partition(".")
        if suffix in ("tmp", "old") and stem[5:].isdigit() and int(stem[5:]) < step:
            removed.append(p)
    if keep_last > 0:
        removed += [p for p in own_candidates(out) if step_of(p) <= step][keep_last:]
        removed = [p for p in removed if keep_step is None or step_of(p) != keep_step]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer: dict[str, Any], rank: int, keep_last: int = 0,
         keep_step: int | None = None, parts: list[nn.Module] | None = None) -> None:
    """Collective: every rank calls it. `trainer` (JSON-able) is written by rank 0. `parts`:
    the modules this rank runs (with a pipeline, its stages; see `_state`).

    Write into `path.tmp`, hash, mark complete, rename: a crash at any point leaves either the
    previous checkpoints untouched plus a `.tmp` directory, or a complete, verified `path`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state, _, _, _ = _state(model, optimizer, parts=parts)
    with _quiet_single_process():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
    write_synced(tmp / rng_file(rank), json.dumps(rng_state()))
    if rank == 0:
        write_synced(tmp / TRAINER_FILE, json.dumps(trainer))
    faultpoints.reach("save", int(trainer["step"]))  # test hook: die mid-save (SLAPO_FAULT)
    _barrier()
    names = _broadcast(sorted(p.name for p in tmp.iterdir() if p.name != MARKER))
    shares = _all_gather(_hash_share(tmp, names, rank, world))
    if rank == 0:
        _write_marker(tmp, int(trainer["step"]), world, {k: v for s in shares
                                                          for k, v in s.items()},
                      run=run_id(path.parent.parent))
        _publish(tmp, path)
        prune(path.parent.parent, int(trainer["step"]), keep_last, keep_step)
    _barrier()


# ---- load -------------------------------------------------------------------------------------
def read_trainer(path: Path) -> dict[str, Any]:
    """The checkpoint's `trainer.json` (JSON: step, losses, data, config), read before any
    tensor so the caller can check the run's identity first."""
    trainer = read_json(Path(path) / TRAINER_FILE)
    keys = ("step", "losses", "data", "config")
    if not (isinstance(trainer, dict) and all(k in trainer for k in keys)
            and isinstance(trainer["config"], dict)):
        raise CheckpointError(Path(path) / TRAINER_FILE, f"not a trainer state (needs "
                              f"{', '.join(keys)})")
    return trainer


def saved_world(path: Path) -> int:
    """How many processes wrote the checkpoint."""
    return int(read_manifest(path)["world_size"])


def _flat_optimizer(metadata) -> bool:
    """Whether a checkpoint keys optimizer hyper-parameters by parameter name (see `_state`);
    those written before that key them by group index (`optim.param_groups.0.params`)."""
    return not any(k.startswith("optim.param_groups.") and k.endswith(".params")
                   and k.split(".")[2].isdigit() for k in metadata.state_dict_metadata)


def _read_whole_where_reshaped(state: dict, metadata) -> dict[tuple[str, str], torch.Tensor]:
    """Entries saved in another reshape of the same tensor than this job holds: a fused q|k|v
    is saved as (.., blocks, rest) under --tp and as HF's (.., blocks * rest) without it, and
    under --tp with --dp-shard some axes are split further (`shard_layout`). Every layout is a
    reshape of the full tensor, never a permutation, so the element order is the same: such an
    entry is read whole into a CPU tensor of the saved shape (replaced in `state`), and
    `_scatter_reshaped` copies this rank's part into the original after the load. Returns the
    originals by (part, key); an entry whose element count differs is left for DCP to refuse."""
    saved = metadata.state_dict_metadata
    originals = {}
    for part, entries in state.items():
        for key, value in list(entries.items()):
            meta = saved.get(f"{part}.{key}")
            if not isinstance(value, torch.Tensor) or not hasattr(meta, "size"):
                continue
            shape = torch.Size(meta.size)
            if shape == value.shape or shape.numel() != value.numel():
                continue
            originals[part, key] = value
            entries[key] = torch.empty(shape, dtype=value.dtype)
    return originals


def _scatter_reshaped(state: dict, originals: dict[tuple[str, str], torch.Tensor]) -> None:
    """Copy each whole entry read by `_read_whole_where_reshaped`, reshaped to this job's full
    shape, into this rank's part of the original (a DTensor's local chunk, computed from the
    whole tensor on every rank, no communication), and put the original back."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for (part, key), original in originals.items():
        whole = state[part][key].reshape(original.shape)
        with torch.no_grad():
            if isinstance(original, DTensor):
                mine = distribute_tensor(whole.to(original.device), original.device_mesh,
                                         original.placements, src_data_rank=None)
                original.to_local().copy_(mine.to_local())
            else:
                original.copy_(whole)
        state[part][key] = original


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
         rng: bool = True, parts: list[nn.Module] | None = None) -> None:
    """Collective. Load weights, optimizer state and (`rng`) this rank's RNG streams from a
    verified checkpoint, with loaders that run no code from the files (see the module
    docstring). DCP reads each tensor into whatever this job's model holds (a replica, an FSDP2
    shard), so another number of data-parallel ranks loads the same values. `parts`: as for
    `save` (another pipeline stage's buffers are neither saved nor loaded)."""
    metadata = SafeReader(str(path)).read_metadata()  # a refused one: our error, before DCP's
    flat = _flat_optimizer(metadata)
    state, specs, partial, layout = _state(model, optimizer, flat, parts)
    reshaped = _read_whole_where_reshaped(state, metadata)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path),
                     no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        inner = first_checkpoint_error(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(path, "could not load the model/optimizer state: "
                              f"{error_reason(inner)}") from None
    _scatter_reshaped(state, reshaped)
    if specs:
        with torch.no_grad():
            state = shard_layout.convert(state, specs, layout.restore)
    try:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=not partial,
                                                flatten_optimizer_state_dict=flat))
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(path, "does not fit this model/optimizer: "
                              f"{error_reason(e)}") from None
    if rng:
        load_rng(Path(path) / rng_file(rank))
