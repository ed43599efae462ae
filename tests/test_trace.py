"""`trace`: HF GPT-2 / LLaMA / BERT blocks become GraphModules with names, parameters and
numerics unchanged; failures are located TraceErrors and leave the schedule usable."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import slapo
from slapo.graph import TraceGuardError, capture_inputs

BLOCKS = {  # family: (block path, a leaf inside its attention, kwargs for the full model)
    "gpt2": ("transformer.h.0", "attn.c_attn", {"use_cache": False}),
    "llama": ("model.layers.0", "self_attn.q_proj", {"use_cache": False}),
    "bert": ("encoder.layer.0", "attention.self.query", {}),
}


def _loss(out):
    return out.last_hidden_state.pow(2).mean() if hasattr(out, "last_hidden_state") \
        else out.logits.pow(2).mean()


def _fwd_bwd(model, ids, kw):
    model.zero_grad()
    out = model(ids, **kw)
    _loss(out).backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("flatten", [False, True])
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_trace_hf_block_keeps_names_and_numerics(family, flatten):
    model = getattr(models, family)()
    ref = copy.deepcopy(model)
    path, leaf, kw = BLOCKS[family]
    ids = models.ids()
    example = capture_inputs(model, path, ids, **kw)[path]
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    sch = slapo.create_schedule(model)
    gm = sch[path].trace(flatten=flatten, example_inputs=example)

    assert isinstance(sch[path].mod, fx.GraphModule) and gm is sch[path].mod
    assert model.get_submodule(path) is gm
    assert isinstance(sch[f"{path}.{leaf}"].mod, nn.Linear | type(model.get_submodule(
        f"{path}.{leaf}")))
    assert any(n.op == "call_module" and n.target.endswith(leaf.split(".")[-1])
               for n in (gm if flatten else sch[f"{path}.{leaf.rsplit('.', 1)[0]}"].mod)
               .graph.nodes)
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())  # same tensors, same names
    assert sch[path].metadata["trace"]["tracer"] == "fx"
    assert sch[path].metadata["trace"]["tracer"] == "fx"
    assert "trace(" in str(sch)

    out, grads = _fwd_bwd(model, ids, kw)
    ref_out, ref_grads = _fwd_bwd(ref, ids, kw)
    torch.testing.assert_close(_loss(out), _loss(ref_out), rtol=1e-6, atol=0)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


def test_trace_mlp_without_example_inputs_and_leaves():
    model = models.gpt2()
    sch = slapo.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"]
    x = torch.randn(2, 5, 64)
    expected = mlp.mod(x)
    mlp.trace(leaves=["c_fc", "c_proj"])
    targets = {n.target for n in mlp.mod.graph.nodes if n.op == "call_module"}
    assert {"c_fc", "c_proj", "act", "dropout"} <= targets
    assert isinstance(sch["transformer.h.0.mlp.act"].mod, fx.GraphModule)  # flatten=False
    torch.testing.assert_close(mlp.mod(x), expected, rtol=0, atol=0)
    # a different sequence length still works: shapes were not baked in
    assert mlp.mod(torch.randn(3, 7, 64)).shape == (3, 7, 64)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: no static graph exists
            return self.lin(x)
        return x


def test_untraceable_module_raises_located_error_and_schedule_stays_usable():
    model = nn.Sequential(_Branchy(), nn.Linear(4, 4))
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.TraceError) as err:
        sch["0"].trace(example_inputs=(torch.ones(2, 4),))
    msg = str(err.value)
    assert "tracer 'fx'" in msg and "data-dependent" in msg
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "Traceback" not in msg
    assert type(sch["0"].mod) is _Branchy and not sch["0"].history
    assert not any(k.startswith("_tensor_constant") for k in vars(sch["0"].mod))
    with pytest.raises(slapo.TraceError, match="example_inputs|control flow"):
        sch["0"].trace()  # without values fx cannot even evaluate the condition
    sch["1"].trace()  # the schedule is still usable
    assert isinstance(sch["1"].mod, fx.GraphModule)
    assert model(torch.ones(2, 4)).shape == (2, 4)


def test_hf_attention_without_example_inputs_names_the_source_line():
    model = models.llama()
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.TraceError) as err:
        sch["model.layers.0.self_attn"].trace()
    assert "modeling_llama.py" in str(err.value)
    assert "example_inputs" in str(err.value)
    assert type(sch["model.layers.0.self_attn"].mod).__name__ == "LlamaAttention"


def test_guards_reject_inputs_the_graph_was_not_specialised_for():
    model = models.gpt2()
    ids = models.ids()
    path = "transformer.h.0"
    example = capture_inputs(model, path, ids, use_cache=False)[path]
    assert example[1].get("attention_mask") is None and example[0][2] is None
    sch = slapo.create_schedule(model)
    gm = sch[path].trace(example_inputs=example)
    hs = example[0][0]
    gm(hs)  # the same call path works
    with pytest.raises(TraceGuardError, match="attention_mask"):
        gm(hs, None, torch.zeros(2, 1, 16, 16))


def test_unknown_or_unsupported_tracer_is_a_clear_error():
    sch = slapo.create_schedule(models.gpt2())
    with pytest.raises(slapo.SchedulingError, match="not supported.*'auto', 'fx'"):
        sch["transformer.h.0.mlp"].trace(tracer="export")
    with pytest.raises(slapo.SchedulingError, match="unknown tracer"):
        sch["transformer.h.0.mlp"].trace(tracer="jit")
    with pytest.raises(slapo.SchedulingError, match="not a submodule"):
        sch["transformer.h.0.mlp"].trace(leaves=["c_fc.nope"])
    assert not sch["transformer.h.0.mlp"].history
