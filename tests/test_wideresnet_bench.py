"""`benchmarks/wideresnet.py` plumbing at tiny sizes (1 timed step): rows, JSON keys, the
schedule-preserves-the-loss check and the saved-bytes ordering. No timing is asserted (CPU
numbers on a shared machine mean nothing); the TP row runs on the persistent gloo pool (the
benchmark's own spawn path differs only in who starts the ranks)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "wideresnet.py"
TINY = ["--base-planes", "4", "--layers", "2,2,2,2", "--image", "32", "--batch", "4",
        "--steps", "1", "--rounds", "1", "--warmup", "0"]


def bench():
    spec = importlib.util.spec_from_file_location("wideresnet_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_process_rows_and_json(tmp_path, one_thread):
    b = bench()
    out = tmp_path / "wrn.json"
    b.main([*TINY, "--tp", "0", "--out", str(out)])
    data = json.loads(out.read_text())
    assert set(data) == {"args", "torch", "device", "rows"}
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows) == ["unscheduled", "ckpt 0.5", "ckpt 1.0"]
    for r in rows.values():
        assert set(r) == set(b.ROW_KEYS), r.keys()
        assert r["loss_ok"] and r["images_per_s"] > 0 and r["peak_bytes"] is None
        assert len(r["times"]) == 1
    base, half, full = (rows[k]["saved_bytes"] for k in rows)
    assert full < half < base  # ratio 0.5 checkpoints 1 of 2 blocks per stage


@pytest.mark.compile
def test_compiled_rows(one_thread):
    """--compile BACKEND adds the compiled-blocks rows (aot_eager here: the plumbing; the GPU
    session runs inductor), each with the unscheduled model's loss."""
    import torch._dynamo

    b = bench()
    torch._dynamo.reset()
    rows = {r["variant"]: r for r in b.main([*TINY, "--tp", "0", "--compile", "aot_eager"])
            ["rows"]}
    assert list(rows)[3:] == ["compiled", "compiled + SAC 1.0"]
    assert all(r["loss_ok"] for r in rows.values()), rows
    assert rows["compiled + SAC 1.0"]["knobs"]["ckpt_policy"] == "selective"


def job_tp_row(argv: list[str]) -> dict:
    """One rank of the benchmark's TP row (the pool has the process group up)."""
    b = bench()
    return b.run_tp_rank(b.parse_args(argv))


@pytest.mark.dist
def test_tp_row_on_two_ranks(dist2, one_thread):
    b = bench()
    per_rank = dist2.run(job_tp_row, [*TINY, "--tp", "2"])
    assert per_rank[0]["step_s"] == per_rank[1]["step_s"]  # the slowest rank's, on both
    base = b.run_one_process(b.parse_args([*TINY, "--tp", "0"]), b.torch.device("cpu"))[0]
    rows = b.finish_rows([base, per_rank[0]])
    tp = rows[1]
    assert tp["variant"] == "tp=2" and tp["ranks"] == 2 and set(tp) == set(b.ROW_KEYS)
    assert tp["loss_ok"], (tp["loss"], base["loss"])  # same math as the unscheduled model
    assert 0 < tp["saved_bytes"] < base["saved_bytes"]  # per rank: conv1/bn1 channels halved


def test_tp_row_skipped_without_enough_gpus(capsys):
    b = bench()
    if b.torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs: the row would run")
    args = argparse.Namespace(**{**vars(b.parse_args(TINY)), "device": "cuda"})
    assert b.run_tp(args) is None
    assert "tp=2 skipped" in capsys.readouterr().out


def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    b = bench()
    if b.torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(SystemExit) as e:
        b.parse_args(["--device", "cuda"])
    assert e.value.code == 2 and "no CUDA device" in capsys.readouterr().err
