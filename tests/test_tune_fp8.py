"""The GPU cost model under `mixed_precision="fp8"` (torchao's FP8 GEMMs), on CPU: the fake step
installs the GEMMs as `build` does (`runtime.fp8.convert`, torchao's `_scaled_mm` path), so its
memory is what torchao saves and its casts are ops the counter sees (docs/tune.md, "FP8")."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest

from slapo.tune.model_spaces import GPU_MODELS, GPUModelSpec
from slapo.tune.predict_gpu import H100, GPUCostModel

pytest.importorskip("torchao.float8")

# LLaMA 1.1B's layer (benchmarks/gpu_train.py) at its batch and sequence, 2 of its 16 layers
LLAMA_1B_2L = GPUModelSpec("llama-1b-2l", "LlamaConfig", "LlamaForCausalLM",
                           {**GPU_MODELS["llama-1b"].kwargs, "num_hidden_layers": 2}, 8, 2048)
SLAPO_GPU = {"batch_size": 8, "attention": "sdpa", "compile_blocks": True, "fused_loss": True}
TINY = GPUModelSpec("tiny-llama", "LlamaConfig", "LlamaForCausalLM", dict(
    hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=256, vocab_size=512, max_position_embeddings=256), 4, 256)
BASE = {"batch_size": 4, "attention": "sdpa"}


def _linear_params(spec: GPUModelSpec, skip: tuple = ()) -> int:
    """Weights of the layers' Linears (q, k, v, o, gate, up, down): what the default
    Float8Config converts in LLaMA (the LM head never)."""
    kw = spec.kwargs
    h, f = kw["hidden_size"], kw["intermediate_size"]
    kv = h // kw["num_attention_heads"] * kw["num_key_value_heads"]
    sizes = {"q_proj": h * h, "k_proj": h * kv, "v_proj": h * kv, "o_proj": h * h,
             "gate_proj": h * f, "up_proj": h * f, "down_proj": h * f}
    return kw["num_hidden_layers"] * sum(n for k, n in sizes.items() if k not in skip)


@pytest.fixture(scope="module")
def llama():
    warnings.simplefilter("ignore")
    return GPUCostModel(LLAMA_1B_2L)


@pytest.mark.compile
def test_fp8_step_is_faster_than_bf16_and_slower_than_half_of_it(llama):
    """Compiled layers (the `slapo_gpu` row's knobs): FP8 GEMMs at 2x bf16's peak, the casts
    paid; only the GEMM-bound share gains, so the step lands between half and all of bf16's."""
    bf16 = llama.predict({**SLAPO_GPU, "mixed_precision": "bf16"})
    cfg = {**SLAPO_GPU, "mixed_precision": "fp8"}
    fp8 = llama.predict(cfg)
    assert 0.5 * bf16["step_time_s"] < fp8["step_time_s"] < bf16["step_time_s"]
    tokens = 8 * 2048
    # every converted Linear's three GEMMs (forward, grad input, grad weight) and nothing else
    assert fp8["fp8_flops"] == 6 * tokens * _linear_params(LLAMA_1B_2L)
    assert fp8["mm_flops"] == bf16["mm_flops"] and fp8["fp8_gemms"] == 14
    assert fp8["mem_bytes"] > bf16["mem_bytes"] and fp8["kernels"] > bf16["kernels"]  # casts
    # the casts cost time: were FP8 GEMMs no faster than bf16's, fp8 would be the slower
    same = GPUCostModel(LLAMA_1B_2L, device=replace(H100, fp8_peak_flops=H100.peak_flops))
    assert same.roofline_s(llama.step_cost(cfg)) > llama.roofline_s(
        llama.step_cost({**SLAPO_GPU, "mixed_precision": "bf16"}))
    # the compiled layer's FP8 casts read their input twice (a whole-tensor amax, then the
    # cast): the partitioned graphs count it; its memory is the partitioner's (below bf16's)
    assert llama.step_cost(cfg).peak_bytes < llama.step_cost(
        {**SLAPO_GPU, "mixed_precision": "bf16"}).peak_bytes


def test_eager_fp8_saves_no_bf16_weight_copies(llama):
    """Eager: autocast's F.linear saves the bf16 copy of each weight for backward; torchao's
    matmul saves the bf16 input and the fp32 weight (the parameter itself). The fp8 step's
    peak is bf16's minus exactly 2 bytes per converted weight; its casts (amax, scale, cast:
    six per GEMM) add bytes and kernels, so eager FP8 is slower than eager bf16."""
    cfg = {**SLAPO_GPU, "compile_blocks": False}
    bf16 = llama.step_cost({**cfg, "mixed_precision": "bf16"})
    fp8 = llama.step_cost({**cfg, "mixed_precision": "fp8"})
    assert bf16.peak_bytes - fp8.peak_bytes == 2 * _linear_params(LLAMA_1B_2L)
    assert fp8.fp8_flops == 6 * 8 * 2048 * _linear_params(LLAMA_1B_2L)
    assert fp8.kernels > bf16.kernels and fp8.mem_bytes > bf16.mem_bytes
    assert llama.roofline_s(fp8) > llama.roofline_s(bf16)


def test_module_filter_decides_what_runs_in_fp8():
    """A filter that converts nothing predicts bf16 exactly (same memory, time, counts); a
    skipped GEMM stays at the bf16 peak (its FLOPs leave `fp8_flops`)."""
    from slapo.runtime.fp8 import Float8Config

    warnings.simplefilter("ignore")
    bf16 = GPUCostModel(TINY).predict({**BASE, "mixed_precision": "bf16"})
    cfg = {**BASE, "mixed_precision": "fp8"}
    nothing = GPUCostModel(TINY, fp8=Float8Config(min_dim=1024)).predict(cfg)
    assert nothing == bf16
    skip = GPUCostModel(TINY, fp8=Float8Config(min_dim=16, skip=("mlp.down_proj",)))
    every = GPUCostModel(TINY, fp8=Float8Config(min_dim=16)).predict(cfg)
    skipped = skip.predict(cfg)
    tokens = 4 * 256
    assert every["fp8_flops"] == 6 * tokens * _linear_params(TINY)
    assert skipped["fp8_flops"] == 6 * tokens * _linear_params(TINY, skip=("down_proj",))
    assert (every["fp8_gemms"], skipped["fp8_gemms"]) == (14, 12)


def test_counter_sees_torchaos_ops_not_its_subclass():
    """An op on torchao's Float8TrainingTensor is counted by what it runs: `_scaled_mm` (FP8
    FLOPs) and the FP8 data's layout copies; one Linear's three GEMMs are all FP8."""
    import torch

    from slapo.runtime.fp8 import Float8Gemm
    from slapo.tune.op_costs import _CostCounter
    from slapo.tune.predict_gpu import fake_mode

    warnings.simplefilter("ignore")
    with fake_mode():
        lin = torch.nn.Linear(64, 32, bias=False)
        x = torch.randn(16, 64, requires_grad=True)
        with _CostCounter() as c:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = Float8Gemm("tensorwise", emulate=False)(lin, x)
            y.float().sum().backward()
    assert c.fp8_flops == c.flops == 3 * 2 * 16 * 64 * 32
    with fake_mode():
        with _CostCounter() as plain:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = torch.nn.functional.linear(x, lin.weight)
            y.float().sum().backward()
    assert plain.fp8_flops == 0 and plain.flops == c.flops
    assert c.kernels > plain.kernels + 6 * 3  # six casts (amax, scale, cast) per linear


def test_a_whole_tensor_reduction_splits_the_fused_kernel():
    """Tensorwise amax, then the cast that reads its result: two kernels, the input read
    twice. A row reduction (a norm's, rowwise scaling's) fuses with its reader: one kernel."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from slapo.tune.partition_plan import graph_costs

    x = torch.randn(64, 128)
    n = x.numel() * 4

    def tensorwise(x):
        return x / x.abs().amax()

    def rowwise(x):
        return x / x.abs().amax(-1, keepdim=True)

    whole = graph_costs(make_fx(tensorwise)(x))
    rows = graph_costs(make_fx(rowwise)(x))
    assert whole["kernels"] == 2 and rows["kernels"] == 1
    assert whole["bytes"] == 2 * n + n + 2 * 4  # x twice, the output, the amax written + read
    assert rows["bytes"] == n + n


def test_fp8_time_needs_an_fp8_peak():
    from slapo.tune.timing import roofline_time

    assert roofline_time(0, 0, H100, fp8_flops=H100.fp8_peak_flops) == pytest.approx(1.0)
    assert H100.fp8_peak_flops == 2 * H100.peak_flops  # the datasheet's ratio (docs/tune.md)
    with pytest.raises(ValueError, match="no FP8"):
        roofline_time(0, 0, replace(H100, fp8_peak_flops=0.0), fp8_flops=1.0)


@pytest.mark.slow
@pytest.mark.compile
def test_tune_dry_run_lists_fp8_configs(monkeypatch, capsys, tmp_path):
    """`slapo tune --space gpu --precisions bf16,fp8 --dry-run`: the space with fp8, each
    config predicted, nothing measured or written (no GPU needed)."""
    from slapo.tune import model_spaces
    from slapo.tune.cli import main

    warnings.simplefilter("ignore")
    one = replace(TINY, name="tiny", kwargs={**TINY.kwargs, "num_hidden_layers": 1})
    monkeypatch.setitem(model_spaces.GPU_MODELS, "tiny", one)
    out = tmp_path / "run"
    rc = main(["--space", "gpu", "--model", "tiny", "--device", "cpu", "--precisions",
               "bf16,fp8", "--batch-sizes", "4", "--ckpt-ratios", "0", "--dry-run",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if "│" in line and line.split("│")[1].strip()
            .isdigit()]
    assert len(rows) == 16  # 2 precisions x compile_blocks x fused_loss x kernels
    assert sum(" fp8 " in r for r in rows) == 8 and sum(" bf16 " in r for r in rows) == 8
    assert not out.exists()  # nothing written
