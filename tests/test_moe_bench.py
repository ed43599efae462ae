"""`benchmarks/moe.py` plumbing on CPU at a tiny shape, so a GPU call cannot die on a bug: the
rows (HF's eager loop and grouped GEMM, Slapo's experts on one rank and on 2 spawned ranks),
their JSON, the ep ranks holding half the experts, and every variant computing HF's output."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import sys

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "moe.py"


def _bench(monkeypatch):
    """The script as an importable module (its spawned ranks unpickle its worker by name);
    benchmarks/ leaves sys.path after the test."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    monkeypatch.delitem(sys.modules, "moe", raising=False)
    return importlib.import_module("moe")


@pytest.mark.slow  # spawns 2 processes
def test_rows_json_and_outputs(tmp_path, monkeypatch):
    out = tmp_path / "moe.json"
    rows = _bench(monkeypatch).main(["--shape", "tiny", "--iters", "1", "--ep", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == [r["variant"] for r in rows] == [
        "hf eager", "hf grouped_mm", "slapo ep=1", "slapo ep=2"]
    assert data["meta"]["shape"] == "tiny" and data["meta"]["tokens_per_rank"] == 32
    mib = {r["variant"]: r["expert_mib"] for r in rows}
    assert mib["slapo ep=2"] == mib["hf eager"] / 2 == mib["slapo ep=1"] / 2
    assert all(r["max_diff"] < 1e-5 and r["vs_eager"] > 0 for r in rows), rows
