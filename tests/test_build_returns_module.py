"""`slapo.build` returns the user's own module (issue 13), and takes the 2023 `build` spellings.

Without a pipeline the built model is the very object the schedule was made from, of the very
class it had (issue 30: no class swap), the same parameter names and state-dict keys as the
unbuilt model, its attributes direct (no `model.` prefix), plus the trainer's `train_step`. Its steps must equal a hand-written
single-process loop, on one process and on 2 gloo ranks (DDP, FSDP2, TP). With a pipeline a
`PipelineTrainModule` of this rank's stages is returned (documented in `build`).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import warnings

import models
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from reference import LR, make_batches, reference_losses

import slapo
from slapo.module_patch import original_class
from slapo.notices import Slapo2023Notice, reset_notices
from slapo.runtime.built_model import PipelineTrainModule, TrainModule


def _names(model: nn.Module) -> tuple[list[str], list[str]]:
    return [n for n, _ in model.named_parameters()], list(model.state_dict())


def _step_batches(n: int = 3) -> list[dict]:
    ids = models.ids(batch=4, seed=3)
    other = models.ids(batch=4, seed=4)
    return [{"input_ids": x, "labels": x} for x in (ids, other, ids)][:n]


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------

def test_build_returns_the_users_module(one_thread):
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    user_cls, transformer = type(model), model.transformer
    tm, opt = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": LR}, grad_clip=0.5)
    assert tm is model and isinstance(tm, TrainModule)
    assert type(tm) is user_cls  # repr, HF's save_pretrained architectures, `type(m) is Cls`
    assert _names(tm) == _names(ref)                 # no `model.` prefix anywhere
    assert tm.transformer is transformer and tm.optimizer is opt
    assert not any(isinstance(m, TrainModule) for m in tm.modules() if m is not tm)
    ids = models.ids(batch=2)
    torch.testing.assert_close(tm(ids).logits, ref(ids).logits, rtol=0, atol=0)
    batches = _step_batches()
    got = [tm.train_step(b) for b in batches]
    want = reference_losses(ref, batches, grad_clip=0.5)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)
    for (n, p), q in zip(tm.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    # a checkpoint of the built model loads into the bare model class, and back
    fresh = models.gpt2(seed=1)
    fresh.load_state_dict(tm.state_dict())
    torch.testing.assert_close(fresh(ids).logits, tm(ids).logits, rtol=0, atol=0)


def test_a_plain_module_and_gradients(one_thread):
    """Not only HF models: a user's nn.Module; gradients of `model(x)` equal the unbuilt one's."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": 0.1}, loss_fn=lambda out, b: out.pow(2).mean())
    assert isinstance(tm, Net) and _names(tm) == _names(ref)
    x = torch.randn(6, 8)
    tm(x).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    for (n, p), q in zip(tm.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=n)
    tm.zero_grad()
    loss = tm.train_step((x,))
    assert loss == pytest.approx(float(ref(x).pow(2).mean().detach()), rel=1e-6)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for (n, p), q in zip(tm.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_copy_rebuild_and_name_clash(one_thread):
    model = models.gpt2(seed=0)
    sch = slapo.create_schedule(model)
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW)
    cls = type(tm)
    twin = copy.deepcopy(tm)  # the plain module: the training state is not copyable
    assert type(twin) is type(models.gpt2()) and not isinstance(twin, TrainModule)
    assert _names(twin) == _names(tm) and isinstance(tm, TrainModule)  # the original intact
    tm2, opt2 = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    assert tm2 is model and type(tm2) is cls and tm2.optimizer is opt2

    class Clash(nn.Module):  # a model that already has a name build adds
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.optimizer = "mine"

        def forward(self, x):
            return self.fc(x)

    clash = Clash()
    with pytest.raises(slapo.SchedulingError, match="'optimizer'.*rename"):
        slapo.build(slapo.create_schedule(clash))
    assert type(clash) is Clash and clash.optimizer == "mine"  # nothing changed


# ------------------------------------------------------------------------------------------------
# the 2023 spellings
# ------------------------------------------------------------------------------------------------

def test_2023_init_weights_spellings(one_thread):
    def meta_gpt2():
        with slapo.init_empty_weights():
            return models.gpt2(seed=0)

    # True: the default init of delayed-init weights, same values as init_weights=None
    a, _ = slapo.build(slapo.create_schedule(meta_gpt2()), init_weights=True, seed=5)
    b, _ = slapo.build(slapo.create_schedule(meta_gpt2()), seed=5)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert p.device.type == "cpu"
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    # False on meta weights: an error, before anything changed
    meta = meta_gpt2()
    with pytest.raises(slapo.SchedulingError, match="init_weights=False.*meta"):
        slapo.build(slapo.create_schedule(meta), init_weights=False)
    assert not isinstance(meta, TrainModule)
    assert all(p.device.type == "meta" for p in meta.parameters())
    # materialised weights are kept by False and by True (True says so once: 2023 re-inited)
    loaded = models.gpt2(seed=7)
    before = copy.deepcopy(loaded.state_dict())
    slapo.build(slapo.create_schedule(loaded), init_weights=False)
    reset_notices()
    with pytest.warns(Slapo2023Notice, match="re-initialised"):
        slapo.build(slapo.create_schedule(loaded), init_weights=True)
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, msg=k)


def test_2023_target_config_topology_errors(tmp_path):
    sch = slapo.create_schedule(models.gpt2())
    cases = [
        ({"target": "megatron"}, "only parsed Megatron-LM logs"),
        ({"target": "pytorch"}, "not a Slapo target"),
        ({"config": {"zero_optimization": {"stage": 1}}}, "target is not 'deepspeed'"),
        ({"target": "deepspeed", "config": str(tmp_path / "missing.json")}, "cannot read"),
        ({"target": "deepspeed", "config": {}, "deepspeed_config": {}}, "both config="),
        ({"target": "deepspeed", "config": 3}, "dict or a JSON file path"),
        ({"topology": {"model": 2}}, r"model=2 \(here 1\).*init_mesh\(dp=1, pp=1, tp=2\)"),
        ({"topology": object()}, "PipeModelDataParallelTopology"),
        ({"init_weight": True}, r"unknown argument\(s\) \['init_weight'\]"),
    ]
    for kwargs, message in cases:
        with pytest.raises(slapo.SchedulingError, match=message):
            slapo.build(sch, **kwargs)
    assert not isinstance(sch.mod, TrainModule)  # every error came before any change


def test_2023_topology_matching_the_schedule_is_accepted(one_thread):
    class Topology:  # DeepSpeed's PipeModelDataParallelTopology interface
        def get_dim(self, axis):
            return {"pipe": 1, "data": 1, "model": 1}.get(axis)

    model = models.gpt2(seed=0)
    reset_notices()
    with pytest.warns(Slapo2023Notice, match="checked against the schedule's mesh"):
        tm, _ = slapo.build(slapo.create_schedule(model), topology=Topology(),
                            optimizer=torch.optim.AdamW)
    assert tm is model


def test_2023_adapter_maps_a_deepspeed_config_file(tmp_path):
    from slapo.compat.build import adapt_build_args

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    sch = slapo.create_schedule(models.gpt2())
    out = adapt_build_args(sch, {"target": "DeepSpeed", "config": str(path),
                                 "init_weights": False, "loss_fn": None})
    assert out == {"target": "deepspeed", "deepspeed_config": {"zero_optimization": {"stage": 2}},
                   "init_weights": None, "loss_fn": None}


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_2023_deepspeed_build_trains(deepspeed_one_rank, tmp_path, one_thread):
    """`build(sch, target="deepspeed", config=<json path>, topology=..., init_weights=fn)` as
    2023's GPT-2 script wrote it: trains like the single-process reference."""
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    batches = _step_batches(2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Slapo2023Notice)
        tm, _ = slapo.build(slapo.create_schedule(model), target="deepspeed",
                            config=str(path), topology={"pipe": 1, "data": 1, "model": 1},
                            init_weights=model._init_weights, optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": LR})
    got = [tm.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-4, atol=0)


# ------------------------------------------------------------------------------------------------
# 2 gloo ranks: DDP, FSDP2, TP, and the pipeline wrapper
# ------------------------------------------------------------------------------------------------

def _check_module_case(name, tm, model, user_cls, ref_names, ref, batches) -> list[float]:
    from torch.distributed.fsdp import FSDPModule

    assert tm is model and isinstance(tm, user_cls) and isinstance(tm, TrainModule), name
    # no class of build's own: the user's, FSDP2's (torch's), or under TP the shape-error
    # wrapper's patch class (`module_patch`, on the parent of sharded modules)
    cls = type(tm).__bases__[1] if isinstance(tm, FSDPModule) else type(tm)
    assert cls is user_cls or (name == "tp" and original_class(tm) is user_cls), name
    assert _names(tm) == ref_names, name
    losses = [tm.train_step(b) for b in batches]
    ref_losses = reference_losses(ref, batches, grad_clip=0.5)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                               atol=0, msg=lambda m: f"{name}: {m}")
    return losses


def _ddp_forward_all_reduces(mesh) -> None:
    """`model(...)` under DDP is DDP's forward: each rank feeds its own half of a batch, and
    after `backward()` every rank holds the gradient of the whole batch's mean loss."""
    rank = dist.get_rank()
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    tm, _ = slapo.build(slapo.create_schedule(model, mesh=mesh), data_parallel="ddp",
                        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    ids = models.ids(batch=4, seed=9)
    tm(ids[rank * 2:(rank + 1) * 2], labels=ids[rank * 2:(rank + 1) * 2]).loss.backward()
    ref(ids, labels=ids).loss.backward()
    for (n, p), q in zip(tm.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=n)


def job_dp_and_tp():
    import tp_schedules

    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2)
    batches = make_batches()[:3]
    out = {}
    for name, kw in {"ddp": {"data_parallel": "ddp"}, "fsdp": {"data_parallel": "fsdp"}}.items():
        model = models.gpt2(seed=0)
        ref = copy.deepcopy(model)
        user_cls, ref_names = type(model), _names(ref)
        tm, _ = slapo.build(slapo.create_schedule(model, mesh=mesh), optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": LR}, grad_clip=0.5, **kw)
        out[name] = _check_module_case(name, tm, model, user_cls, ref_names, ref, batches)
        if name == "fsdp":  # FSDP2's own class swap (torch's), nothing of Slapo's
            from torch.distributed.fsdp import FSDPModule

            assert type(tm).__bases__ == (FSDPModule, user_cls)  # torch's class, on the user's
    _ddp_forward_all_reduces(mesh)
    # TP=2 over both ranks (no mesh, the 2023 way: the schedule's group), 2023 topology
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    user_cls, ref_names = type(model), _names(ref)
    sch = slapo.create_schedule(model, group=dist.group.WORLD)
    tp_schedules.gpt2_tp(sch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Slapo2023Notice)
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                            grad_clip=0.5, topology={"pipe": 1, "data": 1, "model": 2})
    out["tp"] = _check_module_case("tp", tm, model, user_cls, ref_names, ref, batches)
    return out


def job_pipeline_wrapper():
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(pp=2)
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    sch["transformer.h.0"].cut_pipeline_stage()
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        pipeline="GPipe", num_microbatches=2)
    assert isinstance(tm, PipelineTrainModule) and isinstance(tm, TrainModule)
    assert not isinstance(tm, type(ref)) and not isinstance(model, TrainModule)
    with pytest.raises(slapo.SchedulingError, match="split into pipeline stages"):
        tm(models.ids(batch=2))
    with pytest.raises(slapo.SchedulingError, match="slapo export"):  # never a partial model
        tm.save_pretrained("never-written")
    keys = [None, None]
    dist.all_gather_object(keys, list(tm.state_dict()))
    assert set(keys[0]) | set(keys[1]) == set(ref.state_dict()) and keys[0] != keys[1]
    batches = make_batches()[:2]
    losses = [tm.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-5, atol=0)
    return losses


@pytest.mark.dist
def test_two_ranks_ddp_fsdp_tp_return_the_module(dist2):
    res = dist2.run(job_dp_and_tp, timeout=600)
    assert res[0] == res[1]
    for name in ("ddp", "fsdp", "tp"):
        assert res[0][name][-1] < res[0][name][0], name


@pytest.mark.dist
def test_two_ranks_pipeline_keeps_a_wrapper(dist2):
    res = dist2.run(job_pipeline_wrapper, timeout=600)
    assert res[0] == res[1]
