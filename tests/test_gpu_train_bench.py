"""`benchmarks/gpu_train.py` plumbing on CPU (tiny configs): children, rows, table, deadline.

The numbers it prints on CPU mean nothing; what is checked is that every requested (variant,
model) yields a row, that a variant that cannot run (Liger absent) is a failed row rather than a
crash, and that `--deadline-s` skips instead of overrunning a device call.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_train.py"


def _run(tmp_path, *extra, models="llama") -> list[dict]:
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--models", models,
                    "--steps", "1", "--warmup", "1", "--out", str(tmp_path), *extra],
                   check=True, capture_output=True, text=True, timeout=300)
    return json.loads((tmp_path / "results.json").read_text())


def test_rows_for_every_variant(tmp_path):
    """Liger-Kernel has no BERT kernels (or is absent): a failed row, the others measured."""
    rows = _run(tmp_path, "--variants", "hf_sdpa,hf_liger,hf_eager", models="bert")
    by = {r["variant"]: r for r in rows}
    assert by["hf_sdpa"]["status"] == "ok" and by["hf_sdpa"]["tokens_per_s"] > 0
    assert by["hf_eager"]["status"] == "ok"
    assert by["hf_liger"]["status"].startswith("failed")
    assert (tmp_path / "results.jsonl").read_text().count("\n") == 3


def test_unknown_variant_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--variants", "hf_fast",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown variant(s) hf_fast" in proc.stderr
    assert not (tmp_path / "results.jsonl").exists()


def test_deadline_skips_instead_of_overrunning(tmp_path):
    rows = _run(tmp_path, "--variants", "hf_sdpa,hf_eager", "--deadline-s", "1")
    assert [r["status"] for r in rows] == ["skipped: --deadline-s"] * 2
