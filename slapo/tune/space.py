"""Search space: symbols, conditional symbols, constraints and enumeration.

A space is a *program* that declares symbols in order. Later symbols may depend on the values
chosen for earlier ones (their candidate list may be a function of the partial config, or they may
exist only when a condition holds), which is what Slapo calls a "polyhedral" space: e.g.
`ckpt_ratio` exists only when `checkpoint` is on, and its candidates may depend on the batch
size. Enumeration replays that program depth-first, so both the declarative API
(`space.create_symbol(...)` calls made once) and Slapo's imperative style (a user function
`update_space(args, space)` that branches on already-chosen values) are the same mechanism.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any

Config = dict[str, Any]


def config_key(config: Config) -> str:
    """Canonical, order-independent key of a config (used by the database)."""
    try:
        return json.dumps(config, sort_keys=True, separators=(",", ":"))
    except TypeError as e:
        raise ValueError(
            f"config {config!r} is not JSON-serialisable ({e}). Fix: use ints, floats, bools, "
            "strings or None as symbol values."
        ) from None


class Symbol:
    """One tunable knob: a name and its candidate values.

    Mirrors Slapo's `Symbol`: until it is fixed, comparisons return False, so schedule code can be
    written against it before a value is chosen (`if ckpt == True: ...`).
    """

    def __init__(self, name: str, vals: Sequence[Any]):
        if not isinstance(name, str) or not name:
            raise ValueError(f"symbol name must be a non-empty string, got {name!r}.")
        vals = list(vals)
        if not vals:
            raise ValueError(
                f"symbol {name!r} has no candidate values. Fix: pass at least one value, or use a "
                "condition to leave the symbol out."
            )
        keys = [json.dumps(v, sort_keys=True) for v in vals]
        if len(set(keys)) != len(keys):
            raise ValueError(f"symbol {name!r} has duplicate candidate values {vals!r}.")
        self.name = name
        self.vals = vals
        self.value: Any = None
        self.is_fixed = False

    def fix_at(self, idx: int) -> Any:
        """Fix the symbol to its `idx`-th candidate and return the value."""
        if not 0 <= idx < len(self.vals):
            raise ValueError(f"symbol {self.name!r}: index {idx} out of range 0..{len(self.vals) - 1}.")
        self.value, self.is_fixed = self.vals[idx], True
        return self.value

    def fix(self, value: Any) -> Any:
        """Fix the symbol to `value`, which must be one of its candidates."""
        want = json.dumps(value, sort_keys=True)
        for i, v in enumerate(self.vals):
            if json.dumps(v, sort_keys=True) == want:
                return self.fix_at(i)
        raise ValueError(
            f"symbol {self.name!r}: value {value!r} is not a candidate; candidates are {self.vals!r}."
        )

    def _cmp(self, other: Any, op: Callable[[Any, Any], bool]) -> bool:
        if not self.is_fixed:
            return False
        other = other.value if isinstance(other, Symbol) else other
        return op(self.value, other)

    def __eq__(self, other: Any) -> bool:  # type: ignore[override]
        return self._cmp(other, lambda a, b: a == b)

    def __ne__(self, other: Any) -> bool:  # type: ignore[override]
        return self._cmp(other, lambda a, b: a != b)

    def __lt__(self, other: Any) -> bool:
        return self._cmp(other, lambda a, b: a < b)

    def __le__(self, other: Any) -> bool:
        return self._cmp(other, lambda a, b: a <= b)

    def __gt__(self, other: Any) -> bool:
        return self._cmp(other, lambda a, b: a > b)

    def __ge__(self, other: Any) -> bool:
        return self._cmp(other, lambda a, b: a >= b)

    def __bool__(self) -> bool:
        return bool(self.value) if self.is_fixed else False

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        state = f"={self.value!r}" if self.is_fixed else ""
        return f"Symbol({self.name!r}, {self.vals!r}){state}"


class _Chooser:
    """Decides which candidate each symbol gets during one replay of the space program."""

    def choose(self, name: str, vals: list[Any], partial: Config) -> int:  # pragma: no cover
        raise NotImplementedError


class _PrefixChooser(_Chooser):
    """Depth-first enumeration: replay the recorded prefix, then take candidate 0."""

    def __init__(self, stack: list[list[int]]):
        self.stack = stack
        self.depth = 0

    def choose(self, name: str, vals: list[Any], partial: Config) -> int:
        if self.depth < len(self.stack):
            self.stack[self.depth][1] = len(vals)
            idx = min(self.stack[self.depth][0], len(vals) - 1)
            self.stack[self.depth][0] = idx
        else:
            self.stack.append([0, len(vals)])
            idx = 0
        self.depth += 1
        return idx


class _PreferChooser(_Chooser):
    """Take the preferred value when it is a candidate, else the first candidate."""

    def __init__(self, prefer: Config, strict: bool):
        self.prefer = prefer
        self.strict = strict
        self.used: set[str] = set()

    def choose(self, name: str, vals: list[Any], partial: Config) -> int:
        if name in self.prefer:
            want = json.dumps(self.prefer[name], sort_keys=True)
            for i, v in enumerate(vals):
                if json.dumps(v, sort_keys=True) == want:
                    self.used.add(name)
                    return i
            if self.strict:
                raise ValueError(
                    f"config value {name}={self.prefer[name]!r} is not a candidate here; "
                    f"candidates are {vals!r}. Fix: pick one of them."
                )
        elif self.strict:
            raise ValueError(
                f"config is missing symbol {name!r} (candidates {vals!r}). Fix: add it to the config."
            )
        return 0


class Space:
    """A search space of configs, declared symbol by symbol.

    Declarative use::

        space = Space()
        space.create_symbol("batch_size", [8, 16, 32])
        space.create_symbol("checkpoint", [False, True])
        space.create_symbol("ckpt_ratio", [0.25, 0.5, 1.0], condition=lambda c: c["checkpoint"])
        space.add_constraint(lambda c: c["batch_size"] <= 16 or c["checkpoint"], "bs32 needs ckpt")
        configs = list(space)

    Slapo's imperative style: `Space.from_function(update_space, args)` where
    `update_space(args, space)` calls `space.create_symbol` (reading the returned, already-fixed
    `Symbol`'s value to branch) and returns the space.
    """

    def __init__(self) -> None:
        self._decls: list[tuple[str, Any, Callable[[Config], bool] | None]] = []
        self._constraints: list[tuple[str, Callable[[Config], bool]]] = []
        self._replay_constraints: list[tuple[str, Callable[[Config], bool]]] = []
        self._program: Callable[[Space], Any] | None = None
        # Replay state (only set while the program runs).
        self._chooser: _Chooser | None = None
        self._partial: Config | None = None
        self.symbols: dict[str, Symbol] = {}

    # ----------------------------------------------------------------------------- declaration
    def create_symbol(
        self,
        name: str,
        vals: Sequence[Any] | Callable[[Config], Sequence[Any]],
        condition: Callable[[Config], bool] | None = None,
    ) -> Symbol | None:
        """Declare a knob. `vals` may be a function of the earlier symbols' values.

        `condition(partial_config)` makes the symbol exist only when it returns True. During a
        replay (enumeration, `apply`) the returned symbol is already fixed; it is None when
        the condition leaves the symbol out.
        """
        if self._chooser is None:
            if any(d[0] == name for d in self._decls):
                raise ValueError(f"symbol {name!r} declared twice. Fix: use a different name.")
            if not (callable(vals) or isinstance(vals, Sequence)) or isinstance(vals, str):
                raise ValueError(f"symbol {name!r}: vals must be a list or a function, got {vals!r}.")
            self._decls.append((name, vals, condition))
            sym = Symbol(name, [None] if callable(vals) else vals)
            self.symbols[name] = sym
            return sym
        partial = self._partial
        assert partial is not None
        if name in partial:
            raise ValueError(f"symbol {name!r} declared twice in one pass of the space program.")
        if condition is not None and not condition(dict(partial)):
            return None
        cands = list(vals(dict(partial)) if callable(vals) else vals)
        sym = Symbol(name, cands)
        sym.fix_at(self._chooser.choose(name, cands, partial))
        partial[name] = sym.value
        self.symbols[name] = sym
        return sym

    def add_constraint(self, predicate: Callable[[Config], bool], name: str = "") -> None:
        """Keep only configs for which `predicate(config)` is True.

        May also be called inside an `update_space` function; it then applies to the configs
        of that pass only (the function runs once per config).
        """
        if not callable(predicate):
            raise ValueError(f"constraint must be callable, got {predicate!r}.")
        entry = (name or getattr(predicate, "__name__", "constraint"), predicate)
        (self._replay_constraints if self._chooser is not None else self._constraints).append(entry)

    @classmethod
    def from_function(cls, update_space: Callable[..., Any], args: Any = None) -> Space:
        """Wrap a Slapo-style `update_space(args, space)` schedule function as a space."""
        space = cls()
        space._program = lambda s: update_space(args, s)
        return space

    # ----------------------------------------------------------------------------- replay
    def _run(self, chooser: _Chooser) -> Config:
        partial: Config = {}
        self._chooser, self._partial, self.symbols = chooser, partial, {}
        self._replay_constraints = []
        try:
            if self._program is not None:
                self._program(self)
            else:
                for name, vals, cond in self._decls:
                    self.create_symbol(name, vals, cond)
        finally:
            self._chooser, self._partial = None, None
        return partial

    def violated(self, config: Config) -> str | None:
        """Name of the first constraint that `config` violates, or None.

        Constraints declared inside an `update_space` function are those of the latest replay.
        """
        for name, pred in self._constraints + self._replay_constraints:
            if not pred(dict(config)):
                return name
        return None

    def __iter__(self) -> Iterator[Config]:
        """All valid configs, depth-first in declaration order."""
        stack: list[list[int]] = []
        while True:
            chooser = _PrefixChooser(stack)
            config = self._run(chooser)
            del stack[chooser.depth :]
            if self.violated(config) is None:
                yield config
            while stack and stack[-1][0] + 1 >= stack[-1][1]:
                stack.pop()
            if not stack:
                return
            stack[-1][0] += 1

    def configs(self) -> list[Config]:
        return list(self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def names(self) -> list[str]:
        """Every symbol name that appears in some valid config, in first-seen order."""
        seen: dict[str, None] = {}
        for c in self:
            seen.update(dict.fromkeys(c))
        return list(seen)

    def candidates(self, name: str) -> list[Any]:
        """Union of the values `name` takes over all valid configs."""
        out: dict[str, Any] = {}
        for c in self:
            if name in c:
                out.setdefault(json.dumps(c[name], sort_keys=True), c[name])
        if not out:
            raise ValueError(f"no symbol named {name!r} in this space; symbols: {self.names()}.")
        return list(out.values())

    def complete(self, prefer: Config) -> Config | None:
        """The valid config closest to `prefer`: its values where legal, first candidates else.

        Used by coordinate descent to repair a config after one knob moved (turning `checkpoint`
        on makes `ckpt_ratio` appear; turning it off drops it). None if constraints reject it.
        """
        config = self._run(_PreferChooser(prefer, strict=False))
        return config if self.violated(config) is None else None

    def apply(self, config: Config) -> Space:
        """Fix every symbol to `config` (validating it) and return the space.

        Afterwards `space.symbols[name].value` holds the chosen values, which is how a schedule
        function reads its knobs. Raises ValueError naming the bad or missing symbol.
        """
        chooser = _PreferChooser(config, strict=True)
        self._run(chooser)
        extra = set(config) - chooser.used
        if extra:
            raise ValueError(
                f"config has symbols {sorted(extra)} that this space does not declare here. "
                f"Fix: drop them (declared: {sorted(self.symbols)})."
            )
        bad = self.violated(config)
        if bad is not None:
            raise ValueError(f"config {config!r} violates constraint {bad!r}.")
        return self

    def to_dict(self) -> Config:
        """Current fixed values (after `apply`)."""
        return {n: s.value for n, s in self.symbols.items() if s.is_fixed}

    def __repr__(self) -> str:
        return f"Space({len(self)} configs, symbols={self.names()})"
