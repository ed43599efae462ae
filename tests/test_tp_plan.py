"""Tensor-parallel plans as data (`slapo.model_schedule.plan`): the tables reproduce the plans
that were code, a user family written as a table trains on 2 ranks, bad plans change nothing,
and the cost model's `shard_block` splits a block exactly as the runtime does."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

import slapo
from slapo import model_schedule
from slapo.distributed import collectives as C
from slapo.distributed.group import VirtualGroup, rank, world_size
from slapo.model_schedule import _registry
from slapo.model_schedule.plan import (
    Column,
    DivideAttr,
    EnterRegion,
    ReduceParamGrads,
    Row,
    TPPlan,
)
from slapo.model_schedule.plan_block import plan_for, shard_block
from slapo.sharding import shard_spec

# ---- the old plans, as code (copied from the family files before they became tables) ---------


def _conv1d(mod):
    from slapo.sharding import _is_hf_conv1d

    return _is_hf_conv1d(mod)


def column(node, blocks=1):
    node.shard("weight", axis=1 if _conv1d(node.mod) else 0, blocks=blocks)
    if getattr(node.mod, "bias", None) is not None:
        node.shard("bias", axis=0, blocks=blocks)


def row(node, sp=False, token_axis=1):
    node.shard("weight", axis=0 if _conv1d(node.mod) else 1)
    if sp:
        node.sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=token_axis)
    else:
        node.sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def rig(node):
    node.sync(mode="bwd_post", sync_op_or_fn="all_reduce")


def enter(node, sp=False, token_axis=1):
    if sp:
        node.sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=token_axis)
    else:
        rig(node)


def divide(node, name, ws):
    node.set_attr(name, getattr(node.mod, name) // ws)


def old_gpt2(layer, ws, sp):
    attn = layer["attn"]
    column(attn["c_attn"], blocks=3)
    enter(attn if sp else attn["c_attn"], sp)
    divide(attn, "split_size", ws)
    row(attn["c_proj"], sp)
    column(layer["mlp.c_fc"])
    enter(layer["mlp.c_fc"], sp)
    row(layer["mlp.c_proj"], sp)


def old_gpt_neo(layer, ws, sp):
    attn = layer["attn.attention"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    enter(attn, sp)
    divide(attn, "num_heads", ws)
    row(attn["out_proj"], sp)
    column(layer["mlp.c_fc"])
    enter(layer["mlp.c_fc"], sp)
    row(layer["mlp.c_proj"], sp)


def old_llama(layer, ws, sp):
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    enter(attn, sp)
    row(attn["o_proj"], sp)
    for norm in ("q_norm", "k_norm"):
        if norm in attn.child:
            attn[norm].reduce_param_grads()
    mlp = layer["mlp"]
    column(mlp["gate_proj"])
    column(mlp["up_proj"])
    enter(mlp, sp)
    row(mlp["down_proj"], sp)


def old_bert(layer, ws, sp):
    attn = layer["attention.self"]
    for name in ("query", "key", "value"):
        column(attn[name])
    enter(attn, sp)
    row(layer["attention.output.dense"], sp)
    column(layer["intermediate.dense"])
    enter(layer["intermediate.dense"], sp)
    row(layer["output.dense"], sp)


def old_opt(layer, ws, sp):
    attn = layer["self_attn"]
    for name in ("q_proj", "k_proj", "v_proj"):
        column(attn[name])
    enter(attn, sp)
    divide(attn, "num_heads", ws)
    row(attn["out_proj"], sp)
    column(layer["fc1"])
    enter(layer["fc1"], sp, token_axis=0)
    row(layer["fc2"], sp, token_axis=0)


def _old_t5_attention(attn, ws, cross):
    for name in ("q", "k", "v"):
        column(attn[name])
        if cross:
            rig(attn[name])
    if not cross:
        rig(attn)
    row(attn["o"])
    divide(attn, "n_heads", ws)
    divide(attn, "inner_dim", ws)
    if "relative_attention_bias" in attn.child:
        attn["relative_attention_bias"].shard("weight", axis=1)


def old_t5(block, ws, sp):
    for sub in block["layer"]:
        if "SelfAttention" in sub.child:
            _old_t5_attention(sub["SelfAttention"], ws, cross=False)
        elif "EncDecAttention" in sub.child:
            _old_t5_attention(sub["EncDecAttention"], ws, cross=True)
        elif "DenseReluDense" in sub.child:
            ff = sub["DenseReluDense"]
            for name in ("wi", "wi_0", "wi_1"):
                if name in ff.child:
                    column(ff[name])
            rig(ff)
            row(ff["wo"])


def old_albert(layer, ws, sp):
    attn = layer["attention"]
    for name in ("query", "key", "value"):
        column(attn[name])
        rig(attn[name])
    row(attn["dense"])
    column(layer["ffn"])
    rig(layer["ffn"])
    row(layer["ffn_output"])


OLD = {"gpt2": old_gpt2, "gpt_neo": old_gpt_neo, "llama": old_llama, "qwen3": old_llama,
       "bert": old_bert, "roberta": old_bert, "opt": old_opt, "t5": old_t5, "t5_gated": old_t5,
       "albert": old_albert}
SP = {"gpt2", "gpt_neo", "llama", "qwen3", "bert", "roberta", "opt"}
CASES = [(name, sp) for name in OLD for sp in (False, True) if not sp or name in SP]


def _record(model: nn.Module, shard_layer) -> dict:
    """Every primitive call, every shard spec and every int attribute of the model after
    sharding each layer with `shard_layer(layer)` on one rank of a virtual 2-way group."""
    sch = slapo.create_schedule(model, group=VirtualGroup(2, 0))
    family = model_schedule.detect(model)
    for layer in _registry.layers_of(sch, family):
        shard_layer(layer)
    calls = [(path, str(h)) for path, node in sch.named_schedules() for h in node.history]
    specs = {n: (tuple(p.shape), shard_spec(p).axis, shard_spec(p).blocks)
             for n, p in model.named_parameters() if shard_spec(p) is not None}
    attrs = {(n, k): v for n, m in model.named_modules() for k, v in vars(m).items()
             if isinstance(v, int) and not isinstance(v, bool)}
    return {"calls": calls, "specs": specs, "attrs": attrs}


@pytest.mark.parametrize("name,sp", CASES, ids=[f"{n}-{'sp' if s else 'tp'}" for n, s in CASES])
def test_tables_reproduce_the_plans_that_were_code(name, sp):
    import models

    family = model_schedule.detect(getattr(models, name)(seed=0))
    assert isinstance(family.tp_plan, TPPlan) and not hasattr(family, "shard_layer")
    new = _record(getattr(models, name)(seed=0),
                  lambda layer: family.shard(layer, 2, sequence_parallel=sp))
    old = _record(getattr(models, name)(seed=0), lambda layer: OLD[name](layer, 2, sp))
    assert new["calls"] == old["calls"]
    assert new["specs"] == old["specs"] and new["specs"]
    assert new["attrs"] == old["attrs"]


def test_optional_rows_follow_the_variant():
    """T5: decoder blocks get the cross-attention rows, encoder blocks skip them; Qwen3's
    q_norm/k_norm get their gradients summed, LLaMA has none to skip."""
    import models

    t5 = models.t5(seed=0)
    sch = slapo.create_schedule(t5, group=VirtualGroup(2, 0))
    for layer in _registry.layers_of(sch, model_schedule.detect(t5)):
        model_schedule.t5.TP_PLAN.apply(layer, 2)
    assert shard_spec(t5.decoder.block[0].layer[1].EncDecAttention.q.weight).axis == 0
    assert t5.encoder.block[0].layer[0].SelfAttention.n_heads == 2
    assert shard_spec(t5.encoder.block[0].layer[0].SelfAttention
                      .relative_attention_bias.weight).axis == 1
    qwen = models.qwen3(seed=0)
    sch = slapo.create_schedule(qwen, group=VirtualGroup(2, 0))
    model_schedule.llama.TP_PLAN.apply(sch["model.layers.0"], 2)
    assert "reduce_param_grads" in [h.name for h in sch["model.layers.0.self_attn.q_norm"].history]


# ---- a bad plan changes nothing -------------------------------------------------------------


def _snapshot(model: nn.Module) -> list:
    return [(n, tuple(p.shape), shard_spec(p)) for n, p in model.named_parameters()] + \
        [(n, dict(m._forward_pre_hooks), dict(m._forward_hooks), m.__dict__.get("split_size"))
         for n, m in model.named_modules()]


BAD = {
    "missing path": ((("attn.c_attn", Column(blocks=3)), ("attn.c_proj", Row()),
                      ("mlp.c_gate", Column())), r"'mlp\.c_gate'.*does not have.*optional"),
    "indivisible attribute": ((("attn.c_attn", Column(blocks=3)),
                               ("attn", DivideAttr("num_heads")), ("ln_1", DivideAttr("eps"))),
                              "needs an int attribute 'eps'"),
    "twice": ((("mlp.c_fc", Column()), ("mlp.c_fc", EnterRegion()), ("mlp.c_proj", Row()),
               ("mlp.c_fc", EnterRegion())), "both apply"),
    "not a parameter owner": ((("mlp.c_fc", Column()), ("mlp", ReduceParamGrads())),
                              "needs parameters"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_plan_raises_before_any_change(case):
    import models

    rows, match = BAD[case]
    model = models.gpt2(seed=0)
    sch = slapo.create_schedule(model, group=VirtualGroup(2, 0))
    before = _snapshot(model)
    with pytest.raises(slapo.SchedulingError, match=match) as err:
        TPPlan(rows).apply(sch["transformer.h.0"], 2)
    assert "transformer.h.0" in str(err.value)  # names the layer (or the module inside it)
    assert _snapshot(model) == before
    assert not [h for _, node in sch.named_schedules() for h in node.history]


def test_plan_rejects_a_tp_other_than_the_groups_and_malformed_rows():
    import models

    sch = slapo.create_schedule(models.gpt2(seed=0), group=VirtualGroup(2, 0))
    with pytest.raises(slapo.SchedulingError, match="group has 2 ranks"):
        model_schedule.gpt2.TP_PLAN.apply(sch["transformer.h.0"], 4)
    with pytest.raises(slapo.SchedulingError, match="not a \\(path, style\\) pair"):
        TPPlan((("attn", "column"),))
    with pytest.raises(slapo.SchedulingError, match="not a mode"):
        EnterRegion(only="tp")


def test_plan_prints_as_a_table():
    text = str(model_schedule.llama.TP_PLAN)
    assert "self_attn.q_proj" in text and "Column(blocks=1)" in text
    assert "self_attn.q_norm?" in text and "ReduceParamGrads" in text


# ---- a user's family written as a table trains on two ranks ------------------------------------


class _Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.n_heads, self.head_dim = heads, hidden // heads
        self.q, self.k, self.v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, _ = x.shape

        def heads(t):  # reshapes by the stored head count: DivideAttr must divide it
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        y = torch.nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                                             heads(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class _Block(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = _Attention(hidden, heads)
        self.up, self.down = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class MyModel(nn.Module):
    def __init__(self, hidden=32, heads=4, layers=2):
        super().__init__()
        self.config = types.SimpleNamespace(model_type="my_test_model", num_attention_heads=heads)
        self.layers = nn.ModuleList(_Block(hidden, heads) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


MY_PLAN = TPPlan((
    ("attn.q", Column()), ("attn.k", Column()), ("attn.v", Column()),
    ("attn", EnterRegion()),
    ("attn", DivideAttr("n_heads")),
    ("attn.out", Row()),
    ("up", Column()), ("up", EnterRegion()),
    ("down", Row()),
))


def job_user_table_family():
    """A family registered with only a table (no code) under Verify: outputs, every gradient
    (shards gathered) and one SGD step against the unsharded model, on this rank."""
    _registry.register_family(_registry.Family(name="my_test", model_types=("my_test_model",),
                                               layer_lists=("layers",), tp_plan=MY_PLAN))
    try:
        torch.manual_seed(0)
        model = MyModel()
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))
        sch = slapo.create_schedule(model)
        with slapo.Verify(sch, [x], loss_fn=lambda out: out.pow(2).mean()) as v:
            model_schedule.apply(sch, tp=2)
        sharded = sorted(n for n, p in model.named_parameters() if shard_spec(p) is not None)
        return {"grads": sum(k.startswith("grad ") for k in v.report), "sharded": sharded,
                "n_heads": model.layers[0].attn.n_heads, "params": len(list(model.parameters()))}
    finally:
        _registry._FAMILIES.pop("my_test", None)


@pytest.mark.dist
def test_user_family_as_a_table_trains_on_two_ranks(dist2):
    res = dist2.run(job_user_table_family)
    assert res[0] == res[1]
    assert res[0]["grads"] == res[0]["params"]  # every gradient compared
    assert res[0]["n_heads"] == 2
    assert "layers.0.attn.q.weight" in res[0]["sharded"] and \
        "layers.1.down.weight" in res[0]["sharded"]


# ---- the cost model's view: shard_block == one rank of the runtime ------------------------------

RUNTIME_FAMILIES = ("gpt2", "llama", "bert", "opt", "t5", "albert", "gpt_neo")


def _layer0(model: nn.Module) -> nn.Module:
    sch = slapo.create_schedule(model)
    return _registry.layers_of(sch, model_schedule.detect(model))[0].mod


def _layout(layer: nn.Module) -> dict:
    """Parameter shapes and int attributes (head counts, split sizes) of one layer."""
    out = {f"param {n}": tuple(p.shape) for n, p in layer.named_parameters()}
    out.update({f"attr {n}.{k}": v for n, m in layer.named_modules()
                for k, v in vars(m).items() if isinstance(v, int) and not isinstance(v, bool)})
    return out


def job_runtime_layouts():
    import models

    out = {}
    for name in RUNTIME_FAMILIES:
        model = getattr(models, name)(seed=0)
        model_schedule.apply(slapo.create_schedule(model), tp=2)
        out[name] = _layout(_layer0(model))
    return out


@pytest.mark.dist
def test_shard_block_splits_like_the_runtime(dist2):
    """GPT-2 in particular: the runtime divides `split_size` and leaves `num_heads` (HF reshapes
    by -1); the old cost-model table divided `num_heads` too."""
    import models

    runtime = dist2.run(job_runtime_layouts)
    for name in RUNTIME_FAMILIES:
        block = _layer0(getattr(models, name)(seed=0))
        for r in range(2):
            assert _layout(shard_block(block, 2, rank=r)) == runtime[r][name], name
    gpt2 = _layer0(models.gpt2(seed=0))
    one = shard_block(gpt2, 2)
    assert (one.attn.num_heads, one.attn.split_size) == (gpt2.attn.num_heads,
                                                          gpt2.attn.split_size // 2)
    assert runtime[0]["gpt2"]["attr attn.num_heads"] == gpt2.attn.num_heads


def test_shard_block_keeps_the_original_and_finds_plans():
    import models

    block = _layer0(models.llama(seed=0))
    shapes = [tuple(p.shape) for p in block.parameters()]
    half = shard_block(block, 2, rank=1)
    assert [tuple(p.shape) for p in block.parameters()] == shapes  # a copy was sharded
    torch.testing.assert_close(half.self_attn.q_proj.weight, block.self_attn.q_proj.weight[32:])
    assert plan_for(block) is model_schedule.llama.TP_PLAN
    assert plan_for(_layer0(models.roberta(seed=0))) is model_schedule.bert.TP_PLAN
    with pytest.raises(slapo.SchedulingError, match="key_value_heads=2 is not divisible by 4"):
        shard_block(block, 4)  # 32 rows of k_proj divide 4 ways, but into half heads
    with pytest.raises(slapo.SchedulingError, match="no tensor-parallel plan for Linear"):
        shard_block(nn.Linear(4, 4), 2)
    with pytest.raises(slapo.SchedulingError, match="positive int"):
        shard_block(block, 0)
    out = shard_block(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4)), 2,
                      plan=TPPlan((("0", Column()), ("1", Row()))))
    assert out[0].weight.shape == (4, 4) and out[1].weight.shape == (4, 4)


def test_virtual_group_collectives_move_no_data_but_keep_shapes():
    g = VirtualGroup(4, rank=1)
    assert (world_size(g), rank(g)) == (4, 1)
    x = torch.arange(8.0).reshape(1, 8)
    assert C.reduce_forward(x, g) is x and C.reduce_backward(x, g) is x
    assert C.all_gather(x, 1, g).shape == (1, 32)
    torch.testing.assert_close(C.reduce_scatter(x, 1, g), torch.tensor([[2.0, 3.0]]))
    torch.testing.assert_close(C.scatter(x, 1, g), torch.tensor([[2.0, 3.0]]))
    with pytest.raises(ValueError, match="rank must be in"):
        VirtualGroup(2, rank=2)


def test_apply_checks_every_layer_before_the_first_shard():
    """A layer the plan does not fit (here the last one lacks its MLP projection) is refused
    before layer 0 (or the attention swap) changed: apply resolves every layer first."""
    import models

    model = models.gpt2(seed=0)
    last = model.transformer.h[-1].mlp
    del last.c_proj
    sch = slapo.create_schedule(model, group=VirtualGroup(2, 0))
    before = _snapshot(model)
    with pytest.raises(slapo.SchedulingError, match=r"'mlp\.c_proj'"):
        model_schedule.apply(sch, tp=2, attention="sdpa")
    assert _snapshot(model) == before
    assert not [h for _, node in sch.named_schedules() for h in node.history]


def test_a_family_without_a_plan_refuses_tp_before_any_change():
    """`tp_plan=None` means "not tensor-parallel" (the code form `shard_layer` is gone): tp > 1
    is refused with the fix, and the model and the schedule are as they were."""
    _registry.register_family(_registry.Family(name="no_plan", model_types=("my_test_model",),
                                               layer_lists=("layers",)))
    try:
        model = MyModel()
        before = {n: p.clone() for n, p in model.state_dict().items()}
        sch = slapo.create_schedule(model, group=VirtualGroup(2, 0))
        with pytest.raises(slapo.SchedulingError, match="no tensor-parallel plan.*tp_plan="):
            model_schedule.apply(sch, tp=2)
        assert not sch.applied()
        for n, p in model.state_dict().items():
            assert torch.equal(p, before[n]), n
    finally:
        _registry._FAMILIES.pop("no_plan", None)
