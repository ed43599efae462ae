"""`find` on traced HF blocks: regex, predicate and structural patterns (bias+GELU, SwiGLU,
RMSNorm); clear errors for no match; not recorded in the history."""

from __future__ import annotations

import models
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from transformers.activations import NewGELUActivation

import slapo
from slapo.graph import Subgraph, capture_inputs


def gpt2_bias_gelu(x, b):
    return NewGELUActivation()(x + b)


def bert_bias_gelu(x, b):
    return F.gelu(x + b)


def swiglu(gate, up):
    return F.silu(gate) * up


def rms_norm(x, w):
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + 1e-6)
    return w * h.to(dtype)


def gpt2_mlp():
    sch = slapo.create_schedule(models.gpt2())
    mlp = sch["transformer.h.0.mlp"]
    mlp.trace(leaves=["c_fc", "c_proj"], flatten=True)
    mlp["c_fc"].decompose()  # exposes the bias add in the graph
    return sch, mlp


def test_gpt2_regex_predicate_and_pattern():
    sch, mlp = gpt2_mlp()
    assert any(n.op == "get_attr" and n.target == "c_fc.bias" for n in mlp.mod.graph.nodes)
    sub = mlp.find(r"tanh|pow")
    assert isinstance(sub, Subgraph) and [n.target for n in sub] == [torch.pow, torch.tanh]
    mods = mlp.find(lambda node: node.op == "call_module")
    assert [n.target for n in mods] == ["c_fc", "c_proj", "dropout"]
    found = mlp.find(gpt2_bias_gelu)
    assert len(found) == 1
    ops = [n.target for n in found[0]]
    assert ops[0] is torch.add and torch.tanh in ops and len(ops) == 9
    assert found[0].inputs[0].target == "c_fc" and found[0].inputs[1].target == "c_fc.bias"
    assert [h.name for h in mlp.history] == ["trace"]  # find is a query: not recorded


def test_bert_bias_gelu_pattern():
    sch = slapo.create_schedule(models.bert())
    blk = sch["encoder.layer.0.intermediate"]
    blk.trace(flatten=True)
    blk["dense"].decompose()
    (sub,) = blk.find(bert_bias_gelu)
    assert [n.target for n in sub] == [torch.add, F.gelu]
    assert blk.find(r"gelu").nodes == [sub.nodes[1]]


def test_llama_swiglu_and_rmsnorm_patterns():
    model = models.llama()
    ids = models.ids()
    path = "model.layers.0"
    ex = capture_inputs(model, path, ids, use_cache=False)[path]
    sch = slapo.create_schedule(model)
    sch[path].trace(flatten=True, example_inputs=ex)
    layer = sch[path]
    (glu,) = layer.find(swiglu)
    assert [n.target for n in glu][0] is F.silu and len(glu) == 2
    assert glu.inputs[0].target == "mlp.gate_proj" and glu.inputs[1].target == "mlp.up_proj"
    norms = layer.find(rms_norm)
    assert len(norms) == 2  # input_layernorm and post_attention_layernorm
    weights = sorted(n.target for s in norms for n in s.inputs if n.op == "get_attr")
    assert weights == ["input_layernorm.weight", "post_attention_layernorm.weight"]
    attn = layer.find(r"attention_fn")
    assert attn.nodes[0].op == "call_module"  # the HF attention call is one node


def test_find_errors():
    sch, mlp = gpt2_mlp()
    with pytest.raises(slapo.SchedulingError, match="matches no node.*ops in this graph"):
        mlp.find(r"softmax")
    with pytest.raises(slapo.SchedulingError, match="matches nothing"):
        mlp.find(swiglu)
    # an untraced node is traced by need (2023's find), but a search that finds nothing
    # leaves it untraced: the search ran on a graph traced aside
    other = sch["transformer.h.1.mlp"]
    with pytest.raises(slapo.SchedulingError, match="matches no node"):
        other.find(r"softmax")
    assert not isinstance(other.mod, fx.GraphModule) and not other.history
    assert other.find(r"act") and isinstance(other.mod, fx.GraphModule)
    with pytest.raises(slapo.SchedulingError, match="unknown kind"):
        mlp.find(r"gelu", kind="fuzzy")
    # the schedule is still usable afterwards
    assert isinstance(mlp.mod, fx.GraphModule) and mlp.find(r"tanh")
