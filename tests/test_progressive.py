"""The README demo: `slapo train --progressive` verifies and measures every schedule step."""

from __future__ import annotations

import json

import pytest

from slapo.cli import main


def _rows(out):
    return json.loads((out / "progressive.json").read_text())


def test_progressive_single_process(tmp_path):
    status = main(["train", "--progressive", "--steps", "3", "--num-layers", "2",
                   "--hidden-size", "64", "--seq-len", "32", "--batch-size", "4",
                   "--fuse-compiler", "aot_eager", "--out", str(tmp_path)])
    assert status == 0
    rows = _rows(tmp_path)
    names = [r["name"] for r in rows]
    assert names[0] == "baseline (HF eager)"
    assert {"+ SDPA attention", "+ fused bias+GELU", "+ Tempo layers",
            "+ checkpointing"} <= set(names)
    assert all(r["verified"] for r in rows), rows
    assert all(r["tokens_per_s"] > 0 and r["saved_bytes"] > 0 for r in rows)
    by = {r["name"]: r for r in rows}
    # checkpointing every layer keeps only layer inputs: far less than the baseline
    assert by["+ checkpointing"]["memory_ratio"] < 0.3
    assert by["+ Tempo layers"]["saved_bytes"] < by["+ SDPA attention"]["saved_bytes"]


def job_progressive_tp(out: str):
    import torch.distributed as dist

    rows = main(["train", "--progressive", "--steps", "3", "--num-layers", "2",
                 "--hidden-size", "64", "--seq-len", "32", "--batch-size", "4",
                 "--fuse-compiler", "aot_eager", "--out", out])
    return rows, dist.get_rank()


@pytest.mark.dist
@pytest.mark.compile
def test_progressive_two_ranks_adds_tensor_parallel(dist2, tmp_path):
    res = dist2.run(job_progressive_tp, str(tmp_path))
    assert [r[0] for r in res] == [0, 0]
    rows = _rows(tmp_path)
    assert rows[-1]["name"] == "+ tensor parallel x2"
    assert all(r["verified"] for r in rows), rows


def test_unavailable_knob_is_skipped_and_dropped_from_later_steps():
    import models

    from slapo import progressive

    batches = [models.batch_for("t5", seed=s) for s in range(3)]
    steps = [progressive.Step("base", {}),
             progressive.Step("+ fuse", {"fuse": True, "fuse_compiler": "aot_eager"}),
             progressive.Step("+ ckpt", {"fuse": True, "fuse_compiler": "aot_eager",
                                         "ckpt_ratio": 1.0})]
    res = progressive.run(lambda: models.t5(seed=0), batches, steps=steps, train_steps=3,
                          warmup=1, log=lambda s: None)
    assert [r.verified for r in res] == [True, False, True]
    assert "no fusion plan for the t5 family" in res[1].note
    assert res[2].knobs == {"ckpt_ratio": 1.0}
    assert res[2].saved_bytes < res[0].saved_bytes
