"""The placement (`slapo.runtime.mesh.ParallelDims`): one object with every degree, the device
and the pipeline-schedule facts, and one validation per degree on the path from `slapo train
--tp / --pp-stages` to their effect (docs/architecture.md, "How a degree travels").

The path tests fail when a second check of a degree is added back: each bad value must be
refused by the one validator of its property (`check_degree` for the value, `for_world` for the
job's size, the family plan's `check_tp_heads` / apply's `_check_pipeline` for the model), which
the tests find in the traceback or replace with a spy.
"""

from __future__ import annotations

import ast
import traceback
from pathlib import Path

import pytest
import torch

import slapo
from slapo.cli import parse_train_args
from slapo.errors import SchedulingError
from slapo.runtime import mesh as mesh_mod
from slapo.runtime.mesh import ParallelDims
from slapo.train import setup as setup_mod

ROOT = Path(slapo.__file__).parent
TINY = ["--model", "gpt2", "--hidden-size", "32", "--num-layers", "2", "--num-heads", "4"]


def _raised_in(exc: BaseException) -> str:
    """The function whose `raise` produced `exc` (the innermost frame of its traceback)."""
    return traceback.extract_tb(exc.__traceback__)[-1].name


# ---- the object ------------------------------------------------------------------------------
def test_fields_and_the_derived_data_parallel_degree():
    dims = ParallelDims.for_world(8, tp=2, pp=2, dp_shard=True)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp, dims.pp, dims.ep) == \
        (1, 2, 1, 2, 2, 1)
    assert dims.dp == 2 and dims.world == 8 and dims.data_parallel == "fsdp"
    assert dims.mesh_dims == ("dp", "pp", "tp") and dims.shape == (2, 2, 2)
    ddp = ParallelDims.for_world(4, tp=2)
    assert (ddp.dp_replicate, ddp.dp_shard, ddp.data_parallel) == (2, 1, "ddp")
    assert ParallelDims.for_world(2, tp=2).data_parallel is None
    assert ParallelDims(pp=2).stages("Interleaved1F1B") == 4
    assert ParallelDims(pp=2).stages("1F1B") == 2 and ParallelDims().stages(None) == 1


def test_cp_is_a_degree_checked_once():
    """(cp > 1 is built: tests/test_context_parallel.py checks its placements and runs; ep's
    are in tests/test_moe.py.)"""
    assert ParallelDims().cp == 1 and ParallelDims(cp=2).world == 2
    with pytest.raises(SchedulingError, match="must be a positive int"):
        ParallelDims(cp=0)
    assert ParallelDims(cp=2, tp=2).world == 4  # cp composes with tp and pp
    assert ParallelDims(cp=2, pp=2).mesh_dims == ("dp", "pp", "cp", "tp")
    assert ParallelDims(cp=2, dp_replicate=2, ep=2).world == 4  # and with ep (from dp)


def test_hybrid_data_parallelism_is_refused():
    with pytest.raises(SchedulingError, match="HSDP"):
        ParallelDims(dp_replicate=2, dp_shard=2)


def test_the_device_is_decided_by_one_function(monkeypatch):
    assert mesh_mod.local_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ParallelDims().local_device() == torch.device("cpu")  # "auto" without a GPU
    with pytest.raises(SchedulingError, match="unknown device 'tpu'"):
        ParallelDims(device="tpu")
    with pytest.raises(SchedulingError, match="the placement's device is 'cuda'"):
        mesh_mod.init_mesh(dims=ParallelDims(device="cuda"), device="cpu")  # nothing started


def _sites(found, allowed: set[str]) -> list[str]:
    """`file:line` of every node under slapo/ (but in `allowed` files) that `found` accepts."""
    out = []
    for path in ROOT.rglob("*.py"):
        rel = str(path.relative_to(ROOT))
        if rel not in allowed:
            out += [f"{rel}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
                    if found(n)]
    return out


def _calls(attr: str):
    return lambda n: isinstance(n, ast.Call) and getattr(n.func, "attr", None) == attr


def _reads_env(var: str):
    """`os.environ.get(var, ...)` or `os.environ[var]`."""
    def found(n):
        if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "get" and n.args:
            return getattr(n.args[0], "value", None) == var
        return isinstance(n, ast.Subscript) and getattr(n.slice, "value", None) == var
    return found


def test_device_and_world_size_are_read_in_one_place():
    """`torch.cuda.current_device()` (the device) and the WORLD_SIZE environment variable (the
    job's size) are read only by `runtime/mesh.py` (`local_device`, `job_world_size`); the
    launcher hint of `cli.py` echoes torchrun's own variables back to the user."""
    assert _sites(_calls("current_device"), {"runtime/mesh.py"}) == []
    assert _sites(_reads_env("WORLD_SIZE"), {"runtime/mesh.py", "cli.py"}) == []


def test_schedule_names_and_devices_are_declared_once():
    from slapo.runtime import pipeline_runner
    from slapo.train import config

    assert config.PP_SCHEDULES is mesh_mod.PP_SCHEDULES
    assert config.MULTI_STAGE is mesh_mod.MULTI_STAGE and config.DEVICES is mesh_mod.DEVICES
    assert pipeline_runner.V_SCHEDULES is mesh_mod.V_SCHEDULES
    for path in ROOT.rglob("*.py"):  # no second tuple of the names anywhere
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Tuple) and {getattr(e, "value", None) for e in node.elts} \
                    >= {"GPipe", "1F1B"}:
                assert path.name == "mesh.py", f"{path}:{node.lineno} declares schedule names"


# ---- the path: one validation per degree -----------------------------------------------------
class _Refused(Exception):
    pass


def _spy(monkeypatch, refuse=None) -> list:
    """Replace the one value check of a degree by one that refuses only the object `refuse`
    (None: accepts everything); record its calls."""
    calls: list = []

    def spy(name, value):
        calls.append((name, value))
        if refuse is not None and value is refuse:
            raise _Refused(name)
        return value

    monkeypatch.setattr(mesh_mod, "check_degree", spy)
    return calls


@pytest.mark.parametrize("field, flag", [("tp", "--tp"), ("pp_stages", "--pp-stages")])
@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_a_bad_degree_value_is_refused_by_the_one_check(field, flag, bad, monkeypatch):
    """Every bad value, given to `slapo train` (the config's checks, then the placement),
    is refused by `check_degree`; with the check replaced by one that accepts everything,
    nothing else on the way refuses it (a second check would)."""
    from slapo.train.config import TrainConfig

    cfg = TrainConfig(**{field: bad})
    with pytest.raises(ValueError, match=f"{flag}: {field} must be a positive int"):
        cfg.check()
    _spy(monkeypatch, refuse=bad)
    with pytest.raises(_Refused):
        cfg.check()
    with pytest.raises(_Refused):
        setup_mod.placement(cfg, 1)
    monkeypatch.undo()
    calls = _spy(monkeypatch)
    cfg.check()  # nothing else on the way checks the degree's value
    assert (field, bad) in calls


def test_a_degree_that_does_not_divide_the_job_is_refused_by_for_world_alone():
    for argv in (["--tp", "2"], ["--pp-stages", "2"], ["--tp", "2", "--pp-stages", "2"]):
        cfg = parse_train_args([*TINY, *argv])
        cfg.check()  # the job's size is the placement's to check
        with pytest.raises(SchedulingError, match="torchrun --nproc-per-node") as e:
            setup_mod.placement(cfg, 3)
        assert _raised_in(e.value) == "for_world"


def _tp_schedule(model, tp: int):
    """The schedule `slapo train` makes on a mesh whose "tp" dimension has `tp` ranks, played
    by one process (`VirtualGroup`)."""
    from slapo.distributed.group import VirtualGroup

    return slapo.create_schedule(model, group=VirtualGroup(tp, 0))


def test_tp_against_the_heads_is_checked_once_by_the_family_plan(monkeypatch):
    """--tp 2 with 3 heads: the config lets it through, `apply` (with the knobs `slapo train`
    passes: none of them the degree) refuses it from the family plan's heads check, before any
    change; on a model that divides, the check runs once and nowhere else."""
    from slapo import model_schedule
    from slapo.model_schedule import plan
    from slapo.train.models import build_model

    cfg = parse_train_args(["--model", "gpt2", "--tp", "2", "--num-heads", "3",
                            "--hidden-size", "96", "--num-layers", "2"])
    cfg.check()
    assert "tp" not in cfg.knobs()
    model = build_model(cfg.model, cfg.size())[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SchedulingError, match=r"heads=3 is not divisible by 2") as e:
        model_schedule.apply(_tp_schedule(model, 2), **cfg.knobs())
    assert _raised_in(e.value) == "check_tp_heads"
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())

    calls = []
    real = plan.check_tp_heads
    monkeypatch.setattr(plan, "check_tp_heads",
                        lambda sch, tp: calls.append(sch.path) or real(sch, tp))
    good = build_model("gpt2", parse_train_args(TINY).size())[0]
    model_schedule.apply(_tp_schedule(good, 2))
    assert len(calls) == 1, calls  # `TPPlan.validate`, once per apply; no second check


def test_pp_stages_reach_apply_from_the_placement_once():
    """--pp-stages: the config passes no stage count to `apply`; `assemble.schedule` cuts the
    placement's stages (pp x stages per rank), and a model with fewer layers is refused by
    apply's one pipeline check."""
    from slapo.train.assemble import schedule
    from slapo.train.models import build_model
    from slapo.train.setup import Env

    cfg = parse_train_args([*TINY, "--num-layers", "4", "--pp-stages", "2",
                            "--pp-schedule", "Interleaved1F1B"])
    cfg.check()
    assert "pp_stages" not in cfg.knobs()
    env = Env(world=2, dims=ParallelDims(pp=2))
    _, sch, _ = schedule(build_model(cfg.model, cfg.size())[0], cfg, env)
    assert len(sch.pipeline_cuts) == 3  # 2 ranks x 2 stages each

    cfg = parse_train_args([*TINY, "--pp-stages", "3"])
    cfg.check()  # 2 layers, 3 stages: the model's to refuse
    with pytest.raises(SchedulingError, match="2 layers cannot make 3 stages") as e:
        schedule(build_model(cfg.model, cfg.size())[0], cfg, Env(world=3,
                                                                 dims=ParallelDims(pp=3)))
    assert _raised_in(e.value) == "_check_pipeline"


def test_tp_alone_reaches_apply_through_the_mesh_not_a_knob(monkeypatch):
    """`--tp 2` with no other knob still schedules the model (apply shards over the mesh's
    "tp" group), and apply gets no copy of the degree."""
    from slapo import model_schedule
    from slapo.train.assemble import schedule
    from slapo.train.models import build_model
    from slapo.train.setup import Env

    calls = []

    def spy(model, **kwargs):
        calls.append(kwargs)
        return slapo.create_schedule(model)

    monkeypatch.setattr(model_schedule, "apply", spy)
    cfg = parse_train_args([*TINY, "--tp", "2"])
    _, _, note = schedule(build_model(cfg.model, cfg.size())[0], cfg,
                          Env(world=2, dims=ParallelDims(tp=2)))
    assert calls == [{}] and note == "applied: tp=2"
    cfg = parse_train_args(TINY)
    _, _, note = schedule(build_model(cfg.model, cfg.size())[0], cfg, Env())
    assert len(calls) == 1 and note.startswith("none")


def job_meshes_are_made_once() -> list:
    """Two `slapo train` runs of one layout in one process build their mesh once: DeviceMesh
    makes new process groups at every call and gloo never frees their threads (the test pool
    leaked 6 per run and restarted every ~50 runs). Another layout gets its own mesh."""
    import os

    from slapo.runtime.mesh import init_mesh

    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    a = init_mesh(dims=ParallelDims(tp=2))
    before = threads()
    b = init_mesh(dims=ParallelDims(tp=2))
    after = threads()
    c = init_mesh(dims=ParallelDims(dp_replicate=2))
    return [a is b, after == before, c is not a, c.mesh_dim_names == a.mesh_dim_names]


@pytest.mark.dist
def test_a_layout_s_mesh_is_made_once_per_process(dist2):
    assert dist2.run(job_meshes_are_made_once) == [[True, True, True, True]] * 2
