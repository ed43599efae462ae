"""What the original Slapo's own test suite (awslabs/slapo v0.0.3, `tests/`) needs of today's
slapo, tested directly on the adapters (nothing of the original is vendored):
`slapo.sharding`'s 2023 collectives (`sync_ops`), `sch.metadata.param_tags` / `tie_weights`,
`slapo.pipeline.analyze_tie_weights` and DeepSpeed's `analyze_tie_ranks`, 2023's RNG tracker
names, a traced model whose submodule branches on a shape (kept an untraced leaf, as 2023's
tracer kept it) partitioned from its graph, `replace(fn, node)`, and the harness
`scripts/run_slapo2023_suite.py` (its CPU mapping and result merging; the suite itself runs
when a mirror of awslabs/slapo is on this machine, docs/migrating.md "The 2023 test suite")."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import slapo
from slapo.notices import Slapo2023Notice, reset_notices
from slapo.pipeline import analyze_tie_weights, generate_pipeline_partition, run_stages

ROOT = Path(__file__).resolve().parents[1]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------ sync ops (2 ranks)
def job_sync_ops():
    import torch.distributed as dist

    from slapo.sharding import (
        all_gather_forward_output,
        reduce_backward_grad,
        reduce_forward_output,
        reduce_scatter_forward_output,
        scatter_forward_output,
        sync_ops,
    )

    assert sync_ops.reduce_backward_grad is reduce_backward_grad
    assert sync_ops.all_gather_forward_output is all_gather_forward_output
    r = dist.get_rank()
    w = float(r + 1)  # each rank's upstream gradient weight: the sum over ranks is 3
    base = torch.arange(8.0).reshape(2, 4)

    x = base.clone().requires_grad_()
    y = reduce_backward_grad(x, None)
    _close(y, base)
    (y * w).sum().backward()
    _close(x.grad, torch.full_like(base, 3.0))  # backward all-reduces

    x = (base + r).requires_grad_()
    y = reduce_forward_output(x, None)
    _close(y, 2 * base + 1)
    _close(x.detach(), base + r)  # 2023 reduced in place; the input is kept here
    (y * w).sum().backward()
    _close(x.grad, torch.full_like(base, w))  # backward is the identity

    for partial, want in ((True, 3.0), (False, w)):
        x = (base + 10 * r).requires_grad_()
        y = all_gather_forward_output(x, 1, None, tensor_parallel_output_grad=partial)
        _close(y, torch.cat([base, base + 10], dim=1))
        (y * w).sum().backward()
        _close(x.grad, torch.full_like(base, want))  # reduce-scatter, or this rank's slice

    x = (base + r).requires_grad_()
    y = reduce_scatter_forward_output(x, 1, None)
    _close(y, (2 * base + 1)[:, 2 * r: 2 * r + 2])
    g = torch.full_like(y, w)
    y.backward(g)
    _close(x.grad, torch.cat([torch.full_like(y, 1.0), torch.full_like(y, 2.0)], dim=1))

    x = base.clone().requires_grad_()
    y = scatter_forward_output(x, 1, None)
    _close(y, base[:, 2 * r: 2 * r + 2])
    y.backward(torch.full_like(y, w))
    _close(x.grad, torch.cat([torch.full_like(y, 1.0), torch.full_like(y, 2.0)], dim=1))
    return True


def test_sync_ops_two_ranks(dist2):
    assert dist2.run(job_sync_ops) == [True, True]


def test_sync_ops_one_rank_are_identities():
    from slapo.sharding import sync_ops

    x = torch.randn(2, 4)
    for fn, args in ((sync_ops.reduce_backward_grad, ()), (sync_ops.reduce_forward_output, ()),
                     (sync_ops.all_gather_forward_output, (1,)),
                     (sync_ops.reduce_scatter_forward_output, (1,)),
                     (sync_ops.scatter_forward_output, (1,))):
        assert torch.equal(fn(x, *args, None) if args else fn(x, None), x)


# ---------------------------------------------------------------------------------- metadata
class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(4, 4, bias=False)
        self.layer2 = nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.layer2(self.layer1(x))


def test_metadata_param_tags():
    with slapo.init_empty_weights():
        sch = slapo.create_schedule(_Two())
    assert sch.metadata.param_tags == frozenset()
    sch["layer1"].annotate("weight", "foo", "bar")
    assert "foo" in sch.metadata.param_tags
    assert sch["layer2"].metadata.param_tags == sch.metadata.param_tags  # tree-wide, as 2023
    sch["layer2"].shard("weight", axis=1)  # the 2023 `orig_shape` tag is an annotation too
    assert sch.metadata.param_tags == {"foo", "orig_shape"}
    with pytest.raises(AttributeError):
        sch.metadata.param_tags.add("x")  # a view: tags live on the tensors
    with pytest.raises(AttributeError):
        sch.metadata.not_a_tag_set  # noqa: B018
    assert dict(sch.metadata) == {} and isinstance(sch.metadata, dict)  # still the node's dict
    model, _ = slapo.build(sch)
    assert model.layer1.weight.foo == "bar" and not hasattr(model.layer2.weight, "foo")


def test_metadata_tie_weights_and_register_refusals():
    from slapo.schedule import register_metadata_attribute

    model = _Two()
    model.layer2.weight = model.layer1.weight
    sch = slapo.create_schedule(model)
    assert sch.metadata.tie_weights == {model.layer1.weight: model.layer1.weight}
    assert slapo.create_schedule(_Two()).metadata.tie_weights == {}
    for name in ("keys", "_private", "param_tags"):
        with pytest.raises(ValueError):
            register_metadata_attribute(name, lambda node: None)


# ------------------------------------------------------------------------------- tie weights
class _Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(10, 10)
        self.linear = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        return self.linear(self.wte(x))


class _StageN(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10, bias=False)

    def forward(self, x):
        return self.linear(x)


class _Stages(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.stage0 = _Stage0()
        for i in range(1, n):
            self.add_module(f"stage{i}", _StageN())


def test_analyze_tie_weights_2023_report():
    with slapo.init_empty_weights():
        model = _Stages(3)
        model.stage1.linear.weight = model.stage0.wte.weight
        model.stage2.linear.weight = model.stage0.wte.weight
    ties = analyze_tie_weights(model, False)
    assert list(ties) == [model.stage0.wte.weight]
    assert ties[model.stage0.wte.weight] == {("stage0.wte.weight", 0), ("stage1.linear.weight", 0),
                                             ("stage2.linear.weight", 0)}
    ties = analyze_tie_weights(model, True)  # the children are the stages
    assert list(ties.values()) == [[("wte.weight", 0), ("linear.weight", 1),
                                    ("linear.weight", 2)]]
    assert analyze_tie_weights([model.stage0, model.stage1, model.stage2], True) == ties
    # a tie inside one stage is no pipeline tie
    one = _Stages(2)
    one.stage0.linear.weight = one.stage0.wte.weight
    assert analyze_tie_weights(one, True) == {}
    assert len(analyze_tie_weights(one, False)) == 1
    for bad, flag in ((3, False), ([one.stage0], False), ([], True), ([3], True), (one, "yes")):
        with pytest.raises(TypeError):
            analyze_tie_weights(bad, flag)


def test_analyze_tie_ranks_deepspeed_topology():
    class Topology:  # pp=4, tp=2, dp=1, as DeepSpeed's filter_match(pipe=s) answers it
        def filter_match(self, pipe):
            return [pipe * 2, pipe * 2 + 1]

    with slapo.init_empty_weights():
        model = _Stages(4)
        model.stage3.linear.weight = model.stage0.wte.weight
        model.stage2.linear.weight = model.stage1.linear.weight
    groups = list(analyze_tie_weights(model, True).values())
    ranks, stages = slapo.framework_dialect.deepspeed.pipeline.analyze_tie_ranks(groups,
                                                                                  Topology())
    assert sorted(zip(ranks, stages)) == [([[0, 6], [1, 7]], [0, 3]), ([[2, 4], [3, 5]], [1, 2])]
    with pytest.raises(TypeError, match="filter_match"):
        slapo.framework_dialect.deepspeed.pipeline.analyze_tie_ranks(groups, object())
    with pytest.raises(TypeError, match="name, stage id"):
        slapo.framework_dialect.deepspeed.pipeline.analyze_tie_ranks([["x"]], Topology())


# ------------------------------------------------------------------------------------- RNG
def test_rng_tracker_2023_names():
    from slapo.random import (
        _CUDA_RNG_STATE_TRACKER,
        CudaRNGStatesTracker,
        get_cuda_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    t = CudaRNGStatesTracker()
    t.set_states({"s1": 1234})
    assert t.get_states()["s1"] == 1234
    t.reset()
    assert not t.get_states()
    t.add("s2", 1111)
    with pytest.raises(ValueError, match="seed 1111"):
        t.add("s3", 1111)
    with pytest.raises(ValueError, match="already exists"):
        t.add("s2", 111)
    with pytest.raises(RuntimeError, match="set_random_seed"):
        t.fork("missing")
    assert get_cuda_rng_tracker() is _CUDA_RNG_STATE_TRACKER
    try:
        tp_seed = model_parallel_cuda_manual_seed(123, tp_rank=1, always_enable_tp_seed=False)
        assert tp_seed == 123 + 2718 + 1
        states = _CUDA_RNG_STATE_TRACKER.get_states()
        assert states["model-parallel-rng"] is states["tensor-parallel"]
        assert slapo.get_rng_tracker().has("tensor-parallel")  # one tracker, today's too
        default = torch.rand(3)
        with get_cuda_rng_tracker().fork("model-parallel-rng"):
            tp = torch.rand(3)
        torch.manual_seed(123)
        _close(default, torch.rand(3))  # the default stream was seeded with `seed`
        torch.manual_seed(tp_seed)
        _close(tp, torch.rand(3))  # the TP stream with seed + 2718 + tp_rank
        snapshot = get_cuda_rng_tracker().get_states()
        get_cuda_rng_tracker().set_states(snapshot)  # both names back to one stream
        assert set(slapo.get_rng_tracker().get_states()) == {"tensor-parallel"}
        assert slapo.set_random_seed(7, 1, 2) == 7 + 200 + 10
    finally:
        slapo.set_random_seed(2013)


# ----------------------------------------------- a submodule that branches on a shape (2023)
class _Pre(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        if x.size(0) > 0:  # control flow on a shape: fx cannot follow it without inputs
            return self.linear(x)
        return x


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 10)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _SeqModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = _Pre()
        self.layers = nn.Sequential(_Inner(), _Inner())
        self.post = _Inner()

    def forward(self, x):
        h = self.pre(x)
        return self.post(self.layers(h)) + h  # `h` crosses the stage boundary


class _ListModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = _Pre()
        self.layers = nn.ModuleList([_Inner(), _Inner(), _Inner()])
        self.post = _Inner()

    def forward(self, x, scale: float = 2.0):
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.post(x) * scale


def test_trace_2023_keeps_a_shape_branching_child_untraced():
    model = _SeqModel()
    with pytest.raises(slapo.TraceError, match="control flow"):
        slapo.create_schedule(model).trace()  # today's spelling: the located error
    assert not isinstance(model.pre, fx.GraphModule)
    sch = slapo.create_schedule(model)
    reset_notices()
    with pytest.warns(Slapo2023Notice, match=r"\['pre'\] cannot be traced"):
        sch.trace(tracer="pytorch")  # a 2023 spelling: 2023's rule
    assert isinstance(sch.mod, fx.GraphModule) and type(sch["pre"].mod) is _Pre
    assert isinstance(sch["post"].mod, fx.GraphModule)  # the others are traced
    with pytest.raises(slapo.TraceError):
        slapo.create_schedule(_SeqModel()).trace(tracer="pytorch", flatten=True)


def test_pipeline_partition_of_a_shape_branching_model():
    torch.manual_seed(0)
    model = _SeqModel()
    x = torch.randn(3, 10)
    ref = model(x)
    sch = slapo.create_schedule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Slapo2023Notice)
        sch.trace_until("layers", tracer="pytorch")  # 2023's program, unchanged
    sch["layers.0"].cut_pipeline_stage()
    stages = generate_pipeline_partition(sch)
    assert len(stages) == 2
    _close(run_stages(stages, x), ref)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert stages[0].get_submodule("pre") is sch["pre"].mod  # shared, not copied
    with pytest.raises(slapo.SchedulingError, match="num_stages=3"):
        generate_pipeline_partition(sch, 3)


def test_pipeline_partition_of_a_traced_module_list_model():
    torch.manual_seed(1)
    model = _ListModel()
    x = torch.randn(2, 10)
    ref = model(x)
    sch = slapo.create_schedule(model)
    sch["layers.0"].cut_pipeline_stage()
    sch["layers.1"].cut_pipeline_stage()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Slapo2023Notice)
        sch.trace_until([], tracer="pytorch")
    stages = generate_pipeline_partition(sch)
    assert len(stages) == 3
    _close(run_stages(stages, x), ref)


def test_graph_partition_refuses_a_cut_it_cannot_see():
    class Block(nn.Sequential):  # its own forward: not the chain of its children
        def forward(self, x):
            return self[1](self[0](x)) + x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.post = Block(_Inner(), _Inner()), _Inner()

        def forward(self, x):
            return self.post(self.block(x))

    from slapo.compat.pipeline import graph_stages

    sch = slapo.create_schedule(Model())
    sch["block.0"].cut_pipeline_stage()
    sch.trace(leaves=["block"])
    with pytest.raises(slapo.SchedulingError, match="not traced"):
        generate_pipeline_partition(sch)
    sch2 = slapo.create_schedule(Model())
    sch2["block.0"].cut_pipeline_stage()
    with pytest.raises(slapo.SchedulingError, match="root traced"):
        graph_stages(sch2)


# ---------------------------------------------------------------------------------- replace
def test_replace_one_node_2023():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return F.relu(self.linear(x))

    def identity(x):
        return x

    sch = slapo.create_schedule(Model())
    nodes = sch.find_node(lambda n: n.op == "call_function" and n.target == F.relu)
    sch.replace(identity, nodes[0])  # 2023 passed find_node(...)[0]
    targets = [n.target for n in sch.mod.graph.nodes if n.op == "call_function"]
    assert identity in targets and F.relu not in targets


def test_megatron_target_refusal_names_the_replacement():
    with pytest.raises(slapo.SchedulingError, match="target=None"):
        slapo.build(slapo.create_schedule(_Two()), target="megatron")


# ---------------------------------------------------------------------------------- harness
def _harness():
    spec = importlib.util.spec_from_file_location("run_slapo2023_suite",
                                                  ROOT / "scripts" / "run_slapo2023_suite.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_harness_merges_rank_results():
    h = _harness()
    ok = {"outcome": "passed", "reason": ""}
    bad = {"outcome": "failed", "reason": "boom"}
    skip = {"outcome": "skipped", "reason": "Skipped: excluded: hub"}
    merged = h.merge([{"a": ok, "b": ok, "c": skip, "d": ok}, {"a": ok, "b": bad, "c": skip}], 2)
    assert merged["a"]["outcome"] == "passed" and merged["b"] == bad
    assert merged["c"]["outcome"] == "skipped"
    assert merged["d"]["outcome"] == "failed" and "crashed" in merged["d"]["reason"]
    assert h.merge([{"a": ok}], 2)["a"]["outcome"] == "failed"  # a rank wrote nothing


def test_harness_cpu_mapping():
    """In a fresh process (the mapping patches torch): 2023's CUDA calls run on CPU, meta init
    still works, NCCL becomes gloo."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
        "import run_slapo2023_suite as h\n"
        "h.install_cpu_mapping()\n"
        "assert not torch.cuda.is_available()\n"
        "torch.cuda.set_device(1); torch.cuda.synchronize()\n"
        "assert torch.randn(2, device='cuda').device.type == 'cpu'\n"
        "assert torch.zeros(2).cuda(1).device.type == 'cpu'\n"
        "assert torch.ones(2).to('cuda:0').device.type == 'cpu'\n"
        "m = torch.nn.Linear(2, 2).cuda()\n"
        "with torch.device('meta'):\n"
        "    assert torch.nn.Linear(2, 2).weight.is_meta\n"
        "torch.cuda.manual_seed(5); assert torch.cuda.initial_seed() == 5\n"
        "assert torch.equal(torch.cuda.get_rng_state(), torch.get_rng_state())\n"
        "import mock; assert mock.MagicMock\n"
        "import os; os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(h_port))\n"
        "dist.init_process_group('nccl', rank=0, world_size=1)\n"
        "assert dist.get_backend() == 'gloo'\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n")
    from dist_pool import _free_port

    code = code.replace("h_port", str(_free_port()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


MIRROR = Path(os.environ.get("SLAPO2023_REPO", "/work/.mirror/awslabs+slapo/repo"))


@pytest.mark.skipif(not (MIRROR / "HEAD").exists(),
                    reason="no local mirror of awslabs/slapo (the harness's input)")
def test_harness_runs_a_2023_file(tmp_path):
    """One file of the original suite through the harness, on 2 gloo ranks."""
    import json

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_slapo2023_suite.py"),
                          "--repo", str(MIRROR), "--scratch", str(tmp_path), "--files",
                          "test_annotate.py", "test_pipeline_partition.py"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "results-today.json").read_text())
    assert report["total"]["passed"] == 4 and report["total"]["failed"] == 0, report
