"""Which cases the expensive per-family sweeps run: a sample that covers each distinct code path
by default (what CI runs), every case with `SLAPO_SWEEP=all`.

Why: compiled blocks on CPU cost 20-130 s per family (dynamo traces every layer variant of each
compile pass), and the full compiled sweeps alone took a quarter of CI's 25-minute budget. Every
family still trains uncompiled in every layout on every run (test_train_families and friends);
the compiled and bf16 x family products run in full with `SLAPO_SWEEP=all` (before a release,
and after changing compile, fork_rng, checkpoint, precision or a family's schedule), and the
declared-plan sweep of test_hf_plans likewise.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def full() -> bool:
    """True when `SLAPO_SWEEP=all` asks for every case."""
    return os.environ.get("SLAPO_SWEEP") == "all"


def sample(every: Iterable, default: Iterable) -> list:
    """`every` in its order, restricted to `default` unless the full sweep is asked for."""
    every, default = list(every), list(default)
    unknown = [d for d in default if d not in every]
    assert not unknown, f"sample names cases the sweep does not have: {unknown}"
    return every if full() else [e for e in every if e in default]


def spread(rows: Iterable, cols: Iterable, per_col: int, skip: Iterable = ()) -> list[tuple]:
    """A sample of the product rows x cols that covers both sides: every row once (in the
    least-filled column that takes it), then each column topped up to `per_col` rows, taken in
    turn from a different place in `rows` per column; never a pair of `skip` (refused by
    design). The whole product, minus `skip`, with `SLAPO_SWEEP=all`. Pairs come in the
    product's order (row-major)."""
    rows, cols, skip = list(rows), list(cols), set(skip)
    product = [(r, c) for r in rows for c in cols if (r, c) not in skip]
    if full():
        return product
    picked: dict = {c: [] for c in cols}
    for r in rows:
        options = [c for c in cols if (r, c) not in skip]
        if options:
            picked[min(options, key=lambda c: len(picked[c]))].append(r)
    for j, c in enumerate(cols):
        for k in range(len(rows)):
            r = rows[(j * per_col + k) % len(rows)]
            if len(picked[c]) >= per_col:
                break
            if (r, c) not in skip and r not in picked[c]:
                picked[c].append(r)
    return [(r, c) for r, c in product if r in picked[c]]
