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
    from slapo.train.setup import check_inputs  # a name or a path: asks the filesystem

    with pytest.raises(ValueError, match="gpt2, llama, opt, gpt_neo, bert, roberta, albert, t5"):
        check_inputs(TrainConfig(model="resnet"))


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


def test_knob_not_implemented_stops_the_run_with_its_message(monkeypatch, capsys):
    """No silent fallback: a knob `apply` cannot do stops the run (exit 1), never an
    unscheduled or unsharded run that looks like the asked-for one."""
    import slapo.model_schedule as ms
    from slapo.cli import main

    def apply(model, **knobs):
        raise NotImplementedError("tempo is not implemented for gpt2")

    monkeypatch.setattr(ms, "apply", apply, raising=False)
    with pytest.raises(ValueError, match="tempo is not implemented for gpt2"):
        train(TrainConfig(**TINY, tempo=True))
    assert main(["train", "--tempo", "--steps", "1", "--no-progress", "--hidden-size", "32",
                 "--num-layers", "2", "--num-heads", "2", "--seq-len", "32"]) == 1
    assert "tempo is not implemented for gpt2" in capsys.readouterr().err
