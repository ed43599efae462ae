"""The GPT-2 tuning space, the training trial and the cost-model predictor (tiny GPT-2)."""

import math
import warnings

import pytest
import torch

from slapo.tune.evaluators import TrialEvaluator, TrialSettings, parse_bytes, train_trial
from slapo.tune.model_spaces import SpaceArgs, make_space, schedule_knobs
from slapo.tune.predict_cpu import GPT2CostModel
from slapo.tune.timing import DeviceConstants

TINY = TrialSettings(hidden_size=32, num_layers=2, num_heads=2, seq_len=16, steps=2, warmup=1)
DEVICE = DeviceConstants("test", peak_flops=1e11, mem_bandwidth=1e10)


def test_default_gpt2_space_is_the_issue_space():
    space = make_space("gpt2")
    assert space.names() == ["batch_size", "attention", "ckpt_ratio", "fuse", "tempo"]
    assert len(space) == 72 >= 24
    assert space.candidates("ckpt_ratio") == [0.0, 0.5, 1.0]
    cfg = {"batch_size": 4, "attention": "sdpa", "ckpt_ratio": 0.5, "fuse": True, "tempo": False}
    assert space.apply(cfg).to_dict() == cfg
    with pytest.raises(ValueError, match="not a candidate"):
        space.apply({**cfg, "batch_size": 3})


def test_ratios_that_checkpoint_the_same_layers_are_merged():
    # of 2 layers, 0.25 and 0.5 both checkpoint one layer (apply rounds half up)
    space = make_space("gpt2", SpaceArgs(ckpt_ratios=(0.0, 0.25, 0.5, 1.0), num_layers=2))
    assert space.candidates("ckpt_ratio") == [0.0, 0.25, 1.0]
    with pytest.raises(ValueError, match="not in"):
        make_space("gpt2", SpaceArgs(ckpt_ratios=(1.5,))).configs()
    with pytest.raises(ValueError, match="no tuning space"):
        make_space("bert")


def test_schedule_knobs_and_sizes():
    assert schedule_knobs({"batch_size": 2}) == {"attention": "eager", "ckpt_ratio": 0.0,
                                                 "fuse": False, "tempo": False}
    assert parse_bytes("3G") == 3 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5g") == int(1.5 * (1 << 30))
    assert parse_bytes(None) is None and parse_bytes("") is None
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_train_trial_reports_throughput_and_peak():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = train_trial(TINY, {"batch_size": 2, "attention": "sdpa", "ckpt_ratio": 0.5,
                               "fuse": False, "tempo": True})
    assert len(m["step_times_s"]) == TINY.warmup + TINY.steps
    assert m["throughput"] == pytest.approx(2 * 16 / m["step_time_s"])
    assert m["peak_memory_bytes"] > 50 << 20  # a process with torch in it
    assert math.isfinite(m["loss"])


def test_subprocess_trial_over_the_cap_is_oom():
    ev = TrialEvaluator(TrialSettings(**{**TINY.to_json(), "mem_cap_bytes": 1 << 20}), 120)
    res = ev({"batch_size": 2, "attention": "sdpa", "ckpt_ratio": 0.0, "fuse": False,
              "tempo": False})
    assert res.status == "oom", res
    assert res.metrics["peak_memory_bytes"] > 1 << 20
    assert "cap" in res.error


@pytest.fixture(scope="module")
def model():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield GPT2CostModel(TINY, device=DEVICE, base_rss=100 << 20)


def _cfg(**kw):
    return {"batch_size": 4, "attention": "eager", "ckpt_ratio": 0.0, "fuse": False,
            "tempo": False, **kw}


def test_predictor_memory_and_time_follow_the_knobs(model):
    base = model(_cfg())
    assert base["throughput"] == pytest.approx(4 * 16 / base["step_time_s"])
    ckpt = model(_cfg(ckpt_ratio=1.0))
    assert ckpt["memory"] < base["memory"] and ckpt["step_time_s"] > base["step_time_s"]
    assert model(_cfg(batch_size=8))["memory"] > base["memory"]
    # Tempo and SDPA save fewer bytes for backward than HF eager
    assert model.saved_ratio("eager", False, True) < 1.0
    assert model(_cfg(attention="sdpa"))["saved_activation_bytes"] < base["saved_activation_bytes"]


def test_predicted_layer_saved_bytes_match_a_real_forward(model):
    from slapo.tune.capture import measure_saved_bytes

    block = model._one_layer({"attention": "eager"})
    x = torch.randn(3, TINY.seq_len, TINY.hidden_size, requires_grad=True)
    measured = measure_saved_bytes(block, (x,), include_inputs=True)
    assert model.layer_cost("eager").saved(3) == measured
