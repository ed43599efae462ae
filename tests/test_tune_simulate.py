import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from slapo.tune.simulate import DEVICES, GPT_MODELS, LayerModel, main, simulate  # noqa: E402


@pytest.fixture(scope="module")
def gpt7b():
    return LayerModel(GPT_MODELS["gpt-7b"])


def check_plan(p, spec, gpus, global_batch, dev):
    assert p.dp * p.tp * p.pp == gpus
    assert p.dp * p.micro_batch * p.num_microbatches == global_batch
    assert sum(p.layers) == spec.layers and len(p.layers) == p.pp
    assert all(0 <= c <= j for c, j in zip(p.ckpt, p.layers))
    assert max(p.stage_memory) <= 0.9 * dev.memory_bytes - 2e9


def test_h100_plans_are_valid_and_pruning_is_exact(gpt7b):
    spec, dev = GPT_MODELS["gpt-7b"], DEVICES["h100"]
    grid = dict(tps=(1, 2), pps=(1, 2, 4), micro_batches=(1, 2), zeros=(0, 1, 3))
    plans = simulate(spec, 16, 256, dev, gpt7b, top=3, **grid)
    assert len(plans) == 3 and plans[0].step_time <= plans[1].step_time <= plans[2].step_time
    for p in plans:
        check_plan(p, spec, 16, 256, dev)
    everything = simulate(spec, 16, 256, dev, gpt7b, top=10_000, **grid)
    assert len(everything) > 20
    assert everything[0].step_time == pytest.approx(plans[0].step_time)


def test_memory_pressure_on_small_gpus_forces_sharding_and_uneven_ckpt(gpt7b):
    """7B on 8 x 24 GB: 7B x 16 B of states cannot sit on one GPU, so the plan must shard it,
    and under 1F1B the first stages (more micro-batches in flight) checkpoint more (as Mist's)."""
    spec, dev = GPT_MODELS["gpt-7b"], DEVICES["l4"]
    best = simulate(spec, 8, 128, dev, gpt7b, top=1)[0]
    check_plan(best, spec, 8, 128, dev)
    assert best.pp * best.tp > 1
    assert sum(best.ckpt) > 0 and best.ckpt[0] >= best.ckpt[-1]
    # the same model on 80 GB devices needs no checkpointing at all
    assert sum(simulate(spec, 8, 128, DEVICES["h100"], gpt7b, top=1)[0].ckpt) == 0


def test_cli_prints_a_plan(capsys):
    main(["--device", "h100", "--models", "gpt-1.3b", "--gpus", "8", "--top", "1"])
    out = capsys.readouterr().out
    assert "gpt-1.3b" in out and "samples/s" in out and "layers=[" in out


def test_bad_arguments():
    with pytest.raises(ValueError, match="gpus"):
        simulate(GPT_MODELS["gpt-1.3b"], 0, 8, DEVICES["h100"], layer_model=object())
