"""A `slapo train --lora-r` run saved, resumed and exported: its DCP checkpoints hold the
adapters and their AdamW state (no frozen base) and resume bit for bit under --tp 2;
`slapo export --adapter` writes what `peft.PeftModel.from_pretrained(base, OUT)` loads and
`--merge` what `AutoModelForCausalLM.from_pretrained(OUT)` loads, both giving the trained
model's loss. Bad export input is refused with nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_lora import LORA, save_base

pytest.importorskip("peft")

PROBE = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))


def job_lora_run(options: dict) -> dict:
    """`slapo train`'s loop (resume, claim --out, steps, saves), then the trained model's loss
    on the probe batch (every rank)."""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import save_noted, train_one_step
    from slapo.train.resume import resume
    from slapo.train.setup import claim_out, setup, teardown

    torch.set_num_threads(1)
    quiet = lambda *a, **k: None  # noqa: E731
    cfg = TrainConfig(**options)
    cfg.check()
    env = setup(cfg)
    try:
        run = build(cfg, env, log=quiet)
        if cfg.resume_target() is not None:
            resume(run, log=quiet)
        claim_out(cfg, env)
        while run.step < cfg.steps:
            train_one_step(run)
            if run.step % cfg.save_every == 0 or run.step == cfg.steps:
                save_noted(run)
        run.model.eval()
        with torch.no_grad():
            probe = run.model(input_ids=PROBE, labels=PROBE).loss.item()
    finally:
        teardown(env)
    return {"losses": run.losses, "probe": probe}


def _quiet(*a, **k):
    pass


def _loss(model) -> float:
    with torch.no_grad():
        return model.eval()(input_ids=PROBE, labels=PROBE).loss.item()


def _checkpoint_bytes(path: Path) -> dict[str, int]:
    """Bytes of the model and optimizer-moment tensors a checkpoint holds, by kind."""
    from slapo.train.checkpoint_read import SafeReader

    meta = SafeReader(str(path)).read_metadata().state_dict_metadata
    out = {"model": 0, "moments": 0, "base_keys": 0, "model_keys": 0, "state_keys": 0}
    for key, m in meta.items():
        if not hasattr(m, "size"):
            continue
        size = torch.Size(m.size).numel() * m.properties.dtype.itemsize
        if key.startswith("model."):
            out["model"] += size
            out["model_keys"] += 1
            out["base_keys"] += "lora_" not in key
        elif key.startswith("optim.state."):
            out["state_keys"] += 1
            out["base_keys"] += "lora_" not in key
            out["moments"] += size if key.endswith(("exp_avg", "exp_avg_sq")) else 0
    return out


@pytest.mark.dist
def test_lora_tp2_run_resumes_exactly_and_exports_adapter_and_merged(dist2, tmp_path):
    import peft
    import transformers
    from safetensors import safe_open

    from slapo.train.export import export_run

    base = save_base(tmp_path / "base")
    opts = {**LORA, "model": base, "tp": 2, "steps": 4, "save_every": 2,
            "out": str(tmp_path / "a")}
    straight = dist2.run(job_lora_run, opts)
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = dist2.run(job_lora_run, {**opts, "out": str(tmp_path / "b"), "resume": str(step2)})
    assert straight[0] == straight[1] and resumed[0] == resumed[1]
    assert resumed[0]["losses"] == straight[0]["losses"]  # steps 3-4 bit for bit
    assert resumed[0]["probe"] == straight[0]["probe"]

    held = _checkpoint_bytes(tmp_path / "a" / "checkpoints" / "step_000004")
    assert held["base_keys"] == 0 and held["model_keys"] == 28, held  # adapters only
    assert held["state_keys"] == 3 * 28 and held["moments"] == 2 * held["model"], held

    trained = straight[0]["probe"]
    export_run(tmp_path / "a", tmp_path / "adapter", adapter=True, log=_quiet)
    with safe_open(str(tmp_path / "adapter" / "adapter_model.safetensors"), "pt") as fh:
        keys = sorted(fh.keys())
    assert len(keys) == 28 and keys[0] == \
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight", keys[0]  # PEFT's names
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    assert _loss(hf) != pytest.approx(trained, rel=1e-3)  # the adapters changed the loss
    with_adapter = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))
    assert _loss(with_adapter) == pytest.approx(trained, rel=1e-5)

    export_run(tmp_path / "a", tmp_path / "merged", merge=True, log=_quiet)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                 local_files_only=True)
    assert _loss(merged) == pytest.approx(trained, rel=1e-5)
    info = json.loads((tmp_path / "merged" / "slapo_export.json").read_text())
    assert info["lora"]["export"] == "merged" and info["step"] == 4

    # `slapo eval` of the tp=2 run in one process: the merged export's val loss
    from slapo.train.evaluate import eval_target

    run = eval_target(tmp_path / "a", eval_batches=2, log=_quiet)
    hf = eval_target(tmp_path / "merged", seq_len=16, batch_size=4, eval_batches=2, log=_quiet)
    assert run["step"] == 4 and run["val_loss"] == pytest.approx(hf["val_loss"], rel=1e-5)


def test_lora_export_refuses_bad_input_and_merges_a_registry_base(tmp_path, one_thread):
    """A LoRA run without --adapter/--merge, --adapter on a registry model's LoRA run (no base
    that from_pretrained loads) and --merge on a full run: refused, nothing written. --merge
    rebuilds the registry model's seeded base and gives the trained loss."""
    import transformers

    from slapo.data.sources import InputError
    from slapo.train.export import export_run

    lora = job_lora_run({**LORA, "steps": 2, "save_every": 2, "out": str(tmp_path / "lora")})
    job_lora_run({**LORA, "lora_r": 0, "lora_alpha": None, "steps": 1, "save_every": 1,
                  "out": str(tmp_path / "full")})
    for run, kw, says in (("lora", {}, "pass --adapter"),
                          ("lora", {"adapter": True}, "fresh init of 'llama'"),
                          ("full", {"merge": True}, "trained no LoRA adapters")):
        with pytest.raises(InputError, match=says):
            export_run(tmp_path / run, tmp_path / "out", log=_quiet, **kw)
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
    from slapo.cli import main

    assert main(["export", str(tmp_path / "lora"), "--out", str(tmp_path / "out")]) == 2
    with pytest.raises(SystemExit) as both:  # argparse: one of them
        main(["export", str(tmp_path / "lora"), "--out", str(tmp_path / "out"), "--adapter",
              "--merge"])
    assert both.value.code == 2 and not (tmp_path / "out").exists()
    assert main(["export", str(tmp_path / "lora"), "--out", str(tmp_path / "merged"),
                 "--merge", "--no-check"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                 local_files_only=True)
    assert _loss(merged) == pytest.approx(lora["probe"], rel=1e-5)


@pytest.mark.dist
def test_sft_chat_lora_tp2_run_exports_and_evaluates(dist2, tmp_path):
    """Issue 35's chain: `slapo train --model DIR --lora-r 4 --tp 2 --data chat.jsonl --sft pack
    --tokenizer TOK` (chat rows rendered with the tokenizer's template), `slapo export
    --adapter` loads in `PeftModel.from_pretrained` with the trained loss, `--merge` in
    `AutoModelForCausalLM`, and `slapo eval` of the run equals the merged model's val loss on
    the same SFT rows."""
    import peft
    import transformers
    from test_sft_data import CHAT, CHATML, word_tokenizer

    from slapo.train.evaluate import eval_target
    from slapo.train.export import export_run

    base = save_base(tmp_path / "base")
    tok = str(word_tokenizer(tmp_path / "tok", CHATML))
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": CHAT[:3 + 2 * (i % 2)]}) + "\n"
                            for i in range(24)))
    sft = {"data": str(chat), "tokenizer": tok, "sft": "pack", "seq_len": 64,
           "val_fraction": 0.25}
    opts = {**LORA, **sft, "model": base, "tp": 2, "steps": 2, "save_every": 2,
            "out": str(tmp_path / "a")}
    ranks = dist2.run(job_lora_run, opts)
    assert ranks[0] == ranks[1]
    trained = ranks[0]["probe"]
    export_run(tmp_path / "a", tmp_path / "adapter", adapter=True, log=_quiet)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    assert _loss(peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter"))) == \
        pytest.approx(trained, rel=1e-5)
    export_run(tmp_path / "a", tmp_path / "merged", merge=True, log=_quiet)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                 local_files_only=True)
    assert _loss(merged) == pytest.approx(trained, rel=1e-5)
    run = eval_target(tmp_path / "a", eval_batches=2, log=_quiet)
    hf_eval = eval_target(tmp_path / "merged", batch_size=LORA["batch_size"], eval_batches=2,
                          log=_quiet, **sft)
    assert run["val_loss"] == pytest.approx(hf_eval["val_loss"], rel=1e-5), (run, hf_eval)
