"""Resumable trial database (SQLite, stdlib only).

Every measured config is committed as soon as its trial ends, keyed by the canonical config key,
so a tuning run that is killed can be restarted and skips what it already measured. SQLite gives
atomic commits and tolerates a crash mid-write, which a hand-written JSON file does not.
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .space import Config, config_key

STATUSES = ("ok", "failed", "oom", "timeout")


@dataclass
class Record:
    """One finished trial."""

    config: Config
    status: str
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    predicted: dict[str, Any] = field(default_factory=dict)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Database:
    """Trial records keyed by config. `path=":memory:"` keeps them in memory only."""

    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path)
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS trials (key TEXT PRIMARY KEY, seq INTEGER, config TEXT, "
            "status TEXT, metrics TEXT, error TEXT, predicted TEXT, elapsed REAL, ts REAL)"
        )
        self._conn.commit()

    def commit(self, record: Record) -> None:
        """Store (or overwrite) the record of one config, durably; an overwrite keeps its place."""
        if record.status not in STATUSES:
            raise ValueError(f"status {record.status!r} is not one of {STATUSES}.")
        key = config_key(record.config)
        with self._conn:
            row = self._conn.execute("SELECT seq FROM trials WHERE key = ?", (key,)).fetchone()
            seq = row[0] if row else self._conn.execute(
                "SELECT COALESCE(MAX(seq), 0) + 1 FROM trials").fetchone()[0]
            self._conn.execute(
                "INSERT OR REPLACE INTO trials VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    seq,
                    json.dumps(record.config, sort_keys=True),
                    record.status,
                    json.dumps(record.metrics, sort_keys=True, default=float),
                    record.error,
                    json.dumps(record.predicted, sort_keys=True, default=float),
                    float(record.elapsed_s),
                    time.time(),
                ),
            )

    def get(self, config: Config) -> Record | None:
        row = self._conn.execute(
            "SELECT config, status, metrics, error, predicted, elapsed FROM trials WHERE key = ?",
            (config_key(config),),
        ).fetchone()
        return None if row is None else self._record(row)

    def __contains__(self, config: Config) -> bool:
        return self.get(config) is not None

    def records(self) -> list[Record]:
        """All records in the order they were committed."""
        rows = self._conn.execute(
            "SELECT config, status, metrics, error, predicted, elapsed FROM trials ORDER BY seq"
        ).fetchall()
        return [self._record(r) for r in rows]

    def __len__(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM trials").fetchone()[0]

    def best(self, objective: str, maximize: bool = True) -> Record | None:
        """Best successful record by `metrics[objective]`."""
        ok = [r for r in self.records() if r.ok and objective in r.metrics]
        if not ok:
            return None
        sign = 1.0 if maximize else -1.0
        return max(ok, key=lambda r: sign * float(r.metrics[objective]))

    def close(self) -> None:
        self._conn.close()

    @staticmethod
    def _record(row: tuple) -> Record:
        config, status, metrics, error, predicted, elapsed = row
        return Record(
            json.loads(config), status, json.loads(metrics), error, json.loads(predicted), elapsed
        )
