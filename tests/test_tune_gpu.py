"""The GPU space of `slapo tune` and its cost model, on CPU (tiny models, fake tensors)."""

import sys
import warnings
from pathlib import Path

import pytest

from slapo.tune.model_spaces import (
    GPU_MODELS,
    GPUModelSpec,
    GPUSpaceArgs,
    apply_knobs,
    gpu_space,
    schedule_knobs,
)
from slapo.tune.predict_gpu import GPUCostModel, simulate_step

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = GPUModelSpec("tiny-llama", "LlamaConfig", "LlamaForCausalLM", dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=256, vocab_size=512, max_position_embeddings=256), 4, 256)


def _gpu_train():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_train

    return gpu_train


def test_gpu_models_are_the_benchmarks_models():
    bench = _gpu_train().MODELS
    for name, spec in GPU_MODELS.items():
        cfg, cls, kw, batch, seq = bench[name]
        assert (spec.config_class, spec.model_class, spec.kwargs, spec.batch, spec.seq) == \
            (cfg, cls, kw, batch, seq)


def test_gpu_space_enumerates_only_valid_configs():
    space = gpu_space(GPU_MODELS["llama-1b"], GPUSpaceArgs(batch_sizes=(4, 8)))
    configs = space.configs()
    knobs = apply_knobs()
    assert configs and len({tuple(sorted(c.items())) for c in configs}) == len(configs)
    for c in configs:
        assert ("ckpt_policy" in c) == (c["ckpt_ratio"] > 0)
        assert set(c) - {"batch_size", "mixed_precision"} <= set(knobs)  # apply's own names
        assert c["mixed_precision"] in ("fp32", "bf16")
    assert {c["fused_loss"] for c in configs} == {False, True}
    assert ("kernels" in space.names()) == ("kernels" in knobs)
    # a head without a fused-loss plan never gets fused_loss=True
    bare = gpu_space(GPUModelSpec("m", "LlamaConfig", "LlamaModel", {}, 1, 8))
    assert {c["fused_loss"] for c in bare} == {False}
    # the memory cap prunes batch sizes before anything runs
    capped = gpu_space(GPU_MODELS["llama-1b"], GPUSpaceArgs(
        batch_sizes=(4, 8), fits=lambda c: c["batch_size"] < 8 or c.get("ckpt_ratio", 0) > 0))
    assert all(c["batch_size"] == 4 or c["ckpt_ratio"] > 0 for c in capped)


def test_schedule_knobs_pass_gpu_knobs_to_apply():
    c = {"batch_size": 8, "mixed_precision": "bf16", "compile_blocks": True,
         "fused_loss": True, "ckpt_ratio": 1.0, "ckpt_policy": "selective"}
    k = schedule_knobs(c)
    assert k["compile_blocks"] and k["fused_loss"] and k["ckpt_policy"] == "selective"
    assert "mixed_precision" not in k and "batch_size" not in k


@pytest.fixture(scope="module")
def tiny():
    warnings.simplefilter("ignore")
    return GPUCostModel(TINY_LLAMA)


def _mem(model, **kw):
    cfg = {"batch_size": 4, "mixed_precision": "bf16", "attention": "sdpa", **kw}
    return model.step_cost(cfg).memory()


def test_memory_is_monotone_in_the_knobs_and_batch(tiny):
    none = _mem(tiny)
    sac = _mem(tiny, ckpt_ratio=1.0, ckpt_policy="selective")
    full = _mem(tiny, ckpt_ratio=1.0, ckpt_policy="full")
    assert full < sac < none
    assert _mem(tiny, batch_size=8) > none
    compiled = _mem(tiny, compile_blocks=True)
    assert _mem(tiny, compile_blocks=True, ckpt_ratio=1.0, ckpt_policy="full") < compiled < none
    assert _mem(tiny, mixed_precision="fp32") > none  # fp32 matmul outputs


def test_time_counts_recomputation(tiny):
    base = {"batch_size": 4, "mixed_precision": "bf16", "attention": "sdpa"}
    plain = tiny.step_cost(base)
    full = tiny.step_cost({**base, "ckpt_ratio": 1.0})
    compiled = tiny.step_cost({**base, "compile_blocks": True})
    assert full.mm_flops > plain.mm_flops  # the layers' forward runs twice
    assert compiled.mm_flops == pytest.approx(plain.mm_flops, rel=0.01)
    assert compiled.mem_bytes < plain.mem_bytes  # fused elementwise chains
    eff = tiny.calibrate(base, 0.01)
    assert tiny.predict(base)["step_time_s"] == pytest.approx(0.01)
    assert eff > 0


def test_simulation_matches_a_real_cpu_step_in_fp32():
    """The fake step tracks the real eager step (fp32, no autocast), within 10%."""
    import torch
    import transformers

    from slapo import model_schedule
    from slapo.tune.predict_gpu import _ADAMW_STATE

    warnings.simplefilter("ignore")
    cfg = {"batch_size": 2, "mixed_precision": "fp32", "attention": "sdpa"}
    sim = simulate_step(TINY_LLAMA, cfg)
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA.kwargs)).train()
    model.config.use_cache = False
    model_schedule.apply(model, attention="sdpa")
    ids = torch.randint(0, 512, (2, TINY_LLAMA.seq))
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        model(input_ids=ids, labels=ids).loss.backward()
    real = sum(v.get("Total", 0) for v in mt.get_tracker_snapshot("peak").values())
    assert sim.peak_bytes == pytest.approx(real, rel=0.10)  # 7% apart: see docs/tune.md
    assert sim.memory() >= sim.peak_bytes + _ADAMW_STATE * sim.params - 1


def test_check_script_runs_on_the_committed_results():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import tune_gpu_check as chk

    rows = chk.load_rows(ROOT / "benchmarks/results/gpu_train_h100.jsonl")
    assert rows and all(r["status"] == "ok" for r in rows)
    cal = chk.calibration_rows(rows)
    assert set(cal) == {"llama-1b", "gpt2-medium", "bert-large"}

    class Stub:  # the real model takes minutes on the 1.1B rows; the table logic is under test
        efficiency = 1.0

        def calibrate(self, cfg, step_s, schedule=True):
            self.efficiency = 1.0

        def predict(self, cfg, schedule=True):
            return {"memory": 20 * 2**30, "step_time_s": 0.1}

    res = chk.check(rows, lambda name: Stub())
    assert len(res) == len(rows)
    assert sum(r["role"] == "calibration" for r in res) == 3
    assert {r["status"] for r in res} <= {"ok", "not modelled"}
    assert all(r["variant"] in ("hf_compile", "hf_liger") for r in res
               if r["status"] == "not modelled")
    text = chk.table(res)
    assert "calibration" in text and "%" in text


def test_gpu_trial_trains_through_build_on_cpu():
    from slapo.tune.evaluators import GPUTrialSettings, gpu_train_trial

    spec = GPUModelSpec("t", "LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=128, max_position_embeddings=32), 2, 32)
    out = gpu_train_trial(GPUTrialSettings(device="cpu", steps=1, warmup=0),
                          {"batch_size": 2, "mixed_precision": "bf16", "attention": "sdpa",
                           "fused_loss": True, "ckpt_ratio": 1.0, "ckpt_policy": "selective"},
                          spec=spec)
    assert out["throughput"] > 0 and out["loss"] == out["loss"]
