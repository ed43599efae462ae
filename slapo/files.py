"""Durable file writes: the one place that knows how to make a write survive a crash.

Used by `slapo train`'s checkpoints (`train/run_state.py`) and `slapo prepare-data`
(`data/prepared.py`), both of which publish a directory by an atomic rename only after its
contents are on disk.
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (no-op where directories cannot be
    opened, e.g. Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_synced(path: Path, text: str) -> None:
    """Write `text` and fsync the file before returning."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
