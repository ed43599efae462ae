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


@pytest.mark.slow
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


# ------------------------------------------------------------------------------------------------
# compiled layers: the partitioner's real saved set; the launch term; the masked-LM head
# ------------------------------------------------------------------------------------------------

TINY_GPT2 = GPUModelSpec("tiny-gpt2", "GPT2Config", "GPT2LMHeadModel", dict(
    n_embd=64, n_layer=1, n_head=4, vocab_size=256, n_positions=64), 2, 64)
TINY_LLAMA_1 = GPUModelSpec("tiny-llama-1", "LlamaConfig", "LlamaForCausalLM", dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=256, max_position_embeddings=64), 2, 64)


def _real_compiled_saved(model, layer, args, kwargs):
    """Bytes a real `torch.compile(layer, backend="aot_eager")` forward keeps for backward:
    the tensors its compiled autograd node holds, each storage once, minus parameters and the
    layer's inputs."""
    import torch
    from torch.utils._pytree import tree_flatten

    # a fresh dynamo: earlier tests in this worker may have used up the recompile limit of
    # this layer class's forward, and dynamo then runs it eagerly (no compiled node)
    torch._dynamo.reset()
    out = torch.compile(layer, backend="aot_eager", dynamic=False)(*args, **kwargs)
    node = tree_flatten(out)[0][0].grad_fn
    while "Compiled" not in type(node).__name__:
        node = node.next_functions[0][0]
    free = {t.untyped_storage()._cdata for t in list(layer.parameters()) +
            [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]}
    kept = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
            for t in node.saved_tensors if isinstance(t, torch.Tensor)}
    return sum(n for k, n in kept.items() if k not in free)


@pytest.mark.compile
@pytest.mark.parametrize("spec", [TINY_LLAMA_1, TINY_GPT2], ids=["llama", "gpt2"])
def test_recorded_partition_is_what_a_real_compile_keeps(spec):
    """The saved set recorded on fake tensors (as the cost model does, bf16 autocast) is the one
    a real aot_eager compile of the same layer keeps on real tensors: same partitioner."""
    import torch

    from slapo.tune.partition_plan import record_partition
    from slapo.tune.predict_gpu import _autocast, _fake_batch, _fake_model, _layer_call, fake_mode

    warnings.simplefilter("ignore")
    cfg = {"batch_size": spec.batch, "mixed_precision": "bf16"}
    with fake_mode():
        model = _fake_model(spec)
        data = _fake_batch(model, spec.batch, spec.seq)
        args, kwargs = _layer_call(model, _first_layer(model), cfg, data)
        with _autocast(cfg):
            plan = record_partition(_first_layer(model), args, kwargs, partition="aot_eager")
    torch.manual_seed(0)
    model = _fake_model(spec)  # the same builder, outside fake mode: real weights
    data = _fake_batch(model, spec.batch, spec.seq)
    args, kwargs = _layer_call(model, _first_layer(model), cfg, data)
    with _autocast(cfg):
        real = _real_compiled_saved(model, _first_layer(model), args, kwargs)
    assert real > 0
    assert plan.saved_bytes == pytest.approx(real, rel=0.01)


def _first_layer(model):
    base = getattr(model, "model", None) or getattr(model, "transformer", None)
    return base.layers[0] if hasattr(base, "layers") else base.h[0]


@pytest.mark.compile
def test_partition_costs_count_fused_kernels():
    """A matmul and the elementwise chain after it: two forward kernels (the chain is one
    fused kernel); the chain's intermediate never reaches memory."""
    import torch

    from slapo.tune.partition_plan import record_partition

    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32, requires_grad=True)
    plan = record_partition(lambda x: ((x @ w).relu() * 2 + 1).sum(), (x,))
    assert plan.fwd_flops == 2 * 16 * 32 * 32
    assert plan.bwd_flops == 2 * plan.fwd_flops  # dX and dW
    assert plan.fwd_kernels == 2  # mm + one fused relu*2+1+sum
    assert plan.saved_bytes == 16 * 32  # the min cut keeps relu's bool mask, not the fp32 mm
    # the fused kernel reads the mm output once, writes the mask and the sum: nothing else
    assert plan.fwd_bytes == 16 * 32 * 4 + plan.saved_bytes + 4


def test_kernel_count_is_one_per_launching_op():
    """Views and allocations launch nothing; every other op (in-place ones too) one kernel."""
    import torch

    from slapo.tune.op_costs import _CostCounter

    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with _CostCounter() as c:
        x = (a @ b).relu()  # 2
        y = x.view(64)  # 0
        y.add_(1)  # 1
        torch.empty(4)  # 0
    assert c.kernels == 3


def test_metadata_queries_launch_no_kernel():
    """Under fake tensors and autocast (how the GPU model simulates a step) the dispatcher asks
    each argument's device through `prim.device`, which reaches the counter; counted as kernels
    they were 9 of every 11 of a llama-1b step."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from slapo.tune.op_costs import _CostCounter

    with FakeTensorMode():
        a, b = torch.randn(8, 8), torch.randn(8, 8)
        with _CostCounter() as c, torch.autocast("cpu", torch.bfloat16):
            a @ b  # two casts and the matmul
    assert c.kernels == 3


def test_launch_term_is_kernels_times_the_device_constant(tiny):
    from dataclasses import replace

    from slapo.tune.predict_gpu import H100

    base = {"batch_size": 4, "mixed_precision": "bf16", "attention": "sdpa"}
    eager = tiny.step_cost(base)
    compiled = tiny.step_cost({**base, "compile_blocks": True})
    assert 0 < compiled.kernels < eager.kernels  # a compiled layer launches fused kernels
    silent = GPUCostModel(TINY_LLAMA, device=replace(H100, kernel_launch_s=0.0))
    launches = tiny.roofline_s(eager) - silent.roofline_s(eager)
    assert launches == pytest.approx(eager.kernels * H100.kernel_launch_s)
    assert H100.kernel_launch_s == 5e-6  # a device property (docs/tune.md), never fitted


TINY_BERT = GPUModelSpec("tiny-bert", "BertConfig", "BertForMaskedLM", dict(
    hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
    vocab_size=256, max_position_embeddings=64), 2, 64)


def test_fused_mlm_loss_counts_only_the_labelled_rows(monkeypatch):
    """Under fake tensors the fused masked-LM head runs on MLM_LABELLED of the positions (as
    the real step on the benchmark's batches), not on all of them."""
    from slapo.tune import predict_gpu

    warnings.simplefilter("ignore")
    cfg = {"batch_size": 2, "mixed_precision": "bf16", "attention": "sdpa", "fused_loss": True}
    labelled = simulate_step(TINY_BERT, cfg)
    monkeypatch.setattr(predict_gpu, "MLM_LABELLED", 1.0)
    every = simulate_step(TINY_BERT, cfg)
    h, v, n = 64, 256, 2 * 64
    rows = n - round(0.15 * n)
    per_row = 6 * h * v + 6 * h * h  # decoder and transform dense: forward + both gradients
    assert every.mm_flops - labelled.mm_flops == pytest.approx(rows * per_row, rel=0.02)
    assert labelled.peak_bytes < every.peak_bytes


def test_cpu_simulation_follows_cuda_autocast_lists(monkeypatch):
    """HF GPT-2's tanh-GELU calls pow, an fp32 op of CUDA autocast (bf16 on CPU): on CUDA the
    chain after it is fp32, so autograd saves pow's input, tanh's output and (1 + tanh) in fp32
    (2 bytes more each) and the 0.5x product's input twice as large: 6 bytes per element of the
    b x s x 4h MLP activation per layer over CPU autocast. The simulation must see CUDA's."""
    import torch

    from slapo.tune import predict_gpu

    warnings.simplefilter("ignore")
    spec = GPUModelSpec("tiny-gpt2-2", "GPT2Config", "GPT2LMHeadModel", dict(
        n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64), 4, 64)
    cfg = {"batch_size": 4, "mixed_precision": "bf16"}
    cuda = simulate_step(spec, cfg, schedule=False)
    monkeypatch.setattr(predict_gpu, "_CUDA_FP32_OPS", ())
    monkeypatch.setattr(predict_gpu, "_CUDA_FP32_OPT_DTYPE", ())
    cpu = simulate_step(spec, cfg, schedule=False)
    assert cuda.peak_bytes - cpu.peak_bytes == 6 * 4 * 64 * (4 * 64) * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the override is gone after the step
        assert torch.pow(torch.ones(2, dtype=torch.bfloat16), 2).dtype == torch.bfloat16
