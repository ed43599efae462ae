import json

import numpy as np
import pytest

from slapo.tune.memory import model_state_bytes, pipeline_inflight, stage_peak_bytes
from slapo.tune.timing import (
    AlphaBeta,
    DeviceConstants,
    calibrate,
    collective_time,
    fit_alpha_beta,
    roofline_time,
)


def test_model_states_zero_stages_and_tp():
    n = 1_000_000
    s0 = model_state_bytes(n, param_bytes=2, optimizer="adam")
    # bf16 weights + bf16 grads + fp32 master + m + v = 2 + 2 + 12 bytes/param
    assert (s0.weights, s0.grads, s0.optimizer) == (2 * n, 2 * n, 12 * n)
    z1 = model_state_bytes(n, dp=4, zero=1)
    z2 = model_state_bytes(n, dp=4, zero=2)
    z3 = model_state_bytes(n, dp=4, zero=3)
    assert z1.optimizer == 3 * n and z1.grads == 2 * n and z1.weights == 2 * n
    assert z2.grads == n / 2 and z2.weights == 2 * n
    assert z3.total == pytest.approx(16 * n / 4)
    tp = model_state_bytes(n, tp=2, replicated_params=1000, param_bytes=4, optimizer="sgd")
    assert tp.weights == (1000 + (n - 1000) / 2) * 4 and tp.optimizer == (1000 + (n - 1000) / 2) * 4
    vec = model_state_bytes(n, dp=np.array([1, 2, 4]), zero=np.array([3, 3, 3]))
    np.testing.assert_allclose(vec.total, 16 * n / np.array([1, 2, 4]))
    with pytest.raises(ValueError, match="optimizer"):
        model_state_bytes(n, optimizer="lion")
    with pytest.raises(ValueError, match="zero stage"):
        model_state_bytes(n, zero=4)


def test_1f1b_inflight_and_stage_peak():
    assert [int(pipeline_inflight(i, 4, 8)) for i in range(4)] == [4, 3, 2, 1]
    assert [int(pipeline_inflight(i, 4, 2)) for i in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="stage"):
        pipeline_inflight(4, 4, 8)
    kw = dict(states=100, layers=4, saved_per_layer=10, input_per_layer=1, pp=2, num_microbatches=8)
    assert stage_peak_bytes(ckpt_layers=0, stage=0, **kw) == 100 + 2 * 40
    assert stage_peak_bytes(ckpt_layers=4, stage=0, **kw) == 100 + 2 * 4 + 10
    assert stage_peak_bytes(ckpt_layers=1, stage=1, **kw) == 100 + 1 * 31 + 10
    with pytest.raises(ValueError, match="ckpt_layers"):
        stage_peak_bytes(ckpt_layers=5, **kw)


def test_alpha_beta_fit_recovers_constants_from_noisy_sweep():
    rng = np.random.default_rng(0)
    true = AlphaBeta(alpha=8e-6, beta=1 / 150e9)
    samples = []
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (2, 4, 8):
            for size in (2**k for k in range(10, 30, 2)):
                t = float(collective_time(op, size, n, true)) * (1 + 0.02 * rng.standard_normal())
                samples.append((op, size, n, t))
    fit = fit_alpha_beta(samples)
    assert fit.alpha == pytest.approx(true.alpha, rel=0.05)
    assert fit.beta == pytest.approx(true.beta, rel=0.05)
    assert float(collective_time("all_reduce", 1 << 20, 1, fit)) == 0.0  # one rank: no comm
    with pytest.raises(ValueError, match="two samples"):
        fit_alpha_beta([("all_reduce", 100, 2, 1e-5)])
    with pytest.raises(ValueError, match="unknown"):
        collective_time("all_to_all", 1, 2, fit)


def test_roofline_and_calibration_cache(tmp_path):
    dev = DeviceConstants("toy", peak_flops=1e12, mem_bandwidth=1e11)
    assert roofline_time(2e12, 1e11, dev) == pytest.approx(3.0)
    cache = tmp_path / "consts.json"
    c = calibrate(cache_path=cache, gemm_n=256, copy_mib=8)
    assert c.peak_flops > 1e8 and c.mem_bandwidth > 1e8
    stored = json.loads(cache.read_text())
    assert c.name in stored
    stored[c.name]["peak_flops"] = 123.0  # a cached entry is reused, not re-measured
    cache.write_text(json.dumps(stored))
    assert calibrate(cache_path=cache).peak_flops == 123.0
    assert DeviceConstants.from_json(c.to_json()) == c


def test_collective_sweep_runs_on_gloo(tmp_path):
    import torch.distributed as dist

    from slapo.tune.timing import collective_sweep

    with pytest.raises(RuntimeError, match="init_process_group"):
        collective_sweep([1024])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        out = collective_sweep([1024, 65536], ops=("all_reduce", "all_gather"), iters=2, warmup=1)
    finally:
        dist.destroy_process_group()
    assert [(o[0], o[2]) for o in out] == [("all_reduce", 1), ("all_reduce", 1),
                                          ("all_gather", 1), ("all_gather", 1)]
    assert all(o[3] > 0 for o in out)
