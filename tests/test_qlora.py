"""`slapo train --model DIR --lora-r N --lora-4bit` (QLoRA, `slapo/train/qlora.py`): the base
quantized to 4-bit NF4 by bitsandbytes, LoRA adapters trained on it. Against HF + PEFT's QLoRA
built by hand (the same directory, BitsAndBytesConfig, `prepare_model_for_kbit_training` and
LoraConfig): the loss, every adapter gradient and the adapters after 2 AdamW steps; the 4-bit
base bit for bit after training, the optimizer holding the adapters only; DDP on 2 ranks equals
one process with --grad-accum 2; the checkpoint holds the adapters only, a resume continues bit
for bit, and `slapo export --adapter` loads onto the 4-bit base with the trained loss."""

from __future__ import annotations

import json

import pytest
import torch
from test_export_lora import PROBE, _checkpoint_bytes, job_lora_run
from test_train_lora import LORA, save_base

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

# no clipping, constant LR: the hand-built reference is plain AdamW at lr 1e-2; on the CPU
# (bitsandbytes' 4-bit CPU path), whatever the machine has
QLORA = {**LORA, "lora_4bit": True, "grad_clip": None, "min_lr_ratio": 1.0, "steps": 2,
         "device": "cpu"}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Measured (torch 2.13 CPU, bitsandbytes 0.50.2, one thread): against the hand-built QLoRA the
# loss, gradients and adapters are bit-identical (4-bit dequantisation is deterministic and the
# ops are the same), and so are DDP on 2 ranks vs --grad-accum 2 and the exported adapter on
# the 4-bit base vs the trained model: the tests assert equality.


def _quiet(*a, **k):
    pass


def _bnb_config(compute=torch.float32):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute)


def hf_4bit(base: str, compute=torch.float32):
    """The base as a user loads it for QLoRA (HF + bitsandbytes)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        base, quantization_config=_bnb_config(compute), dtype=torch.float32,
        device_map={"": "cpu"}, local_files_only=True)


def hf_qlora(base: str, seed: int = 0, compute=torch.float32):
    """PEFT's QLoRA recipe by hand: 4-bit base, prepare_model_for_kbit_training, LoraConfig."""
    import peft

    torch.manual_seed(seed)
    model = peft.prepare_model_for_kbit_training(hf_4bit(base, compute))
    config = peft.LoraConfig(r=LORA["lora_r"], lora_alpha=LORA["lora_alpha"], lora_dropout=0.0,
                             target_modules=TARGETS)
    return peft.get_peft_model(model, config).train()


def _packed(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight's packed bytes and quantization scales, copied."""
    import bitsandbytes as bnb

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, bnb.nn.Linear4bit):
            q = mod.weight.quant_state
            out[name.removeprefix("base_model.model.")] = torch.cat([
                mod.weight.data.view(-1), q.absmax.view(torch.uint8).view(-1),
                q.state2.absmax.view(torch.uint8).view(-1)]).clone()
    return out


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qlora_equals_hf_peft_qlora_by_hand(precision, tmp_path, one_thread):
    """One process: the same 4-bit bytes and adapter init as the hand-built QLoRA, then the
    loss, every adapter gradient, and the adapters after 2 AdamW steps (lr 1e-2) bit for bit
    (measured: equal); the base's packed weights and scales are bit-identical after training,
    and AdamW holds state for the 28 adapters only. --precision bf16: the 4-bit layers compute
    in bf16, the reference runs under bf16 autocast as the run does."""
    from contextlib import nullcontext

    import bitsandbytes as bnb

    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.setup import setup, teardown

    base = save_base(tmp_path / "base")
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    amp = (lambda: torch.autocast("cpu", torch.bfloat16)) if precision == "bf16" else nullcontext
    cfg = TrainConfig(**{**QLORA, "model": base, "precision": precision})
    cfg.check()
    env = setup(cfg)
    try:
        run = build(cfg, env, log=_quiet)
        ref = hf_qlora(base, cfg.seed, compute)
        ours = run.model
        layers = [m for m in ours.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(layers) == 14  # 7 projections x 2 layers
        assert {m.compute_dtype for m in layers} == {compute}
        assert all(p.dtype == torch.float32 for p in ours.parameters()
                   if not isinstance(p, bnb.nn.Params4bit))  # norms, embedding, head, adapters
        before = _packed(ours)
        assert before.keys() == _packed(ref).keys()
        assert all(torch.equal(before[k], v) for k, v in _packed(ref).items())
        init = _adapters(ours)
        assert init.keys() == _adapters(ref).keys() and len(init) == 28
        assert all(torch.equal(init[k], v) for k, v in _adapters(ref).items())  # PEFT's init

        gen = torch.Generator().manual_seed(3)
        batches = [torch.randint(0, 256, (4, 16), generator=gen) for _ in range(2)]
        # the loss and every adapter gradient
        with amp():
            loss = ours(input_ids=batches[0], labels=batches[0]).loss
            want = ref(input_ids=batches[0], labels=batches[0]).loss
        loss.backward()
        want.backward()
        assert torch.equal(loss, want), (loss.item(), want.item())
        theirs = dict(ref.named_parameters())
        grads = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
        assert len(grads) == 28 and all(g is not None for g in grads.values())
        assert all(g.any() for n, g in grads.items() if "lora_B" in n)  # A's: zero (B is 0)
        assert all(torch.equal(g, theirs[n].grad) for n, g in grads.items())
        assert all(p.grad is None for p in ours.parameters() if not p.requires_grad)
        run.optimizer.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)

        # 2 AdamW steps: the run's train_step against torch's AdamW on the reference
        opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                betas=(0.9, 0.95), weight_decay=0.0)
        for b in batches:
            got = run.trainer.train_step({"input_ids": b, "labels": b})
            with amp():
                want = ref(input_ids=b, labels=b).loss
            want.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert got == want.item()
        after, ref_after = _adapters(ours), _adapters(ref)
        assert after.keys() == ref_after.keys()
        assert all(torch.equal(after[n], ref_after[n]) for n in after)
        assert sum(not torch.equal(after[n], init[n]) for n in after) == 28
        # the base bit for bit; the optimizer holds the adapters only
        assert all(torch.equal(v, before[k]) for k, v in _packed(ours).items())
        held = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        assert held == {id(p) for p in ours.parameters() if p.requires_grad}
        assert len(run.optimizer.state) == 28
    finally:
        teardown(env)


def job_qlora_train(options: dict) -> dict:
    """`slapo train`'s steps on this rank: the losses and the trained adapters."""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import train_one_step
    from slapo.train.setup import setup, teardown

    torch.set_num_threads(1)
    cfg = TrainConfig(**options)
    cfg.check()
    env = setup(cfg)
    try:
        run = build(cfg, env, log=_quiet)
        while run.step < cfg.steps:
            train_one_step(run)
        return {"losses": run.losses, "adapters": _adapters(run.model),
                "schedule": run.schedule_note}
    finally:
        teardown(env)


@pytest.mark.dist
def test_qlora_ddp2_equals_one_process_with_grad_accum_2(dist2, tmp_path):
    """DDP on 2 ranks (each its half of the batch) equals one process with --grad-accum 2,
    losses and adapters bit for bit (measured: equal); with activation checkpointing
    (--ckpt-ratio 1) on the ranks, the same again; --optimizer-offload in one process too."""
    base = save_base(tmp_path / "base")
    opts = {**QLORA, "model": base, "grad_clip": 1.0}
    one = job_qlora_train({**opts, "grad_accum": 2})
    offload = job_qlora_train({**opts, "grad_accum": 2, "optimizer_offload": True})
    assert offload["losses"] == one["losses"]  # AdamW on the host: the same numbers
    assert all(torch.equal(v, one["adapters"][n]) for n, v in offload["adapters"].items())
    for extra in ({}, {"ckpt_ratio": 1.0}):
        ranks = dist2.run(job_qlora_train, {**opts, **extra})
        assert ranks[0]["losses"] == ranks[1]["losses"]
        assert ranks[0]["losses"] == one["losses"], (extra, ranks[0]["losses"], one["losses"])
        assert ranks[0]["adapters"].keys() == one["adapters"].keys()
        for name, value in one["adapters"].items():
            assert torch.equal(ranks[0]["adapters"][name], ranks[1]["adapters"][name]), name
            assert torch.equal(ranks[0]["adapters"][name], value), (extra, name)


def test_qlora_run_saves_adapters_resumes_and_exports(tmp_path, one_thread):
    """The checkpoint holds the 28 adapters and their AdamW moments, nothing of the 4-bit base;
    a resume from step 1 (the base re-read and re-quantized from DIR) continues bit for bit;
    `slapo export --adapter` loads with `PeftModel.from_pretrained` onto the 4-bit base with the
    trained loss, and `--merge` folds it into the full-precision base (a different model: the
    trained one computed with the 4-bit weights); `slapo eval` of a run gives its logged val
    loss."""
    import peft
    import transformers

    from slapo.train.export import export_run

    base = save_base(tmp_path / "base")
    opts = {**QLORA, "model": base, "steps": 2, "save_every": 1, "out": str(tmp_path / "a")}
    straight = job_lora_run(opts)
    step1 = tmp_path / "a" / "checkpoints" / "step_000001"
    resumed = job_lora_run({**opts, "out": str(tmp_path / "b"), "resume": str(step1)})
    assert resumed["losses"] == straight["losses"] and resumed["probe"] == straight["probe"]
    held = _checkpoint_bytes(tmp_path / "a" / "checkpoints" / "step_000002")
    assert held["base_keys"] == 0 and held["model_keys"] == 28, held
    assert held["state_keys"] == 3 * 28 and held["moments"] == 2 * held["model"], held

    trained = straight["probe"]
    export_run(tmp_path / "a", tmp_path / "adapter", adapter=True, log=_quiet)
    on_4bit = peft.PeftModel.from_pretrained(hf_4bit(base), str(tmp_path / "adapter"))
    with torch.no_grad():
        got = on_4bit.eval()(input_ids=PROBE, labels=PROBE).loss.item()
    assert got == trained  # measured: equal (the same 4-bit bytes, the adapters in fp32)

    export_run(tmp_path / "a", tmp_path / "merged", merge=True, log=_quiet)
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"),
                                                                 local_files_only=True)
    full = transformers.AutoModelForCausalLM.from_pretrained(base, local_files_only=True)
    on_full = peft.PeftModel.from_pretrained(full, str(tmp_path / "adapter"))
    with torch.no_grad():
        merged_loss = merged.eval()(input_ids=PROBE, labels=PROBE).loss.item()
        full_loss = on_full.eval()(input_ids=PROBE, labels=PROBE).loss.item()
    assert merged_loss == pytest.approx(full_loss, rel=1e-5)  # the adapter on the fp32 base
    # not the trained (4-bit) model's loss: measured 5.5474 vs 5.5463 on this base
    assert merged_loss != pytest.approx(trained, rel=1e-4)
    info = json.loads((tmp_path / "merged" / "slapo_export.json").read_text())
    assert info["lora"]["qlora"]["trained_on"].startswith("4-bit NF4"), info

    # `slapo eval RUN_DIR` rebuilds the 4-bit base and loads the adapters: the logged val loss
    from slapo.train import TrainConfig, train
    from slapo.train.evaluate import eval_target

    logged = train(TrainConfig(**{**opts, "out": str(tmp_path / "c"), "eval_batches": 2}))
    assert eval_target(tmp_path / "c", log=_quiet)["val_loss"] == logged["val_loss"]


def test_qlora_refusals_need_weights_and_bitsandbytes(tmp_path, one_thread, monkeypatch):
    """Found when the run is built, before anything is written: a config file or a directory
    without weights (nothing to quantize), and bitsandbytes missing (the install hint)."""
    import sys

    from slapo.data.sources import InputError
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.setup import setup, teardown

    base = save_base(tmp_path / "base")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((tmp_path / "base" / "config.json")
                                                   .read_text())
    cases = [(str(tmp_path / "bare"), r"has none \(no model.safetensors\)"),
             (str(tmp_path / "bare" / "config.json"), "config file without weights")]
    for model, says in cases:
        cfg = TrainConfig(**{**QLORA, "model": model, "out": str(tmp_path / "out")})
        cfg.check()
        env = setup(cfg)
        try:
            with pytest.raises(InputError, match=says):
                build(cfg, env, log=_quiet)
        finally:
            teardown(env)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    cfg = TrainConfig(**{**QLORA, "model": base})
    env = setup(cfg)
    try:
        with pytest.raises(InputError, match=r"pip install slapo\[qlora\]"):
            build(cfg, env, log=_quiet)
    finally:
        teardown(env)
    assert not (tmp_path / "out").exists()
