"""`benchmarks/gpu_train.py` plumbing on CPU (tiny configs): children, rows, table, deadline,
the `slapo_tuned` row (`slapo.tune.best`), the issue-36 rows (slapo_fp8 emulated, slapo_offload
through forced host copies, slapo_optim_offload), the LLaMA-3-8B-shaped model and the
device-session plan (`gpu_session.sh`).

The numbers it prints on CPU mean nothing; what is checked is that every requested (variant,
model) yields a row, that a variant that cannot run (Liger absent) is a failed row rather than a
crash, that `--deadline-s` skips instead of overrunning a device call, that slapo_tuned measures
the best of its trials with the predictions, seeds and cap it was given, and that bad options
are usage errors before anything is written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_train.py"


def _run(tmp_path, *extra, models="llama") -> list[dict]:
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--models", models,
                    "--steps", "1", "--warmup", "1", "--out", str(tmp_path), *extra],
                   check=True, capture_output=True, text=True, timeout=300)
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------
# issue 36: slapo_fp8, slapo_offload, slapo_optim_offload and the LLaMA-3-8B-shaped model
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_issue36_rows_on_the_tiny_llama3(tmp_path):
    """Each new row builds, trains and reports what it changed, on the 8B model's tiny twin:
    fp8 through torchao's emulation (the GEMMs of at least --fp8-min-dim 64: q, o, gate, up,
    down of both layers; k/v at 16 rows and the LM head stay bf16), offload through the
    forced host-copy path (layer 1 offloaded, layer 0 selectively checkpointed), the optimizer
    on the host. Same init and batch: the first losses agree (fp8 within its roundoff).
    Eager blocks (`--knob compile_blocks=false`) to keep CPU time short; the compiled form
    runs in `gpu_session.sh 1 --tiny`."""
    pytest.importorskip("torchao")
    rows = _run(tmp_path, "--variants", "slapo_gpu,slapo_fp8,slapo_offload,slapo_optim_offload",
                "--knob", "compile_blocks=false", models="llama3-8b-8l")
    by = {r["variant"]: r for r in rows}
    assert all(r["status"] == "ok" and r["model"] == "tiny-llama3" for r in rows), rows
    fp8 = by["slapo_fp8"]
    assert fp8["fp8_gemms"] == 10 and fp8["fp8_emulated"] and fp8["fp8_min_dim"] == 64
    off = by["slapo_offload"]
    assert off["offloaded_layers"] == 1 and off["offload_tensors"] > 10
    assert off["offload_gib"] > 0 and "forced" in off["offload_path"]
    assert by["slapo_optim_offload"]["optimizer_offload"] is True
    base = by["slapo_gpu"]
    assert "fp8_gemms" not in base and "offloaded_layers" not in base
    for v in ("slapo_offload", "slapo_optim_offload"):  # exact schedules: same losses
        assert by[v]["loss_first"] == base["loss_first"]
        assert abs(by[v]["loss_last"] - base["loss_last"]) < 1e-3
    assert abs(fp8["loss_first"] - base["loss_first"]) < 2e-2


def test_fp8_row_is_skipped_where_it_cannot_run(tmp_path, monkeypatch):
    """No torchao, or a GPU below compute capability 8.9: the parent writes a `skipped: <why>`
    row and starts no process; other rows are not affected."""
    import importlib.util

    gt = _gpu_train()
    rows = gt.rows
    assert rows.problem("slapo_fp8", capability=lambda: (8, 0)) == (
        "fp8 needs FP8 tensor cores (compute capability 8.9+); this GPU is 8.0")
    assert rows.problem("slapo_offload", capability=lambda: (8, 0)) is None
    if importlib.util.find_spec("torchao") is not None:
        assert rows.problem("slapo_fp8", capability=lambda: (9, 0)) is None
        assert rows.problem("slapo_fp8", capability=lambda: None) is None  # CPU: emulated
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    assert "torchao" in rows.problem("slapo_fp8")

    def no_child(*a, **k):
        raise AssertionError("no process for a row that cannot run")

    monkeypatch.setattr(gt, "_run_child", no_child)
    args = gt.parse_args(["--out", str(tmp_path), "--skip", "llama-1b:hf_compile"])
    [row] = gt._run_one(args, "llama3-8b-8l", "slapo_fp8", tmp_path, None)
    assert row["status"].startswith("skipped: fp8 needs torchao"), row
    # --skip, and a compile row with less than its 60 s left, start nothing either
    assert gt._run_one(args, "llama-1b", "hf_compile", tmp_path, None)[0]["status"] == \
        "skipped: --skip"
    assert gt._run_one(args, "gpt2-medium", "hf_compile", tmp_path, 45.0)[0]["status"] == \
        "skipped: --deadline-s"


@pytest.mark.slow
def test_fp8_refused_in_the_child_is_a_skipped_row(tmp_path):
    """A torchao that is found but lacks the float8 training API (an old or partial install):
    the child's `slapo.build` refuses fp8, and the row says skipped with the reason, no crash.
    (Its metadata says 0.0.1, below transformers' minimum, so transformers leaves it alone, as
    it does with a real old torchao.)"""
    fake = tmp_path / "fake"
    (fake / "torchao").mkdir(parents=True)
    (fake / "torchao" / "__init__.py").write_text("")
    (fake / "torchao-0.0.1.dist-info").mkdir()
    (fake / "torchao-0.0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: torchao\nVersion: 0.0.1\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--models", "llama3-8b-8l",
                    "--variants", "slapo_fp8", "--knob", "compile_blocks=false", "--steps", "1",
                    "--warmup", "1", "--out", str(out)], check=True, capture_output=True,
                   text=True, timeout=300, env=env)
    [row] = json.loads((out / "results.json").read_text())
    assert row["status"].startswith("skipped: ") and "torchao" in row["status"], row


def test_llama3_8b_shaped_model_in_the_list():
    """LLaMA-3-8B's layer shapes with 8 layers (issue 36), its tiny twin for --tiny, and the
    FLOPs the MFU column counts for it."""
    import transformers

    gt = _gpu_train()
    cfg_cls, model_cls, kw, batch, seq = gt.MODELS["llama3-8b-8l"]
    assert (cfg_cls, model_cls, batch, seq) == ("LlamaConfig", "LlamaForCausalLM", 4, 2048)
    cfg = transformers.LlamaConfig(**kw)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 14336, 8)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (32, 8, 128256)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    assert theta == 500000.0 and not cfg.tie_word_embeddings
    layers = 8 * (2 * 4096**2 + 2 * 4096 * 128 * 8 + 3 * 4096 * 14336)  # 1.74B
    assert gt._non_embedding_params(cfg) == layers
    assert gt.model_flops_per_token(cfg, seq) == 6 * layers + 6 * 4096 * 128256 \
        + 12 * 8 * 4096 * 2048  # 14.4 GFLOP per token
    assert gt.parse_args(["--models", "llama3-8b-8l"]).models == "llama3-8b-8l"
    assert "tiny-llama3" in gt.MODELS
    assert "slapo_fp8" in gt.ALL_VARIANTS and "slapo_offload" in gt.ALL_VARIANTS


# ------------------------------------------------------------------------------------------------
# slapo_tuned: the tuner's search inside the benchmark
# ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tuned_row_measures_the_best_trial(tmp_path):
    """A `--tiny` slapo_tuned run on CPU: the cost model predicts both configs of a narrowed
    space, both are measured as trials, the faster one is measured again by the protocol and
    its row carries the chosen knobs, the prediction and the search. It trains the same model
    on the same batch as the HF rows (same first loss: same init, same tokens)."""
    [tuned] = _run(tmp_path, "--variants", "slapo_tuned", "--tune-knob",
                   "compile_blocks=false", "--tune-knob", "kernels=false", "--tune-trials", "2",
                   "--tune-budget-s", "600", "--no-tune-predict-ahead")
    assert tuned["variant"] == "slapo_tuned" and tuned["status"] == "ok", tuned
    assert tuned["tokens_per_s"] > 0 and tuned["batch"] == 2
    trials = tuned["tune"]["trials"]
    assert [t["status"] for t in trials] == ["ok", "ok"] and tuned["tune_trials"] == 2
    assert {t["config"]["fused_loss"] for t in trials} == {False, True}
    fastest = max(trials, key=lambda t: t["throughput"])
    assert tuned["tune"]["config"] == fastest["config"] and not tuned["tune"]["seeded"]
    assert tuned["tuned_knobs"]["fused_loss"] == fastest["config"]["fused_loss"]
    assert tuned["tuned_knobs"]["compile_blocks"] is False
    assert tuned["predicted_tokens_per_s"] == fastest["predicted_throughput"] > 0
    assert tuned["predicted_peak_gib"] > 0 and tuned["tune_s"] > 0
    gt = _gpu_train()  # the HF model of the hf_* rows, its loss on the same batch (fp32)
    model, cfg = gt.make_model("tiny-llama", "hf_sdpa", "cpu")
    hf_loss = model(**gt.make_batch("tiny-llama", cfg, 2, 64, "cpu")).loss.item()
    assert abs(tuned["loss_first"] - hf_loss) < 2e-2  # bf16 autocast vs fp32
    path = tmp_path / f"predictions.tiny-llama.{tuned['run_id']}.jsonl"
    preds = path.read_text().splitlines()
    assert {json.loads(p)["key"] for p in preds} == {
        json.dumps(t["config"], sort_keys=True, separators=(",", ":")) for t in trials}


def _gpu_train():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_seed_rows_take_only_this_runs_comparable_rows(tmp_path):
    """slapo_tuned seeds from rows of the same invocation, model and cap whose variant is a
    knob set of the space; nocudnn rows (another backend), other runs and failures stay out."""
    gt = _gpu_train()
    ok = dict(model="llama-1b", status="ok", batch=8, tokens_per_s=7e4, step_ms=230.0,
              peak_gib=35.0, cap_gib=0.0, run_id="A")
    rows = [dict(ok, variant="slapo_gpu"), dict(ok, variant="slapo_gpu", run_id="B"),
            dict(ok, variant="slapo_gpu_nocudnn"), dict(ok, variant="slapo_gpu", cap_gib=24.0),
            dict(ok, variant="hf_sdpa"), dict(ok, variant="slapo_gpu_sac", status="OOM"),
            dict(ok, variant="slapo_gpu", model="gpt2-medium"),
            dict(ok, variant="slapo_fp8"), dict(ok, variant="slapo_optim_offload"),
            dict(ok, variant="slapo_offload")]
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = gt.parse_args(["--out", str(tmp_path), "--run-id", "A"])
    seeds = gt.seed_rows("llama-1b", args)
    assert seeds == [({"mixed_precision": "bf16", "attention": "sdpa", "compile_blocks": True,
                       "fused_loss": True, "batch_size": 8},
                      {"throughput": 7e4, "step_time_s": 0.23, "source": "slapo_gpu",
                       "peak_memory_bytes": 35.0 * 2**30})]


def _space_and_predictions(cap: bool = False):
    """The real GPU space of the tiny LLaMA narrowed like slapo_tuned's, with made-up
    predictions (compiled and fused faster; memory grows with batch and shrinks with ckpt)."""
    from slapo.tune.best import restrict
    from slapo.tune.model_spaces import GPUSpaceArgs, gpu_space
    from slapo.tune.space import config_key

    spec = _gpu_train().spec_of("tiny-llama")
    space = gpu_space(spec, GPUSpaceArgs(batch_sizes=(2, 4) if cap else (2,),
                                         mixed_precision=("bf16",), ckpt_ratios=(0.0, 1.0),
                                         ckpt_policies=("full",)))
    restrict(space, {"kernels": (False,)})
    preds = {}
    for c in space.configs():
        speed = 100.0 * (1 + c["compile_blocks"]) * (1 + 0.5 * c["fused_loss"]) \
            * (1 - 0.2 * c["ckpt_ratio"]) * (1 + 0.1 * c["batch_size"])
        mem = c["batch_size"] * (10.0 - 6.0 * c["ckpt_ratio"])
        preds[config_key(c)] = {"throughput": speed, "step_time_s": 1 / speed, "memory": mem}
    return space, preds


def test_tune_best_prunes_by_the_cap_and_stops_at_max_trials():
    from slapo.tune.best import tune_best
    from slapo.tune.database import Database

    space, preds = _space_and_predictions(cap=True)
    calls = []

    def evaluate(config):  # peaks as predicted (a measured peak rescales the memory model)
        calls.append(config)
        mem = preds[json.dumps(config, sort_keys=True, separators=(",", ":"))]["memory"]
        return {"throughput": 50.0 + len(calls), "peak_memory_bytes": mem}

    best = tune_best(space, preds, evaluate, Database(), mem_cap=25.0, max_trials=3)
    assert len(calls) == 3 and best.report.new_trials == 3
    assert all(c["batch_size"] * (10.0 - 6.0 * c["ckpt_ratio"]) <= 25.0 for c in calls)
    assert best.config == calls[-1] and not best.seeded
    assert best.predicted == preds[json.dumps(best.config, sort_keys=True,
                                              separators=(",", ":"))]
    assert {t["status"] for t in best.to_json()["trials"]} == {"ok"}


def test_tune_best_budget_and_seeds():
    """A spent budget starts no trial: the seeded measurement is the winner. A row whose knob
    set the space lacks (fuse=True) or whose knob values differ is not seeded."""
    from slapo.tune.best import seed_database, tune_best
    from slapo.tune.database import Database

    space, preds = _space_and_predictions()
    db = Database()
    gpu = {"mixed_precision": "bf16", "attention": "sdpa", "compile_blocks": True,
           "fused_loss": True, "batch_size": 2}
    entered = seed_database(db, space, [
        (gpu, {"throughput": 123.0}),
        ({"mixed_precision": "bf16", "attention": "sdpa", "fuse": True, "batch_size": 2},
         {"throughput": 1.0}),
        ({**gpu, "batch_size": 64}, {"throughput": 1.0})])
    assert entered == [{**gpu, "kernels": False, "ckpt_ratio": 0.0}]

    def evaluate(config):
        raise AssertionError("no trial may start after the budget")

    best = tune_best(space, preds, evaluate, db, max_trials=3, budget_s=0.0)
    assert best.seeded and best.measured["throughput"] == 123.0
    assert best.report.new_trials == 0 and "budget" in best.report.stopped_because


@pytest.mark.parametrize("argv,text", [
    (["--tiny", "--models", "falcon"], "unknown model(s) tiny-falcon"),
    (["--models", "llama-7b"], "unknown model(s) llama-7b"),
    (["--variants", "slapo_tuned,slapo_best"], "unknown variant(s) slapo_best"),
    (["--tune-knob", "compile_blocks=maybe"], "compile_blocks"),
    (["--tune-knob", "warp_speed=true"], "warp_speed"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--tune-trials", "0"], "--tune-trials must be >= 1"),
    (["--cap-batches", "8,sixteen"], "--cap-batches must be comma-separated integers"),
    (["--knob", "compile_blocks=true,false"], "one value (NAME=VALUE)"),
    (["--knob", "offload_ratio=2"], "offload_ratio"),
    (["--skip", "llama-1b"], "--skip takes MODEL:VARIANT pairs"),
    (["--fp8-min-dim", "8"], "--fp8-min-dim must be >= 16")])
def test_bad_options_are_usage_errors(argv, text, capsys):
    """Checked when the options are parsed, before the first child or file (exit 2)."""
    with pytest.raises(SystemExit) as e:
        _gpu_train().parse_args(argv)
    assert e.value.code == 2 and text in capsys.readouterr().err


def _session(tmp_path, mode: str, form: str, **env) -> tuple[Path, list[dict], str]:
    script = SCRIPT.parent / "gpu_session.sh"
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK": str(tmp_path / f"work{mode}"),
           "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", str(script), mode, form], env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [json.loads(x) for x in (out / f"results.{mode}.jsonl").read_text().splitlines()]
    log = (out / f"call.{mode}.log").read_text()
    assert "Traceback" not in log and "error:" not in log, log[-2000:]
    return out, rows, log


def _four_files(mode: str) -> list[str]:
    return [f"{k}.{mode}.{e}" for k, e in (("call", "log"), ("env", "txt"), ("results", "jsonl"),
                                           ("work", "tar.gz"))]


def test_session_plan_dry_form(tmp_path):
    """`gpu_session.sh N --plan`: every planned gpu_train.py command parses and runs (each
    variant skipped by a 1 s deadline, BERT's compile row of the table by --skip), the
    call's summary table is printed, and $OUT gets at most 8 files (the device's limit)."""
    runs = {"1": {"table", "llama3_8b", "fp8_offload_1b", "bert_compile"},
            "2": {"cap24_offload", "sac_tuned", "gpt2_cudnn", "gpt2_dropout0", "cap24",
                  "kernels"}}
    for mode in ("1", "2"):
        out, rows, log = _session(tmp_path, mode, "--plan")
        assert rows and all(r["status"].startswith("skipped: --") for r in rows), rows
        assert {r["run"] for r in rows} == runs[mode]
        assert f"== summary of call {mode}" in log
    assert sorted(p.name for p in out.iterdir()) == sorted(_four_files("1") + _four_files("2"))


def test_session_plan_mode_1_order_and_rows(tmp_path):
    """Call 1's plan (issue 37's order): the three models' table first (BERT's compile row
    left to the last step), then the 8B-shaped model's bf16 / fp8 / HF + compile rows."""
    _, rows, _ = _session(tmp_path, "1", "--plan")
    got = [(r["run"], r["model"], r["variant"], r["status"]) for r in rows]
    assert got[:3] == [("table", m, "slapo_gpu", "skipped: --deadline-s")
                       for m in ("tiny-llama", "tiny-gpt2", "tiny-bert")]
    assert ("table", "tiny-bert", "hf_compile", "skipped: --skip") in got
    assert [g[1:3] for g in got if g[0] == "llama3_8b"] == [
        ("tiny-llama3", "slapo_gpu"), ("tiny-llama3", "slapo_fp8"), ("tiny-llama3", "hf_compile")]
    assert [g[0] for g in got][-1] == "bert_compile"


def test_session_with_no_time_left_writes_a_row_per_step(tmp_path):
    """The session's time box: with no time left (SESSION_S=5) no step starts, each is one
    row saying so, and the call still ends with its four files."""
    out, rows, log = _session(tmp_path, "1", "--tiny", SESSION_S="5")
    assert rows == [{"run": r, "status": "skipped: no time left in the session"}
                    for r in ("table", "llama3_8b", "fp8_offload_1b", "bert_compile")]
    assert "== table: skipped (no time left" in log
    assert sorted(p.name for p in out.iterdir()) == sorted(_four_files("1"))


def test_session_plan_call_3_dry_form(tmp_path):
    """`gpu_session.sh 3 --tiny`: the owed checks are listed and skipped, 4 files in $OUT."""
    out, _, log = _session(tmp_path, "3", "--tiny")
    for name in ("graph_breaks", "partition", "tempo", "tempo_eager", "rnn", "wideresnet"):
        assert f"== {name}: skipped (dry form" in log, log[-2000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(_four_files("3"))


def test_a_seeded_winner_is_that_row(tmp_path):
    """When no trial beats the run's slapo_gpu row, slapo_tuned reports that row (measured by
    the same protocol), marked `measured_by`, with the knobs, the prediction and the
    calibrated step time (measured/predicted of the seed)."""
    from slapo.tune.best import seed_database, tune_best
    from slapo.tune.database import Database

    gt = _gpu_train()
    row = dict(model="tiny-llama", variant="slapo_gpu", status="ok", batch=2, seq=64,
               tokens_per_s=123.0, step_ms=1040.0, compile_s=1.0, loss_first=6.2,
               loss_last=6.1, mfu=0.0, cap_gib=0.0, run_id="A")
    (tmp_path / "results.jsonl").write_text(json.dumps(row) + "\n")
    args = gt.parse_args(["--tiny", "--out", str(tmp_path), "--run-id", "A"])
    space, preds = _space_and_predictions()
    db = Database()
    entered = seed_database(db, space, gt.seed_rows("tiny-llama", args))
    best = tune_best(space, preds, lambda c: {"throughput": 1.0}, db, max_trials=2)
    assert best.seeded and best.report.new_trials == 2
    out = gt.tuned_row("tiny-llama", 64, args, best, 1.5, gt._calibration(db, entered, preds))
    assert out["variant"] == "slapo_tuned" and out["measured_by"] == "slapo_gpu"
    assert out["tokens_per_s"] == 123.0 and out["seeded_configs"] == 1
    assert out["tuned_knobs"] == {"attention": "sdpa", "compile_blocks": True,
                                  "fused_loss": True, "kernels": False, "ckpt_ratio": 0.0}
    key = json.dumps(best.config, sort_keys=True, separators=(",", ":"))
    assert out["predicted_step_ms_calibrated"] == pytest.approx(1040.0)  # the seed itself
    assert out["predicted_tokens_per_s"] == preds[key]["throughput"]


def test_cli_gpu_setup_goes_through_best():
    """`slapo tune --space gpu` builds its space, cost model and evaluator with
    `slapo.tune.best.gpu_search_setup`, as the benchmark's tuned row does."""
    import argparse

    from slapo.tune.cli import _gpu_setup, add_tune_parser
    from slapo.tune.evaluators import GPUTrialEvaluator
    from slapo.tune.predict_gpu import GPUCostModel

    parser = argparse.ArgumentParser()
    add_tune_parser(parser.add_subparsers())
    args = parser.parse_args(["tune", "--space", "gpu", "--model", "gpt2-medium",
                              "--device", "cpu", "--precisions", "bf16", "--steps", "2"])
    space, predict, evaluate, meta = _gpu_setup(args)
    assert isinstance(predict, GPUCostModel) and isinstance(evaluate, GPUTrialEvaluator)
    assert evaluate.inner.start_method == "spawn" and evaluate.settings.steps == 2
    assert space.candidates("batch_size") == [8, 16, 32]
    assert {"compile_blocks", "fused_loss", "kernels", "ckpt_ratio"} <= set(space.names())
    assert meta["model"] == "gpt2-medium" and meta["settings"]["device"] == "cpu"


@pytest.mark.slow
def test_graph_breaks_script_counts_and_refuses(tmp_path):
    """`benchmarks/graph_breaks.py` (run on the device by `gpu_session.sh 3`): a row per model x
    knob set with dynamo's graphs and breaks; the schedules compile whole here (torch 2.13,
    CPU); an unknown knob set is a usage error."""
    script = SCRIPT.parent / "graph_breaks.py"
    out = tmp_path / "gb.json"
    subprocess.run([sys.executable, str(script), "--models", "llama,t5", "--knobs", "gpu",
                    "--backend", "eager", "--seq", "16", "--out", str(out)], check=True,
                   capture_output=True, text=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["knobs"]) for r in rows] == [("llama", "gpu"), ("t5", "gpu")]
    assert all(r["status"] == "ok" and r["graphs"] >= 1 and r["breaks"] == 0 for r in rows)
    bad = subprocess.run([sys.executable, str(script), "--knobs", "nope"], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(SCRIPT.parents[1])})
    assert bad.returncode == 2 and "unknown model or knob set: nope" in bad.stderr
