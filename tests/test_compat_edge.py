"""Slapo 2023 spellings are translated at the edge only (docs/architecture.md, "The edge"): the
public names (`slapo.build`, the typed `Schedule` methods, `slapo.register_primitive`,
`sch.world_size`) take them; the core functions and primitive classes behind them know only
today's arguments and refuse the 2023 ones."""

from __future__ import annotations

import pytest
import torch.nn as nn
from models import gpt2

import slapo
from slapo.compat import spellings
from slapo.primitives import Primitive
from slapo.primitives.base import get_primitive, method_adapter
from slapo.runtime.build import build as core_build
from slapo.runtime.built_model import TrainModule


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_core_build_refuses_the_2023_spellings():
    sch = slapo.create_schedule(gpt2())
    for kwargs in ({"config": {}}, {"topology": {"model": 1}}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            core_build(sch, **kwargs)
    with pytest.raises(slapo.SchedulingError, match="init_weights must be a function"):
        core_build(sch, init_weights=True)
    with pytest.raises(TypeError, match="mixed_precision"):  # the earlier name of precision=
        core_build(sch, mixed_precision="bf16")
    with pytest.raises(slapo.SchedulingError, match="both given"):
        slapo.build(sch, mixed_precision="bf16", precision="fp16")
    with pytest.raises(slapo.SchedulingError, match="not supported"):
        core_build(sch, target="DeepSpeed")  # 2023's any-case target names: the edge's
    assert not isinstance(sch.mod, TrainModule)
    assert slapo.build is not core_build and slapo.build.__wrapped__ is core_build


def test_primitive_classes_know_only_todays_arguments():
    """The 2023 keywords reach `trace`/`fuse`/`shard` through the typed method (run_given ->
    the registered adapter), never through the primitive class itself."""
    sch = slapo.create_schedule(MLP())
    trace = get_primitive("trace")
    with pytest.raises(slapo.SchedulingError, match="unknown tracer 'pytorch'"):
        trace.run(sch, tracer="pytorch")
    with pytest.raises(TypeError, match="leaf_modules"):
        trace.run(sch, leaf_modules=["act"])
    get_primitive("shard").run(sch["fc1"], "weight", axis=0)
    assert not hasattr(sch.mod.fc1.weight, "orig_shape")  # the 2023 tag is the edge's
    sch["fc2"].shard("weight", axis=1)
    assert sch.mod.fc2.weight.orig_shape == (4, 8)
    for name in ("trace", "fuse", "shard"):
        assert method_adapter(name) is spellings.SPELLINGS[name]


def test_2023_attribute_names_come_from_the_edge():
    from slapo.schedule import Schedule

    assert "world_size" not in vars(Schedule) and "rank" not in vars(Schedule)
    sch = slapo.create_schedule(MLP())
    assert (sch.world_size, sch.rank) == (sch.tp_size, sch.tp_rank) == (1, 0)
    assert sch["fc1"].get_top_schedule() is sch
    with pytest.raises(AttributeError, match="not a schedule primitive or attribute"):
        sch.no_such_name  # noqa: B018


def test_core_registration_refuses_a_2023_primitive_class_the_edge_takes():
    from slapo.primitives.base import _REGISTRY, register_primitive

    def make():
        class Named(Primitive):
            @staticmethod
            def name():
                return "named_2023_edge_test"

            @staticmethod
            def apply(sch):
                return sch.path

        return Named

    with pytest.raises(ValueError, match="non-empty string"):
        register_primitive(make())
    try:
        slapo.register_primitive()(make())
        assert slapo.create_schedule(MLP())["fc1"].named_2023_edge_test() == "fc1"
    finally:
        _REGISTRY.pop("named_2023_edge_test", None)


def test_init_empty_weights_2023_signature_is_the_edges():
    from slapo.init import init_empty_weights as core_init_empty_weights

    with pytest.raises(TypeError):
        core_init_empty_weights(enable=False)
    with slapo.init_empty_weights(enable=False, include_buffers=True):
        assert MLP().fc1.weight.device.type == "cpu"  # 2023's delay_init=False: a no-op
    with slapo.init_empty_weights():
        assert MLP().fc1.weight.device.type == "meta"
