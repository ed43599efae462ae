"""Slapo 2023's `find` (issue 32, items 1 and 2): trace by need and 2023 pattern matching.

Ported in spirit from the original project's tests/test_subgraph.py and tests/test_fusion.py:
each pattern kind is found on a node that was never traced (the typed `sch.find` traces it with
2023's defaults first); a decompose done before the trace puts the bias add in the graph, where
`F.gelu(bias + x)` finds it next to an `nn.GELU` module; the 2023 fusion programs (decompose +
trace + find + fuse) compute the unscheduled model's outputs and gradients; and near-miss
patterns (swapped operands of `-`, another constant, another activation) match nothing.
"""

from __future__ import annotations

import copy
import operator
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import slapo
from slapo.graph import Subgraph
from slapo.notices import Slapo2023Notice, reset_notices
from slapo.pattern import ModulePattern, Pattern, call_module
from slapo.primitives.find import FindPrimitive

sys.path.insert(0, str(Path(__file__).parent))


# ---- the 2023 test models ----------------------------------------------------------------------
class LeNet5(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.layer1 = nn.Sequential(nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(),
                                    nn.MaxPool2d(2, 2))
        self.layer2 = nn.Sequential(nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(),
                                    nn.MaxPool2d(2, 2))
        self.fc = nn.Linear(400, 120)
        self.relu = nn.ReLU()
        self.fc1 = nn.Linear(120, 84)
        self.relu1 = nn.ReLU()
        self.fc2 = nn.Linear(84, num_classes)

    def forward(self, x):
        out = self.layer2(self.layer1(x))
        out = out.reshape(out.size(0), -1)
        return self.fc2(self.relu1(self.fc1(self.relu(self.fc(out)))))


class ConvReLUResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.conv(x)) + x


class TwoPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.relu(self.fc1(x) + self.fc2(x))


class Tree(nn.Module):
    def forward(self, x, y, z):
        a = x + y
        b = y - z
        return a * b


class Diamond(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 10)
        self.fc2 = nn.Linear(10, 10)

    def forward(self, x, y):
        a = self.fc1(x) + self.fc2(y)
        b = a * 2
        b1 = a * 5  # not part of the diamond
        c = a * 3
        d = b + c
        return b1 + d


class CoreAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 32)
        self.k_proj = nn.Linear(32, 32)
        self.v_proj = nn.Linear(32, 32)
        self.dropout = nn.Dropout(0.2)

    def permute(self, x):
        return x.permute(0, 2, 1, 3)

    def forward(self, x):
        q = self.permute(self.q_proj(x))
        k = self.permute(self.k_proj(x))
        v = self.permute(self.v_proj(x))
        return self.dropout(F.softmax(q * k, dim=-1)) * v


class LinearGELU(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.linear = nn.Linear(n, n)
        self.gelu = nn.GELU()

    def forward(self, x):
        return self.gelu(self.linear(x))


class Projection(nn.Module):
    def __init__(self, n=16):
        super().__init__()
        self.linear = nn.Linear(n, n)
        self.dropout = nn.Dropout(0.2)
        self.ln = nn.LayerNorm(n)

    def forward(self, x, residual):
        return self.ln(self.dropout(self.linear(x)) + residual)


class ConvReLUPlusOne(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.relu = nn.ReLU()
        self.functional = functional

    def forward(self, x):
        x = self.conv(x)
        x = F.relu(x) if self.functional else self.relu(x)
        return x + 1


def _traced_by_need(sch) -> None:
    """The node was untraced; find traced it with 2023's defaults, as one recorded `trace`."""
    assert isinstance(sch.mod, fx.GraphModule)
    assert [h.name for h in sch.history] == ["trace"]
    assert sch.metadata["trace"]["flatten"] is False and sch.metadata["trace"]["tracer"] == "fx"


def _ops(sub: Subgraph) -> list:
    return [n.target for n in sub]


# ---- 1. every pattern kind on a node never traced ------------------------------------------------
def test_functional_and_call_module_patterns_match_module_calls():
    sch = slapo.create_schedule(ConvReLUResidual())
    (sub,) = sch.find(lambda x, r: F.relu(x) + r)  # F.relu is the nn.ReLU leaf
    _traced_by_need(sch)
    assert _ops(sub) == ["relu", operator.add] and sub[0].op == "call_module"
    assert sub.inputs[0].target == "conv"
    (sub2,) = sch.find(lambda x, r: r + call_module("relu", x))  # and `+` commutes
    assert sub2.nodes == sub.nodes
    assert [h.name for h in sch.history] == ["trace"]  # traced once, find not recorded


def test_regex_and_predicate_on_untraced_node():
    sch = slapo.create_schedule(TwoPaths())
    sub = sch.find(r"fc\d")
    _traced_by_need(sch)
    assert _ops(sub) == ["fc1", "fc2"]
    sch2 = slapo.create_schedule(TwoPaths())
    assert _ops(sch2.find(lambda n: n.op == "call_module" and n.target == "relu")) == ["relu"]
    _traced_by_need(sch2)


def test_two_paths_tree_and_diamond():
    sch = slapo.create_schedule(TwoPaths())
    (sub,) = sch.find(lambda x1, x2: F.relu(x1 + x2))
    _traced_by_need(sch)
    assert _ops(sub) == [operator.add, "relu"]
    assert [n.target for n in sub.inputs] == ["fc1", "fc2"]

    sch = slapo.create_schedule(Tree())
    (sub,) = sch.find(lambda x, y, z: (x + y) * (y - z))
    _traced_by_need(sch)
    assert [n.name for n in sub] == ["add", "sub", "mul"]

    sch = slapo.create_schedule(Diamond())

    def diamond(m, n):
        a = m + n
        return a * 2 + a * 3

    (sub,) = sch.find(diamond)
    _traced_by_need(sch)
    assert _ops(sub) == [operator.add, operator.mul, operator.mul, operator.add]
    assert [n.args[1] for n in sub.nodes[1:3]] == [2, 3]  # not the a * 5 branch
    assert sub[-1].name == "add_1"  # d, not e = b1 + d


def test_horizontal_pattern_returns_every_projection():
    sch = slapo.create_schedule(CoreAttention())
    subs = sch.find(lambda x: call_module(r"[qkv]_proj", x).permute(0, 2, 1, 3))
    _traced_by_need(sch)
    assert len(subs) == 3 and all(len(s) == 2 for s in subs)
    assert [s[0].target for s in subs] == ["q_proj", "k_proj", "v_proj"]
    assert all(s[1].target == "permute" for s in subs)
    assert {s.inputs[0].name for s in subs} == {"x"}  # one shared input


def test_pattern_classes_on_untraced_nodes():
    class ReLUBN(Pattern):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(16)  # any BatchNorm2d matches, whatever its size
            self.relu = nn.ReLU()

        def forward(self, x):
            return F.relu(self.bn(x))  # F.relu in the pattern, nn.ReLU in the model

    class LinearReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(10, 20)
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.linear(x))

    class FcReLU(Pattern):
        def __init__(self):
            super().__init__()
            self.fc = ModulePattern(r"fc")
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.fc(x))

    sch = slapo.create_schedule(LeNet5())
    for layer in ("layer1", "layer2"):
        (sub,) = sch[layer].find(ReLUBN())
        _traced_by_need(sch[layer])
        assert [type(sch[layer].get_module(n.target)) for n in sub] == [nn.BatchNorm2d, nn.ReLU]
    subs = sch.find(LinearReLU())
    _traced_by_need(sch)  # the top node, with its already-traced children kept
    assert [_ops(s) for s in subs] == [["fc", "relu"], ["fc1", "relu1"]]
    assert [_ops(s) for s in sch.find(FcReLU())] == [["fc", "relu"], ["fc1", "relu1"]]
    fn_subs = sch.find(lambda x: F.relu(call_module(r"fc", x)))
    assert [_ops(s) for s in fn_subs] == [["fc", "relu"], ["fc1", "relu1"]]


def test_module_in_a_pattern_class_matches_the_functional_call():
    class GELUPattern(Pattern):
        def __init__(self):
            super().__init__()
            self.act = nn.GELU()

        def forward(self, x, b):
            return self.act(x + b)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, b):
            return F.gelu(b + self.fc(x))

    sch = slapo.create_schedule(Model())
    (sub,) = sch.find(GELUPattern())
    assert _ops(sub) == [operator.add, F.gelu]


def test_trace_by_need_uses_2023_defaults():
    class Opaque(nn.Module):
        traceable = False  # 2023's marker: kept as a leaf

        def forward(self, x):
            return x * 2 if x.sum() > 0 else x  # data-dependent: fx could not trace it

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
            self.opaque = Opaque()

        def forward(self, x):
            return self.opaque(self.block(x))

    torch.manual_seed(0)
    model, x = Model(), torch.randn(2, 4)
    ref = model(x)
    sch = slapo.create_schedule(model)
    sub = sch.find(r"opaque")
    _traced_by_need(sch)
    assert sub[0].op == "call_module"
    assert isinstance(sch["block"].mod, fx.GraphModule)  # not flattened: its own graph
    assert isinstance(sch["block.0"].mod, nn.Linear)  # torch.nn built-ins are leaves
    torch.testing.assert_close(sch.mod(x), ref, rtol=0, atol=0)


# ---- errors: what changes, what does not --------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (("relu(",), "not a valid regular expression"),
    ((3,), "cannot search for a int"),
    (("relu", "fuzzy"), "unknown kind 'fuzzy'"),
])
def test_bad_query_is_refused_before_tracing(args, message):
    model = ConvReLUResidual()
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match=message):
        sch.find(*args)
    assert sch.mod is model and sch.history == []


def test_untraceable_module_raises_and_stays_as_it_was():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y if y.sum() > 0 else -y

    model = Branchy()
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.TraceError, match="fx"):
        sch.find(lambda x: F.relu(x))
    assert sch.mod is model and sch.history == []


def test_core_find_still_refuses_an_untraced_module():
    sch = slapo.create_schedule(TwoPaths())
    with pytest.raises(slapo.SchedulingError, match="needs a traced module"):
        FindPrimitive.run(sch, r"fc1")
    assert not isinstance(sch.mod, fx.GraphModule)


def test_no_match_raises_and_leaves_the_node_untraced():
    """The search runs on a graph traced aside first: a failed find changes nothing (2023
    left the node traced)."""
    sch = slapo.create_schedule(TwoPaths())
    with pytest.raises(slapo.SchedulingError, match="matches nothing.*relu"):
        sch.find(lambda x: F.gelu(x))
    assert not isinstance(sch.mod, fx.GraphModule) and not sch.history


# ---- mutations: near misses match nothing -------------------------------------------------------
class SubRelu(nn.Module):
    def forward(self, x, r):
        return r - F.relu(x)


@pytest.mark.parametrize("model, pattern", [
    (SubRelu, lambda x, r: F.relu(x) - r),  # `-` does not commute
    (Tree, lambda x, y, z: (x + y) * (z - y)),  # y - z, not z - y
    (Diamond, lambda m, n: (m + n) * 2 + (m + n) * 4),  # no a * 4
    (ConvReLUResidual, lambda x, r: F.gelu(x) + r),  # nn.ReLU is not GELU
    (ConvReLUResidual, lambda x: F.relu(x) + x),  # one input: relu's input is not the residual
    (TwoPaths, lambda x1, x2: F.relu(x1 - x2)),
])
def test_near_miss_patterns_match_nothing(model, pattern):
    sch = slapo.create_schedule(model())
    with pytest.raises(slapo.SchedulingError, match="matches nothing"):
        sch.find(pattern)


def test_plus_commutes_but_alpha_does_not():
    class AddAlpha(nn.Module):
        def forward(self, x, r):
            return torch.add(F.relu(x), r, alpha=2)

    sch = slapo.create_schedule(SubRelu())
    (sub,) = sch.find(lambda x, r: r - F.relu(x))
    assert _ops(sub) == [F.relu, operator.sub]
    sch = slapo.create_schedule(AddAlpha())
    assert len(sch.find(lambda x, r: torch.add(F.relu(x), r, alpha=2))) == 1
    with pytest.raises(slapo.SchedulingError, match="matches nothing"):
        sch.find(lambda x, r: torch.add(r, F.relu(x), alpha=2))


def test_decomposed_linear_is_not_the_functional_linear():
    sch = slapo.create_schedule(LinearGELU())
    assert len(sch.find(lambda x, w, b: F.gelu(F.linear(x, w, b)))) == 1  # nn.Linear leaf
    sch = slapo.create_schedule(LinearGELU())
    sch["linear"].decompose()
    sch.trace(flatten=True)  # the Linear now runs without its bias: not F.linear(x, w, b)
    with pytest.raises(slapo.SchedulingError, match="matches nothing"):
        sch.find(lambda x, w, b: F.linear(x, w, b))


# ---- 2. decompose, trace, find, fuse: the 2023 fusion programs ----------------------------------
def _grads(mod: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in mod.named_parameters()}


def _same_training_step(mod: nn.Module, sch_model: nn.Module, *inputs, seed=1) -> None:
    """Outputs, input gradients and parameter gradients of the scheduled model equal the
    unscheduled one's (bit for bit: the same ops in the same order; dropout on the same
    generator state)."""
    ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ref_ins = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    torch.manual_seed(seed)
    out = sch_model(*ins)
    out.square().sum().backward()
    torch.manual_seed(seed)
    ref = mod(*ref_ins)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for a, b in zip(ins, ref_ins):
        if b.requires_grad:
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    got, want = _grads(sch_model), _grads(mod)
    assert got.keys() == want.keys()  # parameter names unchanged by decompose/trace/fuse
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=name)


def test_bias_gelu_program():
    torch.manual_seed(0)
    mod = LinearGELU()
    sch = slapo.create_schedule(copy.deepcopy(mod))
    sch["linear"].decompose()
    sch.trace(flatten=True)
    graph_ops = [n.target for n in sch.mod.graph.nodes if n.op != "placeholder"]
    assert graph_ops[:3] == ["linear", "linear.bias", torch.add]  # the bias add is a node

    subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
    assert len(subgraph) == 1 and _ops(subgraph[0]) == [torch.add, "gelu"]
    sch.fuse(subgraph, compiler=None, name="BiasGeLU")
    assert "BiasGeLU" in dict(sch.mod.named_children())
    sch_model, _ = slapo.build(sch, init_weights=False)
    _same_training_step(mod, sch_model, torch.randn(2, 5, 16, requires_grad=True))


def test_bias_layernorm_program_with_dropout():
    torch.manual_seed(0)
    mod = Projection()
    sch = slapo.create_schedule(copy.deepcopy(mod))
    sch["linear"].decompose()
    sch.trace(flatten=True)

    def pattern(x, bias, residual):
        return F.layer_norm(F.dropout(x + bias) + residual, 16)

    subgraph = sch.find(pattern)
    assert len(subgraph) == 1
    assert _ops(subgraph[0]) == [torch.add, "dropout", operator.add, "ln"]
    sch.fuse(subgraph, compiler=None, name="FusedLN")
    sch_model, _ = slapo.build(sch, init_weights=False)
    assert sch_model.training  # dropout is live: both runs draw the same mask
    _same_training_step(mod, sch_model, torch.randn(2, 5, 16, requires_grad=True),
                        torch.randn(2, 5, 16, requires_grad=True))


@pytest.mark.parametrize("functional", [True, False], ids=["vertical", "fallback"])
def test_vertical_and_fallback_fusion_programs(functional):
    """2023's test_vertical_fusion (F.relu in the model) and test_fallback_fusion (nn.ReLU):
    the same pattern, found on the untraced model, fused without a compiler."""
    torch.manual_seed(0)
    mod = ConvReLUPlusOne(functional)
    sch = slapo.create_schedule(copy.deepcopy(mod))

    def pattern(x):
        return F.relu(call_module("conv", x)) + 1

    subgraph = sch.find(pattern)
    _traced_by_need(sch)
    assert len(subgraph) == 1 and len(subgraph[0]) == 3
    sch.fuse(subgraph, compiler=None, name="FusedConvReLU")
    sch_model, _ = slapo.build(sch, init_weights=False)
    _same_training_step(mod, sch_model, torch.randn(1, 3, 8, 8, requires_grad=True))


def test_decompose_before_trace_nested_and_flattened():
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = LinearGELU(8)
            self.out = nn.Linear(8, 8)

        def forward(self, x):
            return self.out(self.inner(x))

    for flatten in (False, True):
        torch.manual_seed(0)
        mod = Outer()
        sch = slapo.create_schedule(copy.deepcopy(mod))
        sch["inner.linear"].decompose()
        sch.trace(flatten=flatten)
        owner = sch if flatten else sch["inner"]
        (sub,) = owner.find(lambda x, b: F.gelu(x + b))
        assert sub.inputs[1].target.endswith("linear.bias")
        owner.fuse(sub, compiler=None, name="bias_gelu")
        sch_model, _ = slapo.build(sch, init_weights=False)
        _same_training_step(mod, sch_model, torch.randn(3, 8, requires_grad=True))


def test_decompose_before_trace_gpt2_conv1d():
    import models
    from transformers.activations import NewGELUActivation

    sch = slapo.create_schedule(models.gpt2())
    mlp = sch["transformer.h.0.mlp"]
    mlp["c_fc"].decompose()
    mlp.trace(leaves=["c_fc", "c_proj"], flatten=True)
    (sub,) = mlp.find(lambda x, b: NewGELUActivation()(b + x))
    assert sub[0].target is torch.add and sub.inputs[1].target == "c_fc.bias"


def test_hooked_decomposed_layer_keeps_its_bias_inside():
    """A forward hook runs after the layer's bias; moving the add into the graph would run it
    before, so such a layer stays decomposed inside (and the bias add is not found)."""
    torch.manual_seed(0)
    mod = LinearGELU()
    sch = slapo.create_schedule(copy.deepcopy(mod))
    sch["linear"].decompose()
    sch["linear"].mod.register_forward_hook(lambda m, a, out: out * 2)
    mod.linear.register_forward_hook(lambda m, a, out: out * 2)
    sch.trace(flatten=True)
    assert not any(n.op == "get_attr" for n in sch.mod.graph.nodes)
    with pytest.raises(slapo.SchedulingError, match="matches nothing"):
        sch.find(lambda x, bias: F.gelu(bias + x))
    sch_model, _ = slapo.build(sch, init_weights=False)
    _same_training_step(mod, sch_model, torch.randn(2, 16, requires_grad=True))


@pytest.mark.compile
def test_bias_gelu_program_torchscript_compiles():
    """The 2023 program as written: `compiler="TorchScript"` (compiled by torch.compile)."""
    torch.manual_seed(0)
    mod = LinearGELU()
    sch = slapo.create_schedule(copy.deepcopy(mod))
    sch["linear"].decompose()
    sch.trace(flatten=True)
    subgraph = sch.find(lambda x, bias: F.gelu(bias + x))
    reset_notices()
    with pytest.warns(Slapo2023Notice, match="TorchScript"):
        sch.fuse(subgraph, compiler="TorchScript", name="BiasGeLU")
    sch_model, _ = slapo.build(sch, init_weights=False)
    x = torch.randn(2, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = sch_model(x), mod(x_ref)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x_ref.grad)
    for name, g in _grads(mod).items():
        torch.testing.assert_close(_grads(sch_model)[name], g, msg=name)
