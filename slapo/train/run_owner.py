"""Which run a directory and a checkpoint belong to (run ids), and a fresh run's claim on --out.

Which run a checkpoint belongs to. A fresh run writes a new run id into `OUT/run.json` before
anything else (`claim`), and every checkpoint's `COMPLETE.json` records the run id of the
directory it was saved in. `--resume` and `slapo export` consider only the checkpoints of the
directory's run (`owner_problems`): one copied in from elsewhere, or left behind by the run an
`--overwrite` replaced, is skipped with its reason. A directory without `run.json` (written by
a Slapo before run ids) keeps the old rule: every checkpoint in it is the run's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ..files import fsync_dir, write_synced
from .checkpoints import (
    CHECKPOINTS,
    MARKER,
    RUN_FILE,
    RUN_MARKS,
    RUN_OUTPUTS,
    CheckpointError,
    candidates,
    read_json,
)


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


def own_candidates(out: Path) -> list[Path]:
    """`candidates` of the directory's own run (see `owner_problem`)."""
    owner = run_id(out)
    return [p for p in candidates(out) if owner_problem(p, owner) is None]
