"""Every architecture of the `slapo train` registry trains on its task of the shipped corpus."""

from __future__ import annotations

import math

import pytest
import torch

from slapo.train import MODELS, TrainConfig, train


@pytest.mark.parametrize("name", sorted(MODELS))
def test_registry_model_trains(name):
    torch.set_num_threads(1)
    m = train(TrainConfig(model=name, steps=4, hidden_size=32, num_layers=2, num_heads=2,
                          seq_len=32, batch_size=4, lr=5e-3, progress=False, eval_batches=1))
    losses = m["losses"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.2, losses
    assert math.isfinite(m["val_loss"])
    assert m["parameters_on_rank0"] < 500_000


def test_unknown_model_lists_the_registry():
    with pytest.raises(ValueError, match="gpt2, llama, opt, gpt_neo, bert, roberta, albert, t5"):
        TrainConfig(model="resnet").check()


TINY = dict(steps=2, hidden_size=32, num_layers=2, num_heads=2, seq_len=32, batch_size=4,
            progress=False, eval_batches=0)


def test_knobs_are_passed_to_model_schedule_apply(monkeypatch):
    import slapo
    import slapo.model_schedule as ms

    seen = {}

    def apply(model, **knobs):
        seen.update(knobs)
        return slapo.create_schedule(model)

    monkeypatch.setattr(ms, "apply", apply, raising=False)
    m = train(TrainConfig(**TINY, attention="sdpa", ckpt_ratio=0.5, fuse=False))
    assert seen == {"attention": "sdpa", "ckpt_ratio": 0.5, "fuse": False}
    assert m["schedule"] == "applied: ckpt_ratio=0.5, attention=sdpa, fuse=False"


def test_knob_not_implemented_trains_unscheduled(monkeypatch, capsys):
    import slapo.model_schedule as ms

    def apply(model, **knobs):
        model.transformer.h[0].mlp = None  # a partial apply must not leak into training
        raise NotImplementedError("tempo is not implemented for gpt2")

    monkeypatch.setattr(ms, "apply", apply, raising=False)
    m = train(TrainConfig(**TINY, tempo=True))
    assert m["schedule"].startswith("not applied: tempo is not implemented for gpt2")
    assert "training unscheduled" in capsys.readouterr().out
    assert len(m["losses"]) == 2


def test_missing_model_schedule_apply_trains_unscheduled(monkeypatch):
    import slapo.model_schedule as ms

    monkeypatch.delattr(ms, "apply", raising=False)
    m = train(TrainConfig(**TINY, tp=1))
    assert m["schedule"].startswith("not applied: slapo.model_schedule.apply is not available")
