"""Where a run's checkpoints live and what one holds: names, the layout, `CheckpointError`.

Layout of one checkpoint, `OUT/checkpoints/step_000010/`:
- DCP files (`torch.distributed.checkpoint`): `.metadata` and `__{rank}_{i}.distcp`, the model
  and optimizer state dicts (HF keys; each rank writes its own shards),
- `rng_rank{r}.json`: every RNG stream of rank r (torch, CUDA, python, numpy, Slapo's TP stream),
- `trainer.json`: step, loss history, data-sampler state and the run's config (rank 0),
- `COMPLETE.json`: the completion marker, written last: format version, step, world size, the
  run id of the directory's run, and the size and sha256 of every other file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import SlapoError

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


def plain_name(name: str) -> bool:
    """A file name inside the checkpoint directory: no separators, no `..`."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name
