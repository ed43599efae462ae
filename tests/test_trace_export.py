"""`trace(tracer="export")` and the `auto` fallback: non-strict torch.export captures what the fx
tracer cannot follow, keeps submodule paths, state_dict keys and the *same* Parameter objects,
trains like eager, and failures of both tracers are one located TraceError."""

from __future__ import annotations

import copy

import models
import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import slapo
from slapo.graph import TraceGuardError, capture_inputs


class DictIn(nn.Module):
    """A dict-of-tensors input: slapo's fx tracer rejects it, export flattens it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.ModuleDict({"a": nn.Linear(4, 4), "b": nn.Linear(4, 4)})
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, feats):
        out = 0
        for k, v in feats.items():
            out = out + self.proj[k](v) * self.scale
        return out


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent: neither tracer can capture it
            return self.lin(x)
        return x


class Cond(nn.Module):
    """The same branch written with torch.cond: fx fails, export captures both branches."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.lin(t), lambda t: t * 2, (x,))


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _feats():
    torch.manual_seed(1)
    return {"a": torch.randn(2, 4), "b": torch.randn(2, 4)}


def test_auto_falls_back_to_export_and_records_why():
    model = nn.Sequential(DictIn())
    ref = copy.deepcopy(model)
    keys, params = list(model.state_dict()), dict(model.named_parameters())
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.TraceError, match="tracer 'fx'.*dict"):
        sch["0"].trace(tracer="fx", example_inputs=(_feats(),))
    gm = sch["0"].trace(example_inputs=(_feats(),))  # auto

    meta = sch["0"].metadata["trace"]
    assert meta["tracer"] == "export" and meta["requested"] == "auto"
    assert "tracer 'fx'" in meta["fx_error"] and "dict" in meta["fx_error"]
    assert sch["0"].metadata["trace"]["tracer"] == "export"
    assert isinstance(gm, fx.GraphModule) and model[0] is gm
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert not model[0]._non_persistent_buffers_set  # buffer stays persistent
    assert sch["0.proj.a"].mod is gm.get_submodule("proj.a")
    # the ATen-level graph can be searched
    sub = sch["0"].find(r"mul")
    assert len(sub) == 2 and all("mul" in str(n.target) for n in sub)

    x = _feats()
    out, expected = model(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    g, gr = _grads(model), _grads(ref)
    assert set(g) == set(gr) == set(params)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-5, atol=1e-5)


def test_torch_cond_is_captured_by_export_both_branches():
    model = nn.Sequential(Cond())
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["0"].trace(example_inputs=(torch.ones(2, 4),))
    assert sch["0"].metadata["trace"]["tracer"] == "export"
    assert "fx" in sch["0"].metadata["trace"]["fx_error"]
    for x in (torch.ones(2, 4), -torch.ones(2, 4)):  # both branches, decided at run time
        torch.testing.assert_close(model(x), ref(x))


def test_data_dependent_branch_names_both_tracers_and_leaves_schedule_unchanged():
    model = nn.Sequential(Branchy(), nn.Linear(4, 4))
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.TraceError) as err:
        sch["0"].trace(example_inputs=(torch.ones(2, 4),))
    msg = str(err.value)
    assert "tracer 'fx'" in msg and "tracer 'export'" in msg
    assert "data-dependent" in msg
    assert msg.count("if x.sum() > 0") == 2 and "test_trace_export.py" in msg
    assert "torch.cond" in msg and "Traceback" not in msg
    with pytest.raises(slapo.TraceError, match="tracer 'export'.*data-dependent"):
        sch["0"].trace(tracer="export", example_inputs=(torch.ones(2, 4),))
    assert type(sch["0"].mod) is Branchy and not sch["0"].history
    assert "trace" not in sch["0"].metadata


def test_export_without_example_inputs_or_with_fx_options_is_refused():
    model = models.gpt2()
    sch = slapo.create_schedule(model)
    mlp = sch["transformer.h.0.mlp"]
    before = mlp.mod
    with pytest.raises(slapo.SchedulingError, match="'export'.*example_inputs"):
        mlp.trace(tracer="export")
    with pytest.raises(slapo.SchedulingError, match="options of tracer 'fx'"):
        mlp.trace(tracer="export", leaves=["c_fc"], example_inputs=(torch.ones(2, 16, 64),))
    with pytest.raises(slapo.SchedulingError, match="not supported"):
        mlp.trace(tracer="dynamo")
    assert mlp.mod is before and not mlp.history and "trace" not in mlp.metadata
    # auto without example_inputs does not fall back, and says why
    with pytest.raises(slapo.TraceError, match="no fallback to tracer 'export'.*example_inputs"):
        slapo.create_schedule(nn.Sequential(DictIn()))["0"].trace()


@pytest.mark.parametrize("path", ["transformer.h.0.mlp", "transformer.h.0.attn"])
def test_gpt2_block_exported_keeps_names_params_numerics_and_trains(path):
    torch.manual_seed(0)
    model = models.gpt2()
    ref = copy.deepcopy(model)
    ids = models.ids()
    example = capture_inputs(model, path, ids, use_cache=False)[path]
    keys, params = list(model.state_dict()), dict(model.named_parameters())
    sub_names = [n for n, _ in model.get_submodule(path).named_modules()]
    sch = slapo.create_schedule(model)
    gm = sch[path].trace(tracer="export", example_inputs=example)

    assert isinstance(gm, fx.GraphModule) and model.get_submodule(path) is gm
    assert sch[path].metadata["trace"]["tracer"] == "export"
    assert sch[path].metadata["trace"]["fx_error"] is None
    assert [n for n, _ in gm.named_modules()] == sub_names
    assert list(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters())
    assert sch[f"{path}.c_proj"].mod is gm.c_proj  # schedule tree rebuilt
    assert type(gm).__name__ == type(ref.get_submodule(path)).__name__
    # training IR: pre-dispatch ATen ops that autograd differentiates when re-run
    assert gm.meta["slapo_export_dialect"] == "TRAINING"
    targets = [n.target for m in gm.modules() if isinstance(m, fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"]
    assert any(isinstance(t, torch._ops.OpOverload) for t in targets)

    out, expected = model(ids, use_cache=False), ref(ids, use_cache=False)
    torch.testing.assert_close(out.logits, expected.logits, rtol=1e-5, atol=1e-5)
    out.logits.pow(2).mean().backward()
    expected.logits.pow(2).mean().backward()
    g, gr = _grads(model), _grads(ref)
    assert set(g) == set(gr) and any(n.startswith(path) for n in g)
    for n in g:
        torch.testing.assert_close(g[n], gr[n], rtol=1e-5, atol=1e-5)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built on the original parameters
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]
    p = params[f"{path}.c_proj.weight"]
    assert gm.c_proj.weight is p and not torch.equal(p, ref.get_submodule(path).c_proj.weight)


def test_export_shape_guard_rejects_other_shapes():
    model = nn.Sequential(DictIn())
    sch = slapo.create_schedule(model)
    sch["0"].trace(tracer="export", example_inputs=(_feats(),))
    with pytest.raises(TraceGuardError, match="shape of input"):
        model({"a": torch.ones(1, 4), "b": torch.ones(1, 4)})  # would run unguarded


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))


def test_export_keeps_tied_weights_tied():
    model = nn.Sequential(Tied())
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["0"].trace(tracer="export", example_inputs=(torch.ones(2, 4),))
    assert model[0].b.weight is model[0].a.weight
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    torch.testing.assert_close(model[0].a.weight.grad, ref[0].a.weight.grad)


BLOCKS = {  # family: (block path, a leaf inside its attention, kwargs for the full model)
    "gpt2": ("transformer.h.1", "attn.c_attn", {"use_cache": False}),
    "llama": ("model.layers.0", "self_attn.q_proj", {"use_cache": False}),
    "bert": ("encoder.layer.0", "attention.self.query", {}),  # a submodule named `self`
}


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_hf_blocks_exported_pass_verify(family):
    model = getattr(models, family)(seed=0)
    path, leaf, kw = BLOCKS[family]
    ids = models.ids()
    example = capture_inputs(model, path, ids, **kw)[path]
    keys = list(model.state_dict())
    sch = slapo.create_schedule(model)
    has_lm = hasattr(model, "lm_head")
    loss_fn = (lambda out: out.loss) if has_lm else (lambda out: out.last_hidden_state.pow(2)
                                                     .mean())
    with slapo.Verify(sch, [ids], loss_fn=loss_fn,  # raises if outputs/grads/step differ
                      example_kwargs=dict(kw, labels=ids) if has_lm else kw):
        sch[path].trace(tracer="export", example_inputs=example)
    assert sch[path].metadata["trace"]["tracer"] == "export"
    assert isinstance(sch[f"{path}.{leaf}"].mod, fx.GraphModule)
    assert sch[f"{path}.{leaf}"].mod is model.get_submodule(f"{path}.{leaf}")
    assert list(model.state_dict()) == keys


def test_rewrites_and_sharding_inside_an_export_capture_are_refused():
    """ATen graphs with fixed shapes: fuse, subgraph replace/checkpoint, decompose, shard and
    sync inside the capture are refused with a clear error and change nothing."""
    model = models.gpt2()
    ids = models.ids()
    path = "transformer.h.0.mlp"
    example = capture_inputs(model, path, ids, use_cache=False)[path]
    sch = slapo.create_schedule(model)
    blk = sch[path]
    blk.trace(tracer="export", example_inputs=example)
    sub = blk.find(r"^act$")
    before = (repr(sch), [(n, p.shape) for n, p in model.named_parameters()])
    attempts = {
        "fuse": lambda: blk.fuse(sub, compiler="eager"),
        "subgraph replace": lambda: blk.replace(nn.Identity(), target_ops=sub),
        "subgraph checkpoint": lambda: blk.checkpoint(sub),
        "shard": lambda: blk["c_fc"].shard("weight", axis=1),
        "sync": lambda: blk["c_proj"].sync("fwd_post", "all_reduce"),
    }
    for what, call in attempts.items():
        with pytest.raises(slapo.SchedulingError, match=f"{what} is not supported inside a "
                           "module captured with tracer='export'"):
            call()
    assert (repr(sch), [(n, p.shape) for n, p in model.named_parameters()]) == before
    blk.checkpoint()  # the captured module as a whole can still be checkpointed
    model(ids, labels=ids, use_cache=False).loss.backward()
