"""`cut_pipeline_stage` validation and `slapo.pipeline.partition`: 2 cuts -> 3 stages whose
sequential composition equals the original forward and gradients (GPT-2, LLaMA, BERT)."""

from __future__ import annotations

import copy

import models
import pytest
import torch

import slapo
from slapo import pipeline

LAYERS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "encoder.layer"}


def _reference(family, model, ids):
    if family == "bert":
        out = model(ids)
        return out.last_hidden_state, out.pooler_output
    return (model(ids, use_cache=False).logits,)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_two_cuts_give_three_stages_equal_to_the_model(family):
    model = getattr(models, family)(layers=4)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    layers = LAYERS[family]
    sch[f"{layers}.2"].cut_pipeline_stage()   # recorded out of order on purpose
    sch[f"{layers}.0"].cut_pipeline_stage()
    assert sch.pipeline_cuts == (f"{layers}.0", f"{layers}.2")
    stages = pipeline.partition(sch)
    assert len(stages) == 3
    # stages share the model's modules (no copies) under the original names
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert f"{layers}.1.{next(iter(dict(model.get_submodule(layers + '.1').named_parameters())))}"\
        in names
    p0 = next(model.get_submodule(f"{layers}.0").parameters())
    assert any(p is p0 for p in stages[0].parameters())
    assert not any(p is p0 for p in stages[1].parameters())
    assert pipeline.build_stage(sch, 2).hi == 4

    ids = models.ids()
    out = pipeline.run_stages(stages, ids)
    out = out if isinstance(out, tuple) else (out,)
    expected = _reference(family, ref, ids)
    for a, b in zip(out, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sum(o.float().pow(2).mean() for o in out).backward()
    sum(o.float().pow(2).mean() for o in expected).backward()
    ref_grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if ref_grads[n].grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, n
            continue
        torch.testing.assert_close(p.grad, ref_grads[n].grad, rtol=1e-4, atol=1e-6, msg=n)


def test_invalid_cuts_raise_and_leave_the_schedule_usable():
    model = models.gpt2(layers=3)
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match="root module cannot be cut"):
        sch.cut_pipeline_stage()
    with pytest.raises(slapo.SchedulingError, match="last layer"):
        sch["transformer.h.2"].cut_pipeline_stage()
    with pytest.raises(slapo.SchedulingError, match="inside a block"):
        sch["transformer.h.0.attn"].cut_pipeline_stage()  # untraced block: data flow unknown
    # traced block: the residual crosses a cut after attn -> residual-branch error
    ids = models.ids()
    ex = slapo.graph.capture_inputs(model, "transformer.h.0", ids, use_cache=False)
    sch["transformer.h.0"].trace(example_inputs=ex["transformer.h.0"])
    with pytest.raises(slapo.SchedulingError, match="residual branch"):
        sch["transformer.h.0.attn"].cut_pipeline_stage()
    assert sch.pipeline_cuts == ()
    sch["transformer.h.0"].cut_pipeline_stage()
    with pytest.raises(slapo.SchedulingError, match="already"):
        sch["transformer.h.0"].cut_pipeline_stage()
    assert sch.pipeline_cuts == ("transformer.h.0",)
    stages = pipeline.partition(sch)
    torch.testing.assert_close(pipeline.run_stages(stages, ids),
                               model(ids, use_cache=False).logits, rtol=1e-5, atol=1e-6)
