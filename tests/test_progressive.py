"""The README demo: `slapo train --progressive` verifies and measures every schedule step."""

from __future__ import annotations

import json

import pytest

from slapo.cli import main

DEMO_ARGS = ["train", "--progressive", "--steps", "3", "--num-layers", "2", "--hidden-size", "64",
             "--seq-len", "32", "--batch-size", "4", "--fuse-compiler", "aot_eager"]


def _rows(out):
    return json.loads((out / "progressive.json").read_text())


@pytest.fixture(scope="module")
def single_rows(tmp_path_factory):
    """The demo in one process (tiny GPT-2), run once for the tests that read its rows."""
    out = tmp_path_factory.mktemp("progressive")
    status = main([*DEMO_ARGS, "--out", str(out)])
    assert status == 0
    return _rows(out)


def test_progressive_single_process(single_rows):
    rows = single_rows
    assert all(r["shard_ways"] == 1 and r["parameters"] > 0 and r["peak_bytes"] > 0
               for r in rows)
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
    # the activation budget is the baseline's measured bytes at the demo batch; every row's
    # batch @ budget was measured to fit it, and checkpointing buys a larger batch
    budget = rows[0]["saved_bytes"]
    for r in rows:
        assert r["batch"] == 4 and r["budget_bytes"] == budget, r
        assert 0 < r["budget_saved_bytes"] <= budget and r["budget_tokens_per_s"] > 0, r
    assert rows[0]["budget_batch"] == 4 and rows[0]["budget_speedup"] == 1.0
    ck = by["+ checkpointing"]
    assert ck["budget_batch"] >= 4 * 4, ck  # bytes 0.06-0.3x of the baseline: >= 4x the batch
    assert ck["budget_saved_bytes"] > ck["saved_bytes"]  # really measured at the larger batch


def job_progressive_tp(out: str, budget_max_factor: int = 4):
    """`slapo train --progressive --tp 2` on every rank of the pool; this rank's rows back."""
    import torch.distributed as dist

    from slapo.train import demo

    # this worker only: the search itself is checked single-process
    demo.BUDGET_MAX_FACTOR = budget_max_factor
    seen = []
    real = demo.progressive.run
    demo.progressive.run = lambda *a, **k: seen.append(real(*a, **k)) or seen[-1]
    try:
        status = main([*DEMO_ARGS, "--tp", "2", "--out", out])
    finally:
        demo.progressive.run = real
    return status, dist.get_rank(), demo.progressive.to_json(seen[0])


@pytest.mark.dist
@pytest.mark.compile
def test_progressive_two_ranks_adds_tensor_parallel(dist2, tmp_path, single_rows):
    res = dist2.run(job_progressive_tp, str(tmp_path))
    assert [r[:2] for r in res] == [(0, 0), (0, 1)]
    rows = _rows(tmp_path)
    assert rows[-1]["name"] == "+ tensor parallel x2"
    assert [r["shard_ways"] for r in rows] == [1] * (len(rows) - 1) + [2]
    assert all(r["verified"] for r in rows), rows
    # only the TP step shards: every earlier step saves per rank what it saves in one process
    # (apply's default tp is the world size; the progression pins tp=1 until the TP step)
    assert [r["saved_bytes"] for r in rows[:-1]] == [r["saved_bytes"] for r in single_rows]
    # both ranks took the same budget decisions (a TP forward is a collective: no hang)
    tp = rows[-1]
    assert tp["budget_batch"] == 16 and tp["budget_capped"], tp
    assert 0 < tp["budget_saved_bytes"] <= tp["budget_bytes"] == rows[0]["saved_bytes"]


@pytest.mark.dist
@pytest.mark.compile
def test_progressive_tp2_on_four_ranks_shards_two_ways(dist4, tmp_path, single_rows):
    """--tp 2 on 4 ranks: a (dp=2, tp=2) mesh. The TP step shards over the mesh's tp dimension
    only (2 ways, not the job's 4), every replica runs the whole progression and verifies, and
    the replicas agree (same batch, same weights, same losses)."""
    res = dist4.run(job_progressive_tp, str(tmp_path), 0, timeout=400)
    assert [r[:2] for r in res] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    per_rank = [r[2] for r in res]
    for rows in per_rank:
        assert rows[-1]["name"] == "+ tensor parallel x2", [r["name"] for r in rows]
        assert [r["shard_ways"] for r in rows] == [1] * (len(rows) - 1) + [2]
        assert all(r["verified"] for r in rows), rows
        assert rows[-1]["parameters"] < 0.8 * rows[0]["parameters"]  # each rank holds shards
        # the steps before TP run unsharded on every replica, on the whole demo batch
        assert [r["saved_bytes"] for r in rows[:-1]] == [r["saved_bytes"] for r in single_rows]
    tp_row = [rows[-1] for rows in per_rank]
    assert len({r["parameters"] for r in tp_row}) == 1
    assert all(r["losses"] == tp_row[0]["losses"] for r in tp_row)  # replicas agree
    assert _rows(tmp_path) == per_rank[0]  # rank 0 wrote its rows


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


def _gpt2_steps():
    from slapo import progressive

    return [progressive.Step("base", {}), progressive.Step("+ ckpt", {"ckpt_ratio": 1.0})]


def test_batch_at_budget_is_the_largest_measured_fit():
    """Re-measure, independently, the checkpointed model at the batch the search reported: its
    bytes are what the row says and fit the budget; the next power of two does not (or the
    search stopped at its cap)."""
    import models

    from slapo import model_schedule, progressive
    from slapo.profile import saved_bytes

    batches = [models.batch_for("gpt2", batch=2, seq=16, seed=s) for s in range(3)]
    res = progressive.run(lambda: models.gpt2(seed=0), batches, steps=_gpt2_steps(),
                          train_steps=3, warmup=1, budget_max_factor=32, log=lambda s: None)
    base, ck = res
    assert base.budget_bytes == ck.budget_bytes == base.saved_bytes
    assert ck.budget_batch > ck.batch and not ck.budget_capped, ck
    model = models.gpt2(seed=0)
    model.set_attn_implementation("eager")  # as run() prepares the baseline it copies
    model.config.use_cache = False
    model_schedule.apply(model, ckpt_ratio=1.0)
    again = progressive.tiled_batches(batches)
    at = saved_bytes(model, **again(ck.budget_batch))
    assert at == ck.budget_saved_bytes <= ck.budget_bytes
    assert saved_bytes(model, **again(2 * ck.budget_batch)) > ck.budget_bytes
    assert ck.budget_tokens_per_s > 0 and ck.budget_speedup > 0


def test_largest_fitting_walks_to_the_measured_answer():
    from slapo.progressive import batch_candidates, largest_fitting

    cands = batch_candidates(8, 16)
    assert cands == [1, 2, 4, 8, 16, 32, 64, 128]
    assert batch_candidates(6, 4) == [1, 3, 6, 12, 24]
    seen = []

    def affine(fixed, per):
        def m(b):
            seen.append(b)
            return fixed + per * b
        return m

    # a fixed part (affine bytes): the linear prediction from batch 8 says 16 does not fit,
    # the measurement says it does, and 32 is measured not to
    assert largest_fitting(cands, affine(1000, 100), 3000, (8, 1800)) == (16, 2600)
    assert seen == [16, 32]
    seen.clear()
    assert largest_fitting(cands, affine(8000, 10), 9000, (8, 8080)) == (64, 8640)
    assert seen == [16, 32, 64, 128]
    # superlinear: the prediction (32) is measured too big, the walk goes down to 16
    seen.clear()
    assert largest_fitting(cands, lambda b: seen.append(b) or 10 * b * b, 2600,
                           (8, 640)) == (16, 2560)
    assert seen == [32, 16]
    # the cap: the largest candidate fits, nothing above it is tried
    assert largest_fitting(cands, affine(0, 1), 10**6, (8, 8)) == (128, 128)
    # nothing fits: None; a step that needs more than the baseline gets a smaller batch
    assert largest_fitting(cands, affine(0, 100), 50, (8, 800)) is None
    assert largest_fitting(cands, affine(0, 100), 400, (8, 800)) == (4, 400)


def test_table_prints_the_budget_columns():
    from rich.console import Console

    from slapo import progressive

    rows = [progressive.StepResult("baseline", {}, 1000.0, 1.0, 8 << 20, 1.0, True, batch=8,
                                   budget_bytes=8 << 20, budget_batch=8,
                                   budget_saved_bytes=8 << 20, budget_tokens_per_s=1000.0,
                                   budget_speedup=1.0),
            progressive.StepResult("+ ckpt", {"ckpt_ratio": 1.0}, 500.0, 0.5, 1 << 19, 0.06,
                                   True, batch=8, budget_bytes=8 << 20, budget_batch=128,
                                   budget_saved_bytes=7 << 20, budget_capped=True,
                                   budget_tokens_per_s=1400.0, budget_speedup=1.4),
            progressive.StepResult("+ warp", {}, note="skipped", batch=8)]
    con = Console(record=True, width=160)
    con.print(progressive.table(rows))
    text = con.export_text()
    for want in ("batch @ budget", "tokens/s @ budget", "saved @ budget", "128 (16x, cap)",
                 "7.00 MiB", "1,400", "1.40x", "0.50x", "skipped"):
        assert want in text, (want, text)
    assert progressive.summary(rows) == [
        "At the demo batch (8): fastest step '+ ckpt', 0.50x the baseline's tokens/s, 0.06x its "
        "saved activations.",
        "Within the baseline's activation memory: '+ ckpt' trains batch 128 (16x) at 1.40x the "
        "baseline's tokens/s."]


def test_knob_the_installed_apply_does_not_take_is_skipped_with_a_note():
    """The GPU step list names knobs (compile_blocks, kernels, ...) an older `apply` lacks: such
    a step is skipped with a note, the knob dropped, and later steps run without it."""
    import models

    from slapo import progressive

    batches = [models.batch_for("gpt2", seed=s) for s in range(3)]
    steps = [progressive.Step("base", {}),
             progressive.Step("+ warp", {"attention": "sdpa", "warp_drive": True}),
             progressive.Step("+ ckpt", {"attention": "sdpa", "warp_drive": True,
                                         "ckpt_ratio": 1.0})]
    res = progressive.run(lambda: models.gpt2(seed=0), batches, steps=steps, train_steps=3,
                          warmup=1, log=lambda s: None)
    assert [r.verified for r in res] == [True, False, True]
    assert "does not take warp_drive" in res[1].note and res[1].tokens_per_s == 0
    assert res[2].knobs == {"attention": "sdpa", "ckpt_ratio": 1.0}
    assert res[2].budget_batch == 0  # the search is off unless asked for


def test_gpu_plan_uses_the_gpu_schedule_in_bf16():
    import torch

    from slapo.train.demo import _plan

    plan = _plan(1, torch.device("cuda", 0), "inductor")
    assert plan["precision"] == "bf16" and plan["baseline_attention"] == "sdpa"
    last = plan["steps"][-1].knobs
    assert last == {"attention": "sdpa", "compile_blocks": True,
                    "fused_loss": True, "ckpt_ratio": 1.0, "ckpt_policy": "selective"}
    tp = _plan(2, torch.device("cuda", 0), "inductor")["steps"][-1].knobs
    assert tp["tp"] == 2 and tp["vocab_parallel"] is False
    cpu = _plan(1, torch.device("cpu"), "inductor")
    assert "precision" not in cpu and cpu["steps"][0].name == "baseline (HF eager)"
    assert not any("tp" in s.knobs for s in cpu["steps"])  # tp degree 1: no TP step
    assert _plan(2, torch.device("cpu"), "inductor")["steps"][-1].knobs["tp"] == 2


def test_progressive_refuses_a_pipeline_before_building(capsys):
    """--pp-stages with --progressive stops with the reason before any process group or model."""
    assert main([*DEMO_ARGS, "--pp-stages", "2"]) == 1
    assert "drop --pp-stages 2" in capsys.readouterr().err


def test_two_precision_spellings_at_once_are_refused():
    """`autocast_dtype` and `mixed_precision` are older spellings of `precision`: two together
    are ambiguous and refused before the baseline is built."""
    import torch

    from slapo import progressive
    from slapo.errors import SlapoError

    built = []
    for spelling in ({"mixed_precision": "fp16"}, {"precision": "fp16"}):
        with pytest.raises(SlapoError, match="pass one of precision"):
            progressive.run(lambda: built.append(1), [], **spelling,
                            autocast_dtype=torch.bfloat16, log=lambda s: None)
    assert not built


def test_readme_demo_command_ends_with_the_tensor_parallel_step():
    """`bash scripts/demo.sh` on CPU launches 2 ranks with `--tp 2`, so the progression ends
    with '+ tensor parallel x2', the row the README's example table shows (without `--tp` the
    two ranks are data-parallel replicas and the TP step is left out)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "demo.sh").read_text()
    cpu = script[script.index("\nelse\n"):script.index("\nfi\n")]  # no GPU: the CPU branch
    nproc = re.search(r"nproc=(\d+)", cpu).group(1)
    assert re.search(rf"--tp {nproc}\b", cpu), cpu
    assert "+ tensor parallel x2" in (root / "README.md").read_text()
