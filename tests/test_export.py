"""`slapo export`: a sharded `slapo train` checkpoint becomes a Hugging Face directory that
`AutoModel*.from_pretrained` loads and that computes the trained model's logits."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import sweep
import torch
import torch.distributed as dist

from slapo.data.sources import InputError
from slapo.train.export import export_run

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, seq_len=32, batch_size=8, steps=3,
            progress=False, plot=False, eval_batches=0, dropout=0.0)
PROBE = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def probe(model: str) -> dict:
    """The probe batch as the model takes it (T5 also needs decoder inputs)."""
    if model == "t5":
        return {"input_ids": PROBE, "decoder_input_ids": PROBE[:, :8]}
    return {"input_ids": PROBE}


def job_train_then_logits(options: dict) -> dict:
    """Every rank: train (saving checkpoints), then rebuild the run from its checkpoint the way
    `--resume` does and return the scheduled model's logits on a fixed probe batch."""
    from slapo.train import TrainConfig, train
    from slapo.train.assemble import build
    from slapo.train.resume import resume
    from slapo.train.setup import setup, teardown

    torch.set_num_threads(1)
    train(TrainConfig(**options))
    cfg = TrainConfig(**{**options, "resume": "latest", "steps": options["steps"]})
    env = setup(cfg)
    try:
        run = build(cfg, env, log=lambda *a, **k: None)
        resume(run, log=lambda *a, **k: None)
        if (options.get("pp_stages") or 1) > 1:
            # no rank holds the whole trained model (the other stages' copies on this rank are
            # untrained): return what this rank trained, under the model's names
            owned = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
            params = {n: p.detach().clone() for n, p in run.model.named_parameters()
                      if id(p) in owned}
            return {"params": params, "step": run.step}
        run.model.eval()
        with torch.no_grad():
            logits = run.model(**probe(options["model"])).logits
    finally:
        teardown(env)
    return {"logits": logits.tolist(), "step": run.step}


def _auto(task: str):
    import transformers

    return getattr(transformers, {"causal": "AutoModelForCausalLM",
                                  "masked": "AutoModelForMaskedLM",
                                  "seq2seq": "AutoModelForSeq2SeqLM"}[task])


@pytest.mark.dist
@pytest.mark.parametrize("model,task", [("gpt2", "causal"), ("llama", "causal")])
def test_export_of_tp_inside_fsdp2_reproduces_the_trained_models_logits(dist4, tmp_path, model,
                                                                         task):
    """--tp 2 --dp-shard on 4 ranks: the checkpoint's reshaped 2-D layout (GPT-2's Conv1D and
    fused q|k|v, LLaMA's Linear rows and columns) exports to the model the run resumes."""
    opts = {**TINY, "model": model, "tp": 2, "dp_shard": True, "out": str(tmp_path / "run"),
            "save_every": 3}
    res = dist4.run(job_train_then_logits, opts)
    result = export_run(tmp_path / "run", tmp_path / "hf", log=lambda *a: None)
    assert result.step == 3 and result.max_logit_diff == 0.0
    reloaded = _auto(task).from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    with torch.no_grad():
        got = reloaded(input_ids=PROBE).logits
    for r in res:  # every rank resumed the same model
        torch.testing.assert_close(got, torch.tensor(r["logits"]), rtol=1e-4, atol=1e-4)


# CI's default sample (tests/sweep.py): one family per layout, and LLaMA's GQA, T5's head-
# sharded bias and ALBERT's shared layer; test_export_families exports every family from a
# directory in each layout on every run, and SLAPO_SWEEP=all runs every row here
EXPORT_ROWS = [
    ("gpt2", "causal", {"tp": 2}),            # fused c_attn shards (blocks=3), vocab-parallel head
    ("llama", "causal", {"pp_stages": 2}),    # each rank saved its own stage
    ("t5", "seq2seq", {"pp_stages": 2}),      # encoder / decoder ranks; embedding tied to head
    ("bert", "masked", {"tp": 2}),
    ("opt", "causal", {"dp_shard": True}),    # FSDP2: each rank saved its dp shard
    # every other family's TP layout too: LLaMA's GQA k/v, OPT's, GPT-Neo's, RoBERTa's, T5's
    # relative-position bias sharded over heads, ALBERT's one shared layer
    ("llama", "causal", {"tp": 2}),
    ("opt", "causal", {"tp": 2}),
    ("gpt_neo", "causal", {"tp": 2}),
    ("roberta", "masked", {"tp": 2}),
    ("albert", "masked", {"tp": 2}),
    ("t5", "seq2seq", {"tp": 2}),
    # every other pipelined family: GPT-2's wte tied to its head and BERT/RoBERTa's MLM decoder
    # tied to the word embedding sit on the first and the last stage (two ranks)
    ("gpt2", "causal", {"pp_stages": 2}),
    ("bert", "masked", {"pp_stages": 2}),
    ("roberta", "masked", {"pp_stages": 2}),
    ("opt", "causal", {"pp_stages": 2}),
    ("gpt_neo", "causal", {"pp_stages": 2}),
    # every other family under FSDP2 (dp shards gathered into whole tensors; ALBERT's one
    # shared layer, T5's tied head)
    ("gpt2", "causal", {"dp_shard": True}),
    ("llama", "causal", {"dp_shard": True}),
    ("gpt_neo", "causal", {"dp_shard": True}),
    ("bert", "masked", {"dp_shard": True}),
    ("roberta", "masked", {"dp_shard": True}),
    ("albert", "masked", {"dp_shard": True}),
    ("t5", "seq2seq", {"dp_shard": True}),
]
EXPORT_SAMPLE = [0, 1, 2, 3, 4, 5, 10, 21]  # indices into EXPORT_ROWS


@pytest.mark.dist
@pytest.mark.parametrize("model,task,knobs", sweep.sample(
    EXPORT_ROWS, [EXPORT_ROWS[i] for i in EXPORT_SAMPLE]))
def test_export_reproduces_the_trained_models_logits(dist2, tmp_path, model, task, knobs):
    opts = {**TINY, "model": model, **knobs, "out": str(tmp_path / "run"), "save_every": 3}
    res = dist2.run(job_train_then_logits, opts)
    assert res[0]["step"] == 3

    result = export_run(tmp_path / "run", tmp_path / "hf", log=lambda *a: None)
    assert result.step == 3 and result.max_logit_diff == 0.0
    reloaded = _auto(task).from_pretrained(str(tmp_path / "hf"), local_files_only=True).eval()
    if "params" in res[0]:  # pipeline: every stage's trained tensors, exactly, from their rank
        exported = dict(reloaded.named_parameters())
        seen = set()
        for r in res:
            for name, value in r["params"].items():
                assert torch.equal(exported[name], value), name
                seen.add(name)
        assert seen == set(exported)
        return
    with torch.no_grad():
        got = reloaded(**probe(model)).logits
    # the run's schedule (SDPA, TP all-reduces) sums in another order than HF eager: fp32 noise
    torch.testing.assert_close(got, torch.tensor(res[0]["logits"]), rtol=1e-4, atol=1e-4)
    info = json.loads((tmp_path / "hf" / "slapo_export.json").read_text())
    assert info["step"] == 3 and info["model"] == model
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_export_refuses_bad_input_and_writes_nothing(tmp_path):
    (tmp_path / "notarun").mkdir()
    with pytest.raises(InputError, match="not a `slapo train` run directory"):
        export_run(tmp_path / "notarun", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    out = tmp_path / "full"
    out.mkdir()
    (out / "x").write_text("keep me")
    with pytest.raises(InputError, match="not empty"):
        export_run(tmp_path / "notarun", out)
    assert (out / "x").read_text() == "keep me"


def test_export_names_a_missing_step_and_lists_the_saved_ones(tmp_path, one_thread):
    from slapo.train import TrainConfig, train

    train(TrainConfig(**{**TINY, "model": "gpt2", "out": str(tmp_path / "run"), "steps": 2,
                         "save_every": 1}))
    with pytest.raises(InputError, match=r"saved steps \(1, 2\)"):
        export_run(tmp_path / "run", tmp_path / "hf", step=7)
    # a damaged newest checkpoint: export takes the newest intact one (as --resume does)
    shard = next((Path(tmp_path) / "run/checkpoints/step_000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    result = export_run(tmp_path / "run", tmp_path / "hf", log=lambda *a: None)
    assert result.step == 1


def test_a_failed_export_leaves_nothing_behind(tmp_path, one_thread, monkeypatch):
    """Whatever fails after writing began (here the reload check), neither OUT nor OUT.tmp
    is left: nothing that looks like an export, nothing to clean up by hand."""
    from slapo.train import TrainConfig, export, train

    train(TrainConfig(**{**TINY, "model": "gpt2", "hidden_size": 32, "num_heads": 2,
                         "seq_len": 16, "batch_size": 2, "steps": 1,
                         "out": str(tmp_path / "run")}))

    def failing_check(directory, model, task):
        assert (directory / "model.safetensors").is_file()  # it fails after writing
        raise RuntimeError("export check failed: planted")

    monkeypatch.setattr(export, "_check_reload", failing_check)
    with pytest.raises(RuntimeError, match="planted"):
        export_run(tmp_path / "run", tmp_path / "hf", log=lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_slapo_export_command(tmp_path, one_thread, capsys):
    from slapo.cli import main

    assert main(["train", "--model", "bert", "--hidden-size", "32", "--num-layers", "2",
                 "--num-heads", "2", "--seq-len", "16", "--batch-size", "2", "--steps", "1",
                 "--no-progress", "--no-plot", "--eval-batches", "0",
                 "--out", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert "reloaded logits match" in capsys.readouterr().out
    from transformers import AutoModelForMaskedLM

    AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "x")]) == 2
    assert "slapo export: error:" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    # a damaged run file: one line naming it (was a traceback), nothing written
    (tmp_path / "run" / "run.json").write_text("garbage")
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "slapo export: error:" in err and "run.json: not a JSON file" in err, err
    assert "Traceback" not in err and not (tmp_path / "y").exists()


def job_save_pretrained(out: str, how: str) -> dict:
    """Build a sharded GPT-2 (TP=2, FSDP2 over 2 ranks, or both on 4), take a step,
    save_pretrained on every rank; return what a whole model must hold (gathered here
    independently) and the sharded model's logits."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import slapo
    from slapo import model_schedule
    from slapo.runtime.save import full_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                                       n_positions=64))
    if how == "tp":
        mesh = slapo.init_mesh(dp=1, tp=2)
        sch = model_schedule.apply(model, tp=2, mesh=mesh)
        built, _ = slapo.build(sch, mesh=mesh, optimizer=torch.optim.SGD,
                               optimizer_kwargs={"lr": 0.1})
    elif how == "tp_fsdp":  # 4 ranks: FSDP2 shards of TP shards
        mesh = slapo.init_mesh(dp=2, tp=2)
        sch = model_schedule.apply(model, tp=2, mesh=mesh)
        built, _ = slapo.build(sch, mesh=mesh, data_parallel="fsdp", optimizer=torch.optim.SGD,
                               optimizer_kwargs={"lr": 0.1})
    else:
        mesh = slapo.init_mesh(dp=2)
        built, _ = slapo.build(slapo.create_schedule(model, mesh=mesh), mesh=mesh,
                               data_parallel="fsdp", optimizer=torch.optim.SGD,
                               optimizer_kwargs={"lr": 0.1})
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    built.train_step({"input_ids": ids, "labels": ids})
    built.save_pretrained(out)
    whole = full_state_dict(built)
    built.eval()
    with torch.no_grad():
        logits = built(input_ids=ids).logits
    return {"logits": logits, **{k: v.detach().clone() for k, v in whole.items()}}


@pytest.mark.dist
@pytest.mark.parametrize("how", ["tp", "fsdp", "tp_fsdp"])
def test_save_pretrained_of_a_sharded_model_writes_whole_tensors(request, tmp_path, how):
    from transformers import GPT2LMHeadModel

    pool = request.getfixturevalue("dist4" if how == "tp_fsdp" else "dist2")
    res = pool.run(job_save_pretrained, str(tmp_path / "hf"), how)
    assert all(r.keys() == res[0].keys() and all(torch.equal(r[k], res[0][k]) for k in r)
               for r in res)  # every rank consolidated the same whole model
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    for name, value in loaded.state_dict().items():
        if name in res[0]:
            assert torch.equal(value, res[0][name]), name
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the whole model computes what the sharded one did
        got = loaded.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, res[0]["logits"], rtol=1e-4, atol=1e-4)
    assert loaded.transformer.h[0].attn.c_attn.weight.shape == (32, 96)  # whole, not (32, 48)


# ---- one run per --out: a fresh run never damages another ------------------------------------
CLI = ["--model", "gpt2", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "2",
       "--seq-len", "16", "--batch-size", "2", "--no-progress", "--no-plot",
       "--eval-batches", "0"]


def _files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (what "nothing changed" compares)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def _steps(out: Path) -> list[int]:
    from slapo.train import checkpoints

    return sorted(checkpoints.step_of(p) for p in checkpoints.candidates(out))


def test_a_fresh_run_into_a_run_directory_is_refused_and_changes_nothing(tmp_path, one_thread,
                                                                        capsys):
    """Exit status 2 naming the directory and the three ways on; not one byte changes (the
    old run's metrics, checkpoints, run id, and the user's own file)."""
    from slapo.cli import main

    out = tmp_path / "run"
    assert main(["train", *CLI, "--steps", "2", "--save-every", "1", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["train", *CLI, "--steps", "3", "--seed", "5", "--out", str(out)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(out) in err and "already holds a run" in err
    assert "--resume" in err and "--overwrite" in err and "another --out" in err
    assert _files(out) == before
    with pytest.raises(ValueError, match="--overwrite replaces the run"):
        from slapo.train import TrainConfig

        TrainConfig(out=str(out), overwrite=True, resume="latest").check()
    # a directory with only the user's files (or an empty one) takes a fresh run
    free = tmp_path / "free"
    free.mkdir()
    (free / "notes.txt").write_text("mine")
    assert main(["train", *CLI, "--steps", "1", "--out", str(free)]) == 0
    assert (free / "notes.txt").read_text() == "mine" and _steps(free) == [1]


def job_refuse_then_overwrite(out: str) -> dict:
    """Every rank: a run, a fresh run into it (refused on every rank, before the process
    group is used: no rank waits for another), then --overwrite."""
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    opts = {**TINY, "model": "gpt2", "hidden_size": 32, "num_heads": 2, "seq_len": 16,
            "batch_size": 4, "steps": 1, "tp": 2, "out": out}
    train(TrainConfig(**opts))
    first = json.loads((Path(out) / "run.json").read_text())["run_id"]
    try:
        train(TrainConfig(**{**opts, "seed": 1}))
        refused = None
    except InputError as e:
        refused = str(e)
    train(TrainConfig(**{**opts, "seed": 1, "overwrite": True}))
    second = json.loads((Path(out) / "run.json").read_text())["run_id"]
    # rank 0 cannot claim (run.json is a directory): every rank stops at once, none waits
    bad = Path(out + "-bad")
    if dist.get_rank() == 0:
        (bad / "run.json").mkdir(parents=True)
        (bad / "run.json" / "x").write_text("in the way")
    dist.barrier()
    t0 = time.monotonic()
    try:
        train(TrainConfig(**{**opts, "out": str(bad)}))
        claim_error = None
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        claim_error = f"{type(e).__name__}: {e}"
    return {"refused": refused, "first": first, "second": second, "claim_error": claim_error,
            "claim_s": time.monotonic() - t0}


@pytest.mark.dist
def test_a_fresh_run_into_a_run_directory_is_refused_on_every_rank(dist2, tmp_path):
    res = dist2.run(job_refuse_then_overwrite, str(tmp_path / "run"), timeout=240)
    for r in res:
        assert r["refused"] is not None and "already holds a run" in r["refused"]
        assert r["first"] != r["second"]
        assert r["claim_s"] < 30  # the collectives' timeout is 60 s
    assert "run.json" in res[0]["claim_error"] and "Error" in res[0]["claim_error"]
    assert "rank 0 could not prepare --out" in res[1]["claim_error"]
    assert export_run(tmp_path / "run", tmp_path / "hf", log=lambda *a: None).step == 1


def test_overwrite_replaces_the_old_run_cleanly(tmp_path, one_thread):
    """--overwrite: the old run's checkpoints, metrics and run id are gone (the user's file
    stays); export and --resume then see only the new run."""
    from slapo.train import TrainConfig, train

    out = tmp_path / "run"
    opts = {**TINY, "model": "gpt2", "hidden_size": 32, "num_heads": 2, "seq_len": 16,
            "batch_size": 2, "out": str(out)}
    train(TrainConfig(**{**opts, "steps": 4, "save_every": 1}))
    old_id = json.loads((out / "run.json").read_text())["run_id"]
    (out / "notes.txt").write_text("mine")
    new = train(TrainConfig(**{**opts, "steps": 2, "seed": 3, "overwrite": True}))
    assert _steps(out) == [2]  # not the old run's 1, 3, 4
    assert (out / "notes.txt").read_text() == "mine"
    assert json.loads((out / "run.json").read_text())["run_id"] != old_id
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert json.loads((out / "metrics.json").read_text())["losses"] == new["losses"]
    assert export_run(out, tmp_path / "hf", log=lambda *a: None).step == 2
    resumed = train(TrainConfig(**{**opts, "steps": 3, "seed": 3, "resume": "latest"}))
    assert resumed["resumed_from"] == 2 and resumed["losses"][:2] == new["losses"]


def test_export_and_resume_ignore_a_foreign_checkpoint(tmp_path, one_thread, capsys):
    """A newer checkpoint of another run copied into the directory (or one an interrupted
    --overwrite left behind) is never exported nor resumed, and is left alone."""
    import shutil

    from slapo.train import TrainConfig, checkpoints, run_owner, train
    from slapo.train import run_state as ckpt

    opts = {**TINY, "model": "gpt2", "hidden_size": 32, "num_heads": 2, "seq_len": 16,
            "batch_size": 2}
    train(TrainConfig(**{**opts, "steps": 2, "out": str(tmp_path / "a")}))
    train(TrainConfig(**{**opts, "steps": 4, "seed": 9, "out": str(tmp_path / "b")}))
    foreign = checkpoints.checkpoint_dir(tmp_path / "a", 4)
    shutil.copytree(checkpoints.checkpoint_dir(tmp_path / "b", 4), foreign)
    assert ckpt.verify(foreign) is None  # intact, newer, and not this run's
    kept = _files(foreign)

    result = export_run(tmp_path / "a", tmp_path / "hf", log=lambda *a: None)
    assert result.step == 2 and result.checkpoint.name == "step_000002"
    with pytest.raises(InputError, match="belongs to another run"):
        export_run(tmp_path / "a", tmp_path / "hf4", step=4)
    assert not (tmp_path / "hf4").exists()

    capsys.readouterr()
    resumed = train(TrainConfig(**{**opts, "steps": 3, "save_every": 1, "keep_last": 1,
                                   "out": str(tmp_path / "a"), "resume": "latest"}))
    assert resumed["resumed_from"] == 2
    assert "step_000004: it belongs to another run" in capsys.readouterr().err
    assert _files(foreign) == kept  # not pruned by keep_last
    assert _steps(tmp_path / "a") == [3, 4]
    # this run reaching step 4 keeps the other run's step 4, moved aside, byte for byte
    train(TrainConfig(**{**opts, "steps": 4, "save_every": 1, "keep_last": 1,
                         "out": str(tmp_path / "a"), "resume": "latest"}))
    other = json.loads((tmp_path / "b" / "run.json").read_text())["run_id"]
    assert _files(foreign.with_name(f"step_000004.other-run-{other}")) == kept
    assert _steps(tmp_path / "a") == [4]
    assert run_owner.owner_problem(foreign, run_owner.run_id(tmp_path / "a")) is None  # its own now
