"""`benchmarks/tempo_gpu.py` plumbing on CPU at tiny sizes, so the one GPU call cannot die on a
bug: rows, JSON keys, the saved-bytes drops of eager and compiled Tempo, kernel counts."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "tempo_gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("tempo_gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.compile
def test_cpu_rows_and_json(tmp_path, monkeypatch):
    bench = _bench()
    out = tmp_path / "tempo.json"
    argv = ["--device", "cpu", "--hidden", "32", "--heads", "2", "--batch", "2", "--seq", "8",
            "--iters", "1", "--precision", "fp32", "--out", str(out),
            "--variants", "eager:off,eager:tempo,compiled:off,compiled:fused"]
    assert bench.main(argv) == 0
    data = json.loads(out.read_text())
    rows = {(r["mode"], r["tempo"]): r for r in data["rows"]}
    assert list(rows) == [("eager", "off"), ("eager", "tempo"), ("compiled", "off"),
                          ("compiled", "fused")]
    assert data["meta"]["device"] == "cpu" and data["meta"]["hidden"] == 32
    for key in (("eager", "tempo"), ("compiled", "fused")):
        assert rows[key]["saved_drop_mib"] > 0 and "overhead" in rows[key]
    assert rows[("compiled", "fused")]["kernels"] > 0
    assert "SLAPO_TEMPO_COMPILED" not in os.environ


def test_unknown_variant_and_missing_cuda_are_refused():
    bench = _bench()
    with pytest.raises(SystemExit, match="unknown variants"):
        bench._selected(bench.parse(["--variants", "compiled:fast"]))
    if not __import__("torch").cuda.is_available():
        assert bench.main(["--device", "cuda"]) == 2
