"""`slapo export` and `--resume` of mixture-of-experts runs from a saved model directory.

test_export_families.py covers Qwen2-MoE; this file covers the MoE families with their own
state: Mixtral and Qwen3-MoE (Slapo's hand-written families: expert parallelism), DeepSeek-V3
(MLA heads split under tp by `plan_supplements`; the router's `e_score_correction_bias`, a
*buffer* `--router-bias-rate` changes after every step) and GPT-OSS (biased experts, the
interleaved (gate, up) pairs of `gate_up_proj` and its bias split by expert TP).

Per layout (one process, `--tp 2`, `--ep 2`, `--pp-stages 2`), one job trains every family
with `slapo train`'s own entry point for 3 steps (checkpoints at steps 2 and 3) and keeps, from
the *live* model at the end of the run (not a reload of its checkpoint, which a save that
drops or garbles a tensor would fool), the logits of a probe batch (a pipeline rank: the
parameters it trains) and the router biases its stages hold; then it resumes the run from
step 2 into another directory for the third step. The test checks:

1. `export_run` of the run, loaded with `from_pretrained`, gives the live model's logits
   (rtol/atol 1e-4: the run's schedule sums in another order than HF's forward; a pipeline:
   every stage's trained tensors exactly), and the checkpoint holds each tensor once (`--ep 2`:
   every expert, from the rank holding it);
2. the resumed run's losses, live model and step-3 checkpoint (every parameter and buffer,
   read whole) equal the uninterrupted run's bit for bit;
3. DeepSeek-V3 trains with `--router-bias-rate`: the biases moved, and the export and the
   resumed run hold exactly the live ones.

Found here: with `--pp-stages 2` every rank saved every persistent buffer, also the copies of
the other stage's routers (their constructor's zeros: a stage neither loads nor updates the
other's), and DCP keeps one rank's copy of an equal key, not the owner's: DeepSeek-V3's
layer-1 bias (owned by stage 0) was exported and resumed as zeros. `run_state._state` now saves
only the buffers of the rank's own stages (`_foreign_buffers`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_export_families import PROBE, VOCAB

from slapo.train.export import export_run, load_checkpoint_model, run_config, unsharded_model

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
LAYOUTS = {"one": {}, "tp2": {"tp": 2}, "ep2": {"ep": 2}, "pp2": {"pp_stages": 2}}
TINY = dict(seq_len=16, batch_size=4, steps=3, save_every=2, progress=False, plot=False,
            eval_batches=0, dropout=0.0, lr=1e-2)
RATE = 0.01  # --router-bias-rate of the DeepSeek-V3 runs
BIAS = "e_score_correction_bias"
TASK_CLASS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
              "deepseek_v3": "DeepseekV3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# A layout `slapo train` refuses for a family, with the reason (checked to be refused).
# GPT-OSS has no hand-written family (its experts are scheduled from HF's declared tp plan),
# and expert parallelism's experts take no biases: refused by `model_schedule.apply`
# before anything trains or is written.
REFUSED = {("gpt_oss", "ep2"): "ep=2, but family 'declared:gpt_oss' has no mixture-of-experts"}


def _config(name: str):
    """A tiny config of each family: 2 layers, width 32, 4 experts, top-2."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, pad_token_id=256, bos_token_id=257, eos_token_id=258,
                  hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, tie_word_embeddings=False,
                  num_experts_per_tok=2)
    return {
        "mixtral": lambda: tf.MixtralConfig(**common, num_key_value_heads=2,
                                            intermediate_size=32, num_local_experts=4),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=8,
                                               intermediate_size=64, moe_intermediate_size=32,
                                               num_experts=4, norm_topk_prob=True,
                                               decoder_sparse_step=1),
        # MLA; layer 0 dense, layers 1-2 sparse with a shared expert; 2 groups of 2 experts
        # (3 layers: with --pp-stages 2 each stage holds a router)
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**common, "num_hidden_layers": 3}, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, intermediate_size=64,
            moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, n_group=2,
            topk_group=1, first_k_dense_replace=1),
        "gpt_oss": lambda: tf.GptOssConfig(**common, num_key_value_heads=2, head_dim=8,
                                           intermediate_size=32, num_local_experts=4,
                                           sliding_window=8,
                                           layer_types=["sliding_attention", "full_attention"],
                                           rope_parameters=dict(
                                               rope_type="yarn", factor=2.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False, rope_theta=1.5e5,
                                               original_max_position_embeddings=32)),
    }[name]()


def save_moe_dirs(root: Path) -> dict[str, str]:
    """Each family saved with `save_pretrained`; every bias (GPT-OSS's experts', DeepSeek-V3's
    router correction, zeros at init) made nonzero, so a bias read as zeros or misplaced shows."""
    import transformers as tf

    dirs = {}
    for i, name in enumerate(FAMILIES):
        torch.manual_seed(100 + i)
        model = getattr(tf, TASK_CLASS[name])(_config(name))
        with torch.no_grad():
            for key, t in [*model.named_parameters(), *model.named_buffers()]:
                if key.endswith("bias") and t.is_floating_point():
                    t.copy_(torch.randn_like(t) * 0.02)
        model.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def _options(name: str, layout: str, directory: str, out: str) -> dict:
    extra = {"router_bias_rate": RATE} if name == "deepseek_v3" else {}
    return {**TINY, **LAYOUTS[layout], **extra, "model": directory, "out": out}


def _live(run) -> dict:
    """The live model's router biases (those of this rank's pipeline stages) and its probe
    logits (a collective under tp / ep: every rank runs the probe); with a pipeline, the
    parameters this rank trains instead of the logits."""
    from slapo.runtime.router_bias import bias_routers

    held = {id(b) for part in run.trainer.parts for b in part.buffers()}
    biases = {f"{path}.{BIAS}": m._buffers[BIAS].detach().clone()
              for path, m in bias_routers(run.model) if id(m._buffers[BIAS]) in held}
    if (run.cfg.pp_stages or 1) > 1:
        owned = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
        return {"biases": biases, "params": {n: p.detach().clone() for n, p in
                                             run.model.named_parameters() if id(p) in owned}}
    was = run.model.training
    run.model.eval()
    with torch.no_grad():
        logits = run.model(input_ids=PROBE).logits.detach().float().clone()
    run.model.train(was)
    return {"logits": logits, "biases": biases}


def job_train_moe(dirs: dict[str, str], root: str, layout: str) -> dict:
    """Every rank (or the one process): per family, `slapo train --model DIR` 3 steps, and the
    same run resumed from its step-2 checkpoint into another directory; the live model of each
    at its end (`_live`, taken in `loop.finish`) and the losses."""
    from slapo.errors import SlapoError
    from slapo.train import TrainConfig, loop

    torch.set_num_threads(1)
    seen: list[dict] = []
    finish = loop.finish

    def finish_live(run, *a, **k):
        seen.append(_live(run))
        return finish(run, *a, **k)

    results = {}
    loop.finish = finish_live
    try:
        for name, directory in dirs.items():
            out = str(Path(root) / f"{layout}-{name}")
            opts = _options(name, layout, directory, out)
            if (name, layout) in REFUSED:
                with pytest.raises(SlapoError, match=REFUSED[name, layout]):
                    loop.train(TrainConfig(**opts))
                # (the multi-rank shared-filesystem check may leave it, empty)
                assert not Path(out).exists() or not any(Path(out).iterdir()), out
                continue
            whole = loop.train(TrainConfig(**opts))
            resumed = loop.train(TrainConfig(**{
                **opts, "out": out + "-resumed",
                "resume": str(Path(out) / "checkpoints" / "step_000002")}))
            results[name] = {"losses": whole["losses"], "resumed_losses": resumed["losses"],
                             "live": seen[-2], "resumed_live": seen[-1]}
    finally:
        loop.finish = finish
    return results


def _checkpoint_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's model state (parameters and buffers), every tensor whole."""
    from slapo.train import run_state
    from slapo.train.export import pick

    path = pick(run_dir, None)
    model = unsharded_model(run_config(run_state.read_trainer(path), path))[0]
    load_checkpoint_model(path, model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_export(root: Path, layout: str, name: str, ranks: list[dict]) -> None:
    """(1) and (3): the export, loaded by `from_pretrained`, is the live model: its logits
    (a pipeline: every stage's trained tensors exactly, from the rank that owns it) and every
    router bias exactly, each from the rank whose stage holds it."""
    import transformers as tf

    run, hf = root / f"{layout}-{name}", root / f"{layout}-{name}-hf"
    result = export_run(run, hf, log=lambda *a: None)  # its own reload check
    assert result.step == 3, name
    info = json.loads((hf / "slapo_export.json").read_text())
    assert info["run_id"] == json.loads((run / "run.json").read_text())["run_id"]
    model = getattr(tf, TASK_CLASS[name]).from_pretrained(str(hf), local_files_only=True)
    model.eval()
    params, buffers = dict(model.named_parameters()), dict(model.named_buffers())
    seen_params, seen_biases = set(), set()
    for r in ranks:
        live = r[name]["live"]
        for key, bias in live["biases"].items():
            assert torch.equal(buffers[key], bias), (layout, name, key, buffers[key], bias)
            seen_biases.add(key)
        if "params" in live:
            for key, value in live["params"].items():
                assert torch.equal(params[key], value), (layout, name, key)
                seen_params.add(key)
            continue
        with torch.no_grad():
            got = model(input_ids=PROBE).logits.float()
        torch.testing.assert_close(got, live["logits"], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{layout} {name}: {m}")
    assert seen_biases == {k for k in buffers if k.endswith(BIAS)}, (layout, name, seen_biases)
    assert name != "deepseek_v3" or seen_biases, layout
    if layout == "pp2":
        assert seen_params == set(params), (layout, name, set(params) - seen_params)


def _check_resume(root: Path, layout: str, name: str, ranks: list[dict]) -> None:
    """(2): resumed from step 2, the third step is the uninterrupted run's, bit for bit: its
    losses, its live model and its step-3 checkpoint (every parameter and buffer, read whole)."""
    run = root / f"{layout}-{name}"
    for r in ranks:
        res = r[name]
        assert len(res["losses"]) == 3 and res["resumed_losses"] == res["losses"], (layout, name)
        live, again = res["live"], res["resumed_live"]
        for part in ("logits", "biases", "params"):
            if part not in live:
                continue
            mine = live[part] if part != "logits" else {"logits": live[part]}
            theirs = again[part] if part != "logits" else {"logits": again[part]}
            assert mine.keys() == theirs.keys(), (layout, name, part)
            for key, value in mine.items():
                assert torch.equal(theirs[key], value), (layout, name, key)
    whole, resumed = _checkpoint_state(run), _checkpoint_state(run.with_name(run.name + "-resumed"))
    assert whole.keys() == resumed.keys()
    for key, value in whole.items():
        assert torch.equal(resumed[key], value), (layout, name, key)


def _check_each_tensor_once(run_dir: Path) -> None:
    """The checkpoint's chunks of every model tensor add up to it exactly (`--ep 2`: each
    expert once, from the rank holding it; no replica saved twice, none missing)."""
    import math

    from slapo.train.checkpoint_read import SafeReader
    from slapo.train.export import pick

    meta = SafeReader(str(pick(run_dir, None))).read_metadata().state_dict_metadata
    experts = 0
    for key, m in meta.items():
        if key.startswith("model.") and hasattr(m, "chunks"):
            held = sum(math.prod(c.sizes) for c in m.chunks)
            assert held == math.prod(m.size), (run_dir.name, key, m.chunks)
            experts += ".experts." in key
    assert experts, run_dir.name


def _check_biases_moved(ranks: list[dict], dirs: dict[str, str]) -> None:
    """(3) the run changed the biases (else an export of the initial ones would pass)."""
    from safetensors.torch import load_file

    saved = load_file(str(Path(dirs["deepseek_v3"]) / "model.safetensors"))
    for r in ranks:
        for key, bias in r["deepseek_v3"]["live"]["biases"].items():
            assert not torch.equal(bias, saved[key]), key


def _check(root: Path, layout: str, ranks: list[dict], dirs: dict[str, str]) -> None:
    _check_biases_moved(ranks, dirs)
    for name in FAMILIES:
        if (name, layout) in REFUSED:
            continue
        _check_each_tensor_once(root / f"{layout}-{name}")
        _check_export(root, layout, name, ranks)
        _check_resume(root, layout, name, ranks)


def test_moe_export_and_resume_one_process(tmp_path, one_thread):
    dirs = save_moe_dirs(tmp_path / "src")
    res = job_train_moe(dirs, str(tmp_path), "one")
    _check(tmp_path, "one", [res], dirs)


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["tp2", "ep2", "pp2"])
def test_moe_export_and_resume(dist2, tmp_path, layout):
    dirs = save_moe_dirs(tmp_path / "src")
    ranks = dist2.run(job_train_moe, dirs, str(tmp_path), layout, timeout=600)
    _check(tmp_path, layout, ranks, dirs)
