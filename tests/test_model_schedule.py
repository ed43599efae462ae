"""Ready schedules (`slapo.model_schedule.apply`) for every family on 2 real gloo ranks.

For each family: TP=2 + checkpointing + SDPA attention core, under Verify (outputs, every
gradient, one optimizer step); and the consolidated state dict has exactly the original keys and
loads back into the unscheduled HF model.
"""

from __future__ import annotations

import pytest
import torch

import slapo
from slapo import model_schedule

FAMILIES = ["bert_mlm", "roberta", "albert", "gpt2", "gpt_neo", "opt", "t5", "llama", "qwen2",
            "qwen3"]


def job_family(name: str):
    import models

    kw = models.batch_for(name)
    model = getattr(models, name)(seed=0)
    keys = list(model.state_dict().keys())
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kw, loss_fn=lambda out: out.loss) as v:
        model_schedule.apply(sch, tp=2, ckpt_ratio=0.5, attention="sdpa")
    n_sharded = sum(1 for p in model.parameters() if getattr(p, "_slapo_shard", None))
    assert n_sharded >= 4, n_sharded
    applied = {h.name for _, h in sch.applied()}
    assert {"shard", "sync", "checkpoint"} <= applied, applied
    full = slapo.consolidate(sch)
    assert list(full.keys()) == keys
    fresh = getattr(models, name)(seed=123)
    fresh.load_state_dict(full, strict=True)
    ref = getattr(models, name)(seed=0)   # the original weights: consolidate == original
    for k, value in ref.state_dict().items():
        torch.testing.assert_close(full[k], value, msg=k)
    return {"checked": len(v.report), "sharded": n_sharded, "applied": sorted(applied)}


@pytest.mark.dist
@pytest.mark.parametrize("name", FAMILIES)
def test_family_tp2_ckpt_sdpa_verified(dist2, name):
    res = dist2.run(job_family, name)
    assert res[0] == res[1]


def test_detect_and_unknown_architecture():
    import models

    assert model_schedule.detect(models.gpt2()).name == "gpt2"
    assert model_schedule.detect(models.t5()).name == "t5"
    with pytest.raises(slapo.SchedulingError) as info:
        model_schedule.apply(torch.nn.Linear(2, 2))
    msg = str(info.value)
    assert "no ready schedule for Linear" in msg and "llama" in msg and "register_family" in msg


def test_single_process_knobs_verified():
    import models

    model = models.gpt2(layers=4)
    kw = models.batch_for("gpt2")
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kw, loss_fn=lambda out: out.loss):
        model_schedule.apply(sch, ckpt_ratio=0.5, attention="sdpa")
    ckpt = [p for p, h in sch.applied() if h.name == "checkpoint"]
    assert ckpt == ["transformer.h.0", "transformer.h.1"]


def test_bad_knobs():
    import models

    sch = slapo.create_schedule(models.gpt2())
    with pytest.raises(slapo.SchedulingError, match="unknown attention"):
        model_schedule.apply(sch, attention="fast")
    with pytest.raises(slapo.SchedulingError, match="tp=2 but"):
        model_schedule.apply(sch, tp=2)
    with pytest.raises(slapo.SchedulingError, match="ckpt_ratio"):
        model_schedule.apply(sch, ckpt_ratio=1.5)


def job_all_knobs(name: str):
    """Every knob at once on 2 ranks: TP + SDPA + Tempo + fused MLPs + checkpointing."""
    import models

    kw = models.batch_for(name)
    model = getattr(models, name)(seed=0)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kw, loss_fn=lambda out: out.loss):
        model_schedule.apply(sch, tp=2, ckpt_ratio=1.0, attention="sdpa", tempo=True,
                             fuse=True, fuse_compiler="aot_eager")
    return sorted({h.name for _, h in sch.applied()})


@pytest.mark.dist
@pytest.mark.compile
@pytest.mark.parametrize("name", ["gpt2", "bert_mlm", "llama", "roberta", "gpt_neo",
                                  "t5_gated"])
def test_all_knobs_tp2_verified(dist2, name):
    applied = dist2.run(job_all_knobs, name)[0]
    assert {"shard", "sync", "checkpoint", "trace", "fuse", "replace"} <= set(applied), applied


@pytest.mark.compile
def test_t5_fuses_gated_gelu_and_rejects_relu_untouched():
    """T5 v1.1's gated-GELU MLPs are fused (outputs, gradients, a step verified; fewer bytes
    saved for backward); T5 v1's lone ReLU has nothing to fuse and is rejected before any MLP
    is traced."""
    import models

    from slapo.profile import saved_bytes

    relu = slapo.create_schedule(models.t5())
    with pytest.raises(slapo.SchedulingError, match="ReLU `DenseReluDense`"):
        model_schedule.apply(relu, fuse=True, fuse_compiler="aot_eager")
    assert list(relu.applied()) == []
    model = models.t5_gated(seed=0)
    x = torch.randn(2, 16, model.config.d_model)
    before = saved_bytes(model.encoder.block[0].layer[1].DenseReluDense, x)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=models.batch_for("t5_gated"),
                      loss_fn=lambda out: out.loss):
        model_schedule.apply(sch, fuse=True, fuse_compiler="aot_eager")
    fused = sorted(p for p, h in sch.applied() if h.name == "fuse")
    assert fused == ["decoder.block.0.layer.2.DenseReluDense",
                     "decoder.block.1.layer.2.DenseReluDense",
                     "encoder.block.0.layer.1.DenseReluDense",
                     "encoder.block.1.layer.1.DenseReluDense"]
    after = saved_bytes(model.encoder.block[0].layer[1].DenseReluDense, x)
    assert after < before, (after, before)
    print(f"t5 v1.1 DenseReluDense saved bytes: {before} -> {after}")
