"""`fuse` (torch.compile backends), subgraph `replace` and subgraph `checkpoint` on traced HF
blocks: numerics equal to eager (fp32, 1e-5), the model still trains, saved bytes drop, and bad
inputs raise clear errors that leave the schedule usable."""

from __future__ import annotations

import copy
import importlib.util

import models
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from test_find import bert_bias_gelu, gpt2_bias_gelu, rms_norm, swiglu

import slapo
from slapo.graph import capture_inputs
from slapo.profile.saved import saved_bytes

pytestmark = pytest.mark.compile


def _schedule(family):
    """(model, reference copy, schedule, [(block schedule, pattern)]) with traced blocks."""
    model = getattr(models, family)()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    if family == "gpt2":
        blk = sch["transformer.h.0.mlp"]
        blk.trace(leaves=["c_fc", "c_proj"], flatten=True)
        blk["c_fc"].decompose()
        return model, ref, sch, [(blk, gpt2_bias_gelu)]
    if family == "bert":
        blk = sch["encoder.layer.0.intermediate"]
        blk.trace(flatten=True)
        blk["dense"].decompose()
        return model, ref, sch, [(blk, bert_bias_gelu)]
    path = "model.layers.0"
    ex = capture_inputs(model, path, models.ids(), use_cache=False)[path]
    blk = sch[path]
    blk.trace(flatten=True, example_inputs=ex)
    return model, ref, sch, [(blk, swiglu), (blk, rms_norm)]


def _loss(family, model, ids):
    if family == "bert":
        out = model(ids)
        return out.last_hidden_state.pow(2).mean() + out.pooler_output.sum()
    return model(ids, labels=ids, use_cache=False).loss


def _check_equal_and_trains(family, model, ref):
    ids = models.ids()
    for m in (model, ref):
        m.zero_grad()
    loss, ref_loss = _loss(family, model, ids), _loss(family, ref, ids)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    ref_params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    losses = []
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        seq = []
        for _ in range(3):
            opt.zero_grad()
            lo = _loss(family, m, ids)
            lo.backward()
            opt.step()
            seq.append(lo.item())
        losses.append(seq)
    assert losses[0][-1] < losses[0][0]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(losses[1]), rtol=1e-5,
                               atol=0)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_fuse_aot_eager_matches_eager_and_trains(family):
    model, ref, sch, targets = _schedule(family)
    keys = list(model.state_dict())
    for i, (blk, pattern) in enumerate(targets):
        (sub,) = blk.find(pattern)[:1]
        fused = blk.fuse(sub, compiler="aot_eager", name=f"fused_{pattern.__name__}")
        assert isinstance(fused.mod, fx.GraphModule)
        assert fused.mod._compiled_call_impl is not None  # nn.Module.compile was applied
        assert sum(n.op == "call_module" and n.target == fused.name
                   for n in blk.mod.graph.nodes) == 1
        assert blk.metadata["fused"][fused.name] == "aot_eager"
        assert i + 1 == len([h for h in blk.history if h.name == "fuse"])
    assert list(model.state_dict()) == keys  # no new or renamed parameters
    _check_equal_and_trains(family, model, ref)


def test_fuse_inductor_gpt2_bias_gelu():
    model, ref, sch, [(blk, pattern)] = _schedule("gpt2")
    (sub,) = blk.find(pattern)
    blk.fuse(sub, compiler="inductor", name="bias_gelu")
    assert "bias_gelu" in blk.child
    _check_equal_and_trains("gpt2", model, ref)


@pytest.mark.skipif(importlib.util.find_spec("hidet") is None, reason="hidet not installed")
def test_fuse_hidet():
    model, ref, sch, [(blk, pattern)] = _schedule("gpt2")
    blk.fuse(blk.find(pattern)[0], compiler="hidet", name="bias_gelu")
    _check_equal_and_trains("gpt2", model, ref)


def test_fuse_errors_leave_schedule_usable():
    model, ref, sch, [(blk, pattern)] = _schedule("gpt2")
    code = blk.mod.code
    with pytest.raises(slapo.SchedulingError, match="unknown torch.compile backend.*inductor"):
        blk.fuse(blk.find(pattern)[0], compiler="tensorrt-ish")
    with pytest.raises(slapo.SchedulingError, match="not contiguous.*pow_1"):
        blk.fuse(blk.find(r"^pow_1$|^tanh$"), compiler="eager")   # pow_1 feeds mul_1 outside
    with pytest.raises(slapo.SchedulingError, match="ambiguous"):
        blk.fuse([blk.find(r"tanh"), blk.find(r"pow")], compiler="eager")
    with pytest.raises(slapo.SchedulingError, match="needs a traced module"):
        sch["transformer.h.1.mlp"].fuse(blk.find(pattern)[0])
    assert blk.mod.code == code and [h.name for h in blk.history] == ["trace"]
    blk.fuse(blk.find(pattern)[0], compiler="eager", name="bias_gelu")  # still usable
    with pytest.raises(slapo.SchedulingError, match="another .*graph"):
        blk.checkpoint(_stale(blk))
    _check_equal_and_trains("gpt2", model, ref)


def _stale(blk):
    sub = blk.find(r"c_proj")
    sub.owner = copy.deepcopy(blk.mod)
    return sub


def test_replace_subgraph_with_function_and_module():
    model, ref, sch, [(blk, pattern)] = _schedule("gpt2")
    (sub,) = blk.find(pattern)
    with pytest.raises(slapo.SchedulingError, match="2 input"):
        blk.replace(lambda x: x, target_ops=sub)

    def tanh_gelu(x, b):
        return F.gelu(x + b, approximate="tanh")

    blk.replace(tanh_gelu, target_ops=sub)
    assert any(n.target is tanh_gelu for n in blk.mod.graph.nodes)
    _check_equal_and_trains("gpt2", model, ref)

    model, ref, sch, [(blk, pattern)] = _schedule("gpt2")

    class BiasGelu(torch.nn.Module):
        def forward(self, x, b):
            return F.gelu(x + b, approximate="tanh")

    new = blk.replace(BiasGelu(), target_ops=blk.find(pattern), name="bias_gelu")
    assert new.path == "transformer.h.0.mlp.bias_gelu" and isinstance(new.mod, BiasGelu)
    _check_equal_and_trains("gpt2", model, ref)


def test_subgraph_checkpoint_cuts_saved_bytes():
    torch.manual_seed(0)
    model = models.gpt2()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"]
    mlp.trace(leaves=["c_fc", "c_proj"], flatten=True)
    x = torch.randn(4, 32, 64, requires_grad=True)
    before = saved_bytes(mlp.mod, x)
    region = mlp.checkpoint(mlp.find(lambda n: n.op != "call_module" or n.target == "c_proj"))
    assert region.name == "checkpointed" and "c_fc" in mlp.child  # c_fc stays outside
    after = saved_bytes(mlp.mod, x)
    # eager: the block input (32 KiB) plus 5 tensors of (4, 32, 256) fp32 = 128 KiB each: the
    # c_fc output, tanh, 0.5*x, 1+tanh, and the c_proj input; checkpointed: the block input and
    # the region's input (the c_fc output) only.
    act, inp = 4 * 32 * 256 * 4, 4 * 32 * 64 * 4
    assert before == 5 * act + inp, before
    assert after == act + inp, after
    assert list(model.state_dict()) == list(ref.state_dict())
    _check_equal_and_trains("gpt2", model, ref)
