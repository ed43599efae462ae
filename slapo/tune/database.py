"""Resumable trial database (SQLite, stdlib only).

Every measured config is committed as soon as its trial ends, keyed by the canonical config key,
so a tuning run that is killed can be restarted and skips what it already measured. SQLite gives
atomic commits and tolerates a crash mid-write, which a hand-written JSON file does not.

An existing file is checked before it is written to (opened read-only): it must be SQLite, hold
the `trials` table with these columns, carry a schema version this code knows (`PRAGMA
user_version`; 0 is the unversioned layout of earlier releases, the same columns), and every
row must decode (JSON objects, a known status). Anything else is a `DatabaseError` naming the
file and the row, raised before the file is touched: a typo'd `--db` pointing at another file,
a truncated copy or a hand-edited row never gets a trials table added, rows rewritten, or a
search started on half-read records. Rows are data only (JSON, never pickle): nothing in the
file is executed.
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
SCHEMA_VERSION = 1
COLUMNS = ("key", "seq", "config", "status", "metrics", "error", "predicted", "elapsed", "ts")


class DatabaseError(ValueError):
    """A trial database file that cannot be used as it is (named, with the reason)."""

    def __init__(self, path: str | Path, problem: str, fix: str):
        self.path, self.problem, self.fix = str(path), problem, fix
        super().__init__(f"trial database {path}: {problem} Fix: {fix}")


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
        fresh = self.path == ":memory:" or not Path(self.path).exists()
        if not fresh:
            check_file(Path(self.path))  # read-only: a bad file is left exactly as it is
        else:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(self.path)
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS trials (key TEXT PRIMARY KEY, seq INTEGER, config TEXT, "
            "status TEXT, metrics TEXT, error TEXT, predicted TEXT, elapsed REAL, ts REAL)"
        )
        if fresh:
            self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
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


# ---- checking a file before using it ------------------------------------------------------------
def check_file(path: Path) -> None:
    """Raise `DatabaseError` unless `path` is a trial database this code can read and extend.
    Opens it read-only (`mode=ro`): nothing is created or changed, whatever the file holds."""
    if path.is_dir():
        raise DatabaseError(path, "is a directory.", "pass a file path to --db (e.g. "
                            "OUT/tune.db).")
    try:
        conn = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    except sqlite3.Error as e:
        raise DatabaseError(path, f"cannot be opened ({e}).", "check the path and its "
                            "permissions.") from None
    try:
        _check_schema(path, conn)
        for row in conn.execute("SELECT key, config, status, metrics, predicted FROM trials"):
            _check_row(path, row)
    except sqlite3.Error as e:
        raise DatabaseError(path, f"is not a readable SQLite trial database ({e}).",
                            "pass another --db, or move this file away to start a new "
                            "database.") from None
    finally:
        conn.close()


def _check_schema(path: Path, conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise DatabaseError(path, f"was written by a newer Slapo (schema version {version}; "
                            f"this one reads up to {SCHEMA_VERSION}).", "upgrade Slapo, or "
                            "pass another --db.")
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    if not tables:
        return  # an empty SQLite file: nothing to check, the table is created on open
    if "trials" not in tables:
        raise DatabaseError(path, f"is an SQLite file without a trials table (tables: "
                            f"{', '.join(sorted(tables))}): not a Slapo trial database.",
                            "pass the tune.db of a `slapo tune` run, or a new path.")
    columns = tuple(r[1] for r in conn.execute("PRAGMA table_info(trials)"))
    if columns != COLUMNS:
        raise DatabaseError(path, f"its trials table has columns {', '.join(columns)}, not "
                            f"{', '.join(COLUMNS)}.", "pass the tune.db of a `slapo tune` run, "
                            "or a new path.")


def _check_row(path: Path, row: tuple) -> None:
    key, config, status, metrics, predicted = row
    if status not in STATUSES:
        raise DatabaseError(path, f"row {key!r} has status {status!r}, not one of "
                            f"{', '.join(STATUSES)}.", "delete that row, or pass a new --db.")
    for name, text in (("config", config), ("metrics", metrics), ("predicted", predicted)):
        try:
            value = json.loads(text) if isinstance(text, str) else None
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise DatabaseError(path, f"row {key!r}: {name} is not a JSON object "
                                f"({str(text)[:60]!r}).", "delete that row, or pass a new "
                                "--db.")
