"""Run checkpoints of `slapo train` (DCP): safe to load, crash-safe to write, verified before use.

(Activation checkpointing is another thing: `slapo.primitives.checkpoint`.)

Layout of one checkpoint, `OUT/checkpoints/step_000010/`:
- DCP files (`torch.distributed.checkpoint`): `.metadata` and `__{rank}_{i}.distcp`, the model
  and optimizer state dicts (HF keys; each rank writes its own shards),
- `rng_rank{r}.json`: every RNG stream of rank r (torch, CUDA, python, numpy, Slapo's TP stream),
- `trainer.json`: step, loss history, data-sampler state and the run's config (rank 0),
- `COMPLETE.json`: the completion marker, written last: format version, step, world size, the
  run id of the directory's run, and the size and sha256 of every other file.

Which run a checkpoint belongs to. A fresh run writes a new run id into `OUT/run.json` before
anything else (`claim`), and every checkpoint's `COMPLETE.json` records the run id of the
directory it was saved in. `--resume` and `slapo export` consider only the checkpoints of the
directory's run (`owner_problems`): one copied in from elsewhere, or left behind by the run an
`--overwrite` replaced, is skipped with its reason. A directory without `run.json` (written by
a Slapo before run ids) keeps the old rule: every checkpoint in it is the run's.

Crash safety. Every rank writes into `step_000010.tmp/`; once all are done, each rank hashes its
share of the files, rank 0 writes `COMPLETE.json` (fsynced) and renames the directory to
`step_000010` (an atomic rename on POSIX). A process killed mid-save leaves only a `.tmp`
directory, which nothing reads. On `--resume`, `find_resumable` checks the newest checkpoint
(marker, file list, sizes, checksums) and falls back to the newest intact one, reporting what
it skipped and why. Checksums catch accidents (a truncated copy, a flipped bit, a lost file),
not attacks: anyone who can write a checkpoint can write a matching marker.

Safety against attacks is the loaders': nothing read back can run code.
- JSON files (`trainer.json`, `rng_rank{r}.json`, `COMPLETE.json`) hold only data.
- DCP's `FileSystemReader` unpickles `.metadata` with plain `pickle` and loads non-tensor items
  (optimizer hyper-parameters) with `torch.load(weights_only=False)`. `_SafeReader` replaces the
  first with an unpickler that resolves only DCP's own metadata classes, `torch.Size`,
  dtypes/layouts and paths (any other global is refused before anything is called), and
  `_SafeLoadPlanner` loads the second with `weights_only=True`. Tensors are loaded by DCP with
  `weights_only=True` already. torch 2.13 offers no pickle-free format for this state (its
  safetensors storage holds tensors only, no optimizer hyper-parameters or DTensor shards).

Tensor-parallel parameters are local shards (see `slapo.sharding`), identical in name and shape
on every rank; DCP would take them for replicas and keep one. They are handed to DCP as DTensors
of the full tensor, over their TP group, or over the (dp, tp) mesh when FSDP2 shards them
further (`--dp-shard` with `--tp`): see `shard_layout`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from .. import faultpoints
from ..errors import SlapoError
from ..files import fsync_dir, write_synced
from . import shard_layout

CHECKPOINTS = "checkpoints"
RUN_FILE = "run.json"
# What a `slapo train` run writes into --out besides RUN_FILE (`--overwrite` removes exactly
# these; anything else in the directory is the user's and stays).
RUN_OUTPUTS = (CHECKPOINTS, "metrics.json", "metrics.jsonl", "metrics.csv", "metrics.png",
               "tensorboard", "wandb")
# The ones whose presence means the directory holds a run (a fresh run would damage them).
RUN_MARKS = (CHECKPOINTS, "metrics.json", "metrics.jsonl", "metrics.csv")
TRAINER_FILE = "trainer.json"
MARKER = "COMPLETE.json"
DCP_METADATA = ".metadata"
FORMAT = "slapo-train-checkpoint"
VERSION = 2
_CHUNK = 1 << 20


class CheckpointError(SlapoError):
    """A checkpoint that cannot be used: damaged, unsafe, or from a different run/job shape.

    `path` is the file (or directory) at fault; the message names it and says what to do.
    """

    def __init__(self, path: Path | str, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / CHECKPOINTS / f"step_{step:06d}"


def rng_file(rank: int) -> str:
    return f"rng_rank{rank}.json"


def step_of(path: Path) -> int | None:
    """The step of a published checkpoint directory name (`step_000010`), else None."""
    digits = path.name[5:]
    return int(digits) if path.name.startswith("step_") and digits.isdigit() else None


def candidates(out: Path) -> list[Path]:
    """Every published checkpoint directory in `out` (complete or not), newest first.

    `.tmp` (a save in progress or killed) and `.old` (being replaced) directories are not
    candidates: their names are not `step_` + digits."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of, reverse=True)


def latest(out: Path) -> Path | None:
    """The newest checkpoint in `out` that has a completion marker (not verified: cheap)."""
    return next((p for p in candidates(out) if (p / MARKER).is_file()), None)


# ---- which run a directory and a checkpoint belong to -------------------------------------------
def run_id(out: Path) -> str | None:
    """The run id of the run in `out` (`OUT/run.json`), or None (no run file: a directory from
    a Slapo before run ids, or none yet)."""
    path = Path(out) / RUN_FILE
    if not path.is_file():
        return None
    data = read_json(path)
    if not (isinstance(data, dict) and isinstance(data.get("run_id"), str)):
        raise CheckpointError(path, "not a slapo run file (needs a string run_id)")
    return data["run_id"]


def holds_run(out: Path) -> list[str]:
    """The run outputs in `out` that a fresh run there would overwrite or mix with (published
    checkpoints, metrics); [] when there are none: a missing or empty directory, only the
    user's own files, only the run file of a run that wrote nothing, or only the `.tmp` of a
    killed first save (never read; retention removes it)."""
    out = Path(out)
    found = [f"{CHECKPOINTS}/"] if candidates(out) else []
    return found + [name for name in RUN_MARKS if name != CHECKPOINTS and (out / name).exists()]


def claim(out: Path, *, overwrite: bool = False) -> str:
    """Make `out` a fresh run's: write a new run id into `OUT/run.json` (first, so that any
    checkpoint still there from now on belongs to another run), then, with `overwrite`, remove
    the old run's outputs (`RUN_OUTPUTS`; nothing else). Rank 0 only. Returns the new id."""
    import uuid

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    new = uuid.uuid4().hex
    tmp = out / (RUN_FILE + ".tmp")
    write_synced(tmp, json.dumps({"format": "slapo-train-run", "run_id": new}))
    tmp.replace(out / RUN_FILE)
    fsync_dir(out)
    if overwrite:
        for name in RUN_OUTPUTS:
            p = out / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
    return new


def manifest_run_id(path: Path) -> str | None:
    """The run id a checkpoint's `COMPLETE.json` records (None: not recorded, or unreadable)."""
    try:
        m = read_json(Path(path) / MARKER)
    except CheckpointError:
        return None
    value = m.get("run_id") if isinstance(m, dict) else None
    return value if isinstance(value, str) else None


def owner_problem(path: Path, owner: str | None) -> str | None:
    """Why the checkpoint at `path` is not the run `owner`'s (None: it is, or `owner` is None:
    a directory without run ids, where every checkpoint counts). A checkpoint without a marker
    is left to `verify` to report."""
    if owner is None or not (Path(path) / MARKER).is_file():
        return None
    found = manifest_run_id(path)
    if found == owner:
        return None
    return (f"it belongs to another run (run id {found or 'not recorded'}; this directory's "
            f"run is {owner}): not this run's checkpoint, left alone")


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


# ---- files ------------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path) -> Any:
    """A JSON file, or a CheckpointError naming it (a pickle or garbage in its place)."""
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(path, f"not a JSON file ({e}); refusing to read it any other "
                              "way") from None


# ---- RNG state as JSON ------------------------------------------------------------------------
def _bytes_to_json(t: torch.Tensor) -> str:
    return base64.b64encode(bytes(t.to(torch.uint8).reshape(-1).tolist())).decode("ascii")


def _bytes_from_json(text: str) -> torch.Tensor:
    return torch.tensor(list(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    """Every RNG stream of this process as JSON-able data (byte states base64-encoded)."""
    from ..distributed.rng import get_rng_tracker

    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _bytes_to_json(torch.get_rng_state()),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
        "slapo_tracker": {name: [_bytes_to_json(cpu), None if cuda is None
                                 else _bytes_to_json(cuda)]
                          for name, (cpu, cuda) in get_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = [_bytes_to_json(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:  # pragma: no cover
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (raises KeyError/TypeError/ValueError on bad data)."""
    from ..distributed.rng import get_rng_tracker

    torch.set_rng_state(_bytes_from_json(state["torch"]))
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["internal"]),
                     None if py["gauss_next"] is None else float(py["gauss_next"])))
    get_rng_tracker().set_states({
        str(name): (_bytes_from_json(cpu), None if cuda is None else _bytes_from_json(cuda))
        for name, (cpu, cuda) in state["slapo_tracker"].items()})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_bytes_from_json(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((str(n["kind"]), np.array(n["keys"], dtype=np.uint32),
                             int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))


def load_rng(path: Path) -> None:
    """Restore this rank's RNG streams from its JSON file, naming the file on bad data."""
    state = read_json(path)
    try:
        set_rng_state(state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        raise CheckpointError(path, f"not a valid RNG state ({type(e).__name__}: {e})") from None


# ---- safe DCP reading -------------------------------------------------------------------------
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                "PureWindowsPath"},
    "pathlib._local": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath",
                       "PureWindowsPath"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the classes DCP's metadata is made of (data holders with no side effects),
    plus torch dtype/layout/memory-format constants; refuses every other global, so a crafted
    `.metadata` cannot reach `os.system`, `eval`, `builtins.getattr` or any importer."""

    def __init__(self, fh, path: Path):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and not name.startswith("_"):
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise CheckpointError(self.path, f"refusing to unpickle {module}.{name}: not part of "
                              "DCP checkpoint metadata (a crafted or foreign file?)")


def _plain_name(name: str) -> bool:
    """A file name inside the checkpoint directory: no separators, no `..`."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name


class _SafeReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled by `_MetadataUnpickler`, and every storage
    entry checked to name a file inside the checkpoint directory."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        path = Path(str(self.path)) / name
        try:
            with open(path, "rb") as fh:
                metadata = _MetadataUnpickler(fh, path).load()
        except CheckpointError:
            raise
        except FileNotFoundError:
            raise CheckpointError(path, "missing") from None
        except Exception as e:  # noqa: BLE001 - any unpickling failure: a damaged file
            raise CheckpointError(path, f"not readable DCP metadata ({type(e).__name__}: "
                                  f"{e})") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(path, f"holds a {type(metadata).__name__}, not DCP Metadata")
        for info in (metadata.storage_data or {}).values():
            if not _plain_name(str(getattr(info, "relative_path", ""))):
                raise CheckpointError(path, f"names a file outside the checkpoint: {info!r}")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


    def read_data(self, plan, planner):
        """DCP's reader (tensors with `weights_only=True`), with a failure naming the file(s)
        this rank was reading instead of torch's bare unpickling message."""
        try:
            return super().read_data(plan, planner)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a refused or damaged tensor record
            files = sorted({self.storage_data[item.storage_index].relative_path
                            for item in plan.items if item.storage_index in self.storage_data})
            where = Path(str(self.path)) / (files[0] if len(files) == 1 else
                                            "{" + ",".join(files) + "}")
            raise CheckpointError(where, f"refusing to load a tensor record: {_reason(e)}"
                                  ) from None


def _reason(e: BaseException) -> str:
    """The informative line of a loader error (torch's weights-only refusal names the global
    it refused several lines down)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    named = [x for x in lines if "GLOBAL" in x or "Unsupported" in x]
    return f"{type(e).__name__}: {(named or lines or [''])[0][:300]}"


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, loading non-tensor items (optimizer hyper-parameters: floats,
    tuples, strings, None) with `torch.load(weights_only=True)` instead of a full unpickle."""

    def __init__(self, checkpoint_dir: Path | str = "") -> None:
        super().__init__()
        self.checkpoint_dir = checkpoint_dir  # for error messages

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:  # noqa: BLE001 - the weights-only unpickler refused it
            info = (getattr(self, "metadata", None) and
                    self.metadata.storage_data.get(read_item.storage_index))
            where = getattr(info, "relative_path", "a .distcp file")
            where = Path(str(getattr(self, "checkpoint_dir", ""))) / where
            raise CheckpointError(where, f"refusing to load {fqn!r}: not plain data "
                                  f"({_reason(e)})") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _first_checkpoint_error(e: BaseException) -> BaseException:
    """DCP wraps per-rank failures in a CheckpointException: dig out ours, if any."""
    failures = getattr(e, "failures", None) or {}
    inner = [pair[0] if isinstance(pair, tuple) else pair for _, pair in sorted(failures.items())]
    return next((x for x in inner if isinstance(x, CheckpointError)), inner[0] if inner else e)


# ---- the state handed to DCP ------------------------------------------------------------------
def _state(model: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True
           ) -> tuple[dict, dict, bool, shard_layout.Layout]:
    """{"model", "optim"} state dicts to hand DCP (TP shards as DTensors of the full tensors:
    `shard_layout`), the shard specs, whether the model part is partial, and the layout that
    restores loaded values. Only the parameters this rank trains (those in its optimizer) are
    included: with a pipeline, a rank also holds other stages' untrained copies, which must not
    be saved. A collective (the layout may gather over data-parallel ranks).

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
    model_sd = {k: v for k, v in model_sd.items() if k not in foreign}
    specs = shard_layout.shard_specs(model)
    state = {"model": model_sd, "optim": optim_sd}
    layout = shard_layout.Layout()
    if specs:
        with torch.no_grad():
            state = shard_layout.convert(state, specs, layout.to_saved)
    return state, specs, bool(foreign), layout


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
        if not (_plain_name(name) and isinstance(entry, dict) and isinstance(entry.get("size"),
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


def own_candidates(out: Path) -> list[Path]:
    """`candidates` of the directory's own run (see `owner_problem`)."""
    owner = run_id(out)
    return [p for p in candidates(out) if owner_problem(p, owner) is None]


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


def prune(out: Path, step: int, keep_last: int) -> list[Path]:
    """Retention: keep the `keep_last` newest checkpoints up to `step` (0: keep all); remove
    older ones and stale `.tmp`/`.old` directories of earlier steps. Checkpoints of later steps
    (from a run this one resumed behind) and other runs' checkpoints are left alone. Returns
    what was removed."""
    root = Path(out) / CHECKPOINTS
    removed = []
    for p in root.iterdir() if root.is_dir() else ():
        stem, _, suffix = p.name.partition(".")
        if suffix in ("tmp", "old") and stem[5:].isdigit() and int(stem[5:]) < step:
            removed.append(p)
    if keep_last > 0:
        removed += [p for p in own_candidates(out) if step_of(p) <= step][keep_last:]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer: dict[str, Any], rank: int, keep_last: int = 0) -> None:
    """Collective: every rank calls it. `trainer` (JSON-able) is written by rank 0.

    Write into `path.tmp`, hash, mark complete, rename: a crash at any point leaves either the
    previous checkpoints untouched plus a `.tmp` directory, or a complete, verified `path`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier()
    state, _, _, _ = _state(model, optimizer)
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
        prune(path.parent.parent, int(trainer["step"]), keep_last)
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
         rng: bool = True) -> None:
    """Collective. Load weights, optimizer state and (`rng`) this rank's RNG streams from a
    verified checkpoint, with loaders that run no code from the files (see the module
    docstring). DCP reads each tensor into whatever this job's model holds (a replica, an FSDP2
    shard), so another number of data-parallel ranks loads the same values."""
    metadata = _SafeReader(str(path)).read_metadata()  # a refused one: our error, before DCP's
    flat = _flat_optimizer(metadata)
    state, specs, partial, layout = _state(model, optimizer, flat)
    reshaped = _read_whole_where_reshaped(state, metadata)
    try:
        with _quiet_single_process():
            dcp.load(state, storage_reader=_SafeReader(str(path)), planner=_SafeLoadPlanner(path),
                     no_dist=not dist.is_initialized())
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        inner = _first_checkpoint_error(e)
        if isinstance(inner, CheckpointError):
            raise inner from None
        raise CheckpointError(path, "could not load the model/optimizer state: "
                              f"{_reason(inner)}") from None
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
        raise CheckpointError(path, f"does not fit this model/optimizer: {_reason(e)}") from None
    if rng:
        load_rng(Path(path) / rng_file(rank))
