"""2023 `Symbol` / `Space` / `Database` (slapo.autotune.tune) over `slapo.tune`.

`Symbol` is today's class unchanged. `Space` and `Database` are today's classes plus the 2023
methods that differ:

- `Space.next()` / `reset()` walk the configs one at a time (2023's cursor API; today a space
  is iterable), `clone()` copies the declarations, `log_space()` logs the symbols.
- `Database(db_file)` with `commit(key, data)` and `load()` (2023's JSON key/value store), on
  today's SQLite store: `key` becomes the config `{"key": key}` and `data` its metrics, so the
  file is crash-safe where 2023's rewritten JSON file was not. Today's `commit(Record)` works too.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from ..tune.database import Database as _Database
from ..tune.database import Record
from ..tune.space import Config, Symbol
from ..tune.space import Space as _Space
from .logger import get_logger


class Space(_Space):
    """Today's `slapo.tune.Space` with the 2023 cursor methods."""

    _cursor: Iterator[Config] | None = None

    def next(self) -> Config:
        """The next valid config (in declaration order); StopIteration when all were seen."""
        if self._cursor is None:
            self._cursor = iter(self)
        return next(self._cursor)

    def reset(self) -> None:
        """Start `next()` again from the first config."""
        self._cursor = None

    def clone(self) -> Space:
        """An independent copy of the declarations (not of the cursor)."""
        other = copy.copy(self)
        other._decls, other._constraints = list(self._decls), list(self._constraints)
        other._replay_constraints = list(self._replay_constraints)
        other.symbols = dict(self.symbols)
        other._cursor = None
        return other

    def log_space(self, space_log_file: str | None = None, output_fn=None) -> str:
        """Log (and optionally write) one line per symbol with its candidate values."""
        lines = [f"{name}: {self.candidates(name)}" for name in self.names()]
        text = "\n".join([f"Space of {len(self)} configs:", *lines])
        (output_fn or get_logger("Slapo-tune").info)(text)
        if space_log_file:
            with open(space_log_file, "w") as f:
                f.write(text + "\n")
        return text


class Database(_Database):
    """Today's `slapo.tune.Database` accepting the 2023 `commit(key, data)` and `load()`."""

    def __init__(self, db_file: str | None = None):
        super().__init__(db_file or ":memory:")

    def commit(self, key: Record | str, data: Any = None) -> None:  # type: ignore[override]
        """`commit(Record)` (today) or `commit(key, data)` (2023: data is a dict or a value)."""
        if isinstance(key, Record):
            return super().commit(key)
        metrics = data if isinstance(data, dict) else {"value": data}
        return super().commit(Record({"key": str(key)}, "ok", dict(metrics)))

    def load(self) -> dict[str, Any]:
        """{key: data} of every 2023-style entry, in commit order."""
        out: dict[str, Any] = {}
        for r in self.records():
            if set(r.config) == {"key"}:
                m = r.metrics
                out[r.config["key"]] = m["value"] if set(m) == {"value"} else m
        return out


__all__ = ["Database", "Space", "Symbol"]
