"""`slapo train --lora-r N`: PEFT's LoRA wrapped before scheduling, trained in one process and
under --tp 2 (the schedule shards base and adapters, `model_schedule.lora`): the base stays bit
for bit, only the adapters train and hold optimizer state, and tp=2 gives one process's losses."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

LORA = dict(model="llama", hidden_size=64, num_layers=2, num_heads=4, seq_len=16, batch_size=4,
            steps=3, progress=False, plot=False, eval_batches=0, dropout=0.0, lr=1e-2,
            lora_r=4, lora_alpha=8.0)
Q_LORA_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"


def job_lora_train(options: dict) -> dict:
    """Build the run as `slapo train` does, train it, and say what changed (every rank)."""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import train_one_step
    from slapo.train.setup import setup, teardown

    torch.set_num_threads(1)
    cfg = TrainConfig(**options)
    cfg.check()
    env = setup(cfg)
    try:
        run = build(cfg, env, log=lambda *a, **k: None)
        params = dict(run.model.named_parameters())
        before = {n: p.detach().clone() for n, p in params.items()}
        norms = []
        while run.step < cfg.steps:
            train_one_step(run)
            norms.append(float(run.trainer.last_grad_norm))
        frozen = [n for n, p in params.items() if not p.requires_grad]
        trained = [n for n, p in params.items() if p.requires_grad]
        held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        return {
            "losses": run.losses, "grad_norms": norms, "schedule": run.schedule_note, "type": type(run.model).__name__,
            "frozen": len(frozen), "trained": len(trained),
            "base_changed": [n for n in frozen if not torch.equal(params[n].detach(), before[n])],
            "adapters_changed": sum(not torch.equal(params[n].detach(), before[n])
                                    for n in trained),
            "lora_only": all("lora_" in n for n in trained),
            "optimizer_holds_adapters_only": held == {id(params[n]) for n in trained},
            "state": sorted({len(s) for s in run.optimizer.state.values()}),
            "q_lora_B": tuple(params.get(Q_LORA_B, torch.empty(0)).shape)}
    finally:
        teardown(env)


def _check(res: dict) -> None:
    assert res["type"] == "PeftModel" and res["lora_only"], res
    assert res["frozen"] > 0 and res["base_changed"] == [], res["base_changed"]
    assert res["trained"] == 28 and res["adapters_changed"] == 28, res  # 7 projections x 2 x 2
    assert res["optimizer_holds_adapters_only"] and res["state"] == [3], res


@pytest.mark.dist
def test_lora_r_trains_adapters_only_and_tp2_equals_one_process(dist2):
    one = job_lora_train(LORA)
    _check(one)
    assert one["q_lora_B"] == (64, 4)
    tp = dist2.run(job_lora_train, {**LORA, "tp": 2})
    for r in tp:
        _check(r)
        assert r["schedule"] == "applied: tp=2"
        assert r["q_lora_B"] == (32, 4)  # column-parallel q_proj: B split with the base
        assert r["losses"] == tp[0]["losses"]
    assert tp[0]["losses"] == pytest.approx(one["losses"], rel=1e-5)
    # the logged gradient norm is the whole model's, summed over the tp shards (A and B of a
    # replicated factor counted once)
    assert tp[0]["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    full = job_lora_train({**LORA, "lora_r": 0, "lora_alpha": None})
    assert full["type"] == "LlamaForCausalLM" and full["frozen"] == 0


def job_lora_losses(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


@pytest.mark.dist
def test_lora_r_with_pp_stages_trains_like_one_process(dist2):
    """`slapo train --lora-r 4 --pp-stages 2` on 2 ranks (the PEFT wrapper's stages:
    `runtime.partition.PrefixedStage`) logs one process's losses."""
    ranks = dist2.run(job_lora_losses, {**LORA, "pp_stages": 2})
    one = job_lora_losses(LORA)
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(one, rel=1e-5), (ranks[0], one)


def save_base(directory) -> str:
    """A tiny LLaMA saved with `save_pretrained`: the pretrained base of a `--model DIR` run."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=260, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"])
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def test_lora_on_a_pretrained_directory_reads_the_base_under_peft_names(tmp_path, one_thread):
    """`--model DIR --lora-r 4`: the base is built on meta, wrapped, and read from the
    safetensors through PEFT's `base_layer` names; the adapters are real (PEFT's init: B zero),
    so the first loss is the pretrained model's own."""
    import transformers
    from safetensors.torch import load_file

    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.setup import setup, teardown

    base = save_base(tmp_path / "base")
    cfg = TrainConfig(**{**LORA, "model": base, "steps": 1})
    cfg.check()
    env = setup(cfg)
    try:
        run = build(cfg, env, log=lambda *a, **k: None)
        saved = load_file(f"{base}/model.safetensors")
        params = dict(run.model.named_parameters())
        for name, p in params.items():
            if "lora_" in name:
                assert not p.is_meta and p.requires_grad, name
                assert ("lora_B" in name) == (not p.detach().any()), name  # B zero, A drawn
                continue
            key = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), saved[key]), name
        batch = run.data.next_batch(4)
        with torch.no_grad():
            got = run.model(**batch).loss
            want = transformers.LlamaForCausalLM.from_pretrained(base)(**batch).loss
        assert torch.equal(got, want)
    finally:
        teardown(env)
