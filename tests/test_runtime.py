"""The runtime's single-process contract and its argument errors (one process and 2 gloo ranks).

`build` keeps its old behaviour (returns (model, optimizer), `model(...)` runs the model) and adds
`model.train_step(batch)`, whose result must equal a hand-written training loop.
"""

from __future__ import annotations

import copy
import importlib.util

import models
import pytest
import torch
import torch.distributed as dist
from reference import LR, reference_losses

import slapo
from slapo.runtime import TrainModule, init_mesh


def test_build_keeps_the_model_contract_and_trains():
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    tm, opt = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": LR}, grad_accum=2, grad_clip=0.1)
    assert isinstance(tm, TrainModule) and isinstance(opt, torch.optim.AdamW)
    assert tm is model                                       # the model itself, no copy
    assert tm.config is model.config
    assert len(list(tm.parameters())) == len(list(model.parameters()))
    ids = models.ids(batch=4)
    torch.testing.assert_close(tm(ids).logits, model(ids).logits)  # model(...) still works
    batches = [{"input_ids": ids, "labels": ids}] * 4
    losses = [tm.train_step(b) for b in batches]
    expected = reference_losses(ref, batches, grad_accum=2, grad_clip=0.1)
    assert all(isinstance(v, float) for v in losses)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
    # checkpoints use the model's own keys, both ways
    assert list(tm.state_dict()) == list(model.state_dict())
    fresh = models.gpt2(seed=1)
    tm.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(model.lm_head.weight, fresh.lm_head.weight, rtol=0, atol=0)


def test_tuple_batches_and_custom_loss():
    model = models.llama(seed=0)
    ref = copy.deepcopy(model)

    def loss_fn(outputs, batch):
        return outputs.logits.float().pow(2).mean()

    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, loss_fn=loss_fn)
    ids = models.ids(batch=2)
    got = [tm.train_step((ids,)) for _ in range(3)]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    want = []
    for _ in range(3):
        opt.zero_grad()
        loss = loss_fn(ref(ids), (ids,))
        loss.backward()
        opt.step()
        want.append(loss.item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=0)


def test_step_errors_are_clear():
    tm, _ = slapo.build(slapo.create_schedule(models.gpt2()), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": 0.1}, grad_accum=4)
    ids = models.ids(batch=6)
    with pytest.raises(slapo.SchedulingError, match="6 samples cannot be split"):
        tm.train_step({"input_ids": ids, "labels": ids})
    with pytest.raises(slapo.SchedulingError, match="no `.loss`"):
        tm.train_step({"input_ids": models.ids(batch=4)})
    with pytest.raises(slapo.SchedulingError, match="different batch sizes"):
        tm.train_step({"input_ids": ids, "labels": ids[:2]})
    no_opt, none = slapo.build(slapo.create_schedule(models.gpt2()))
    assert none is None
    with pytest.raises(slapo.SchedulingError, match="needs an optimizer"):
        no_opt.train_step({"input_ids": ids, "labels": ids})
    sch = slapo.create_schedule(models.gpt2())
    for kw, needle in (({"grad_accum": 0}, "grad_accum"), ({"grad_clip": -1}, "grad_clip"),
                       ({"data_parallel": "zero"}, "data_parallel"),
                       ({"data_parallel": "ddp"}, "needs a device mesh"),
                       ({"pipeline": "1F1B"}, "pp >= 2"), ({"target": "megatron"}, "target")):
        with pytest.raises(slapo.SchedulingError, match=needle):
            slapo.build(sch, **kw)


def test_deepspeed_rejects_what_it_cannot_run():
    """Checked before importing deepspeed, so this holds with or without it."""
    sch = slapo.create_schedule(models.gpt2())
    with pytest.raises(slapo.SchedulingError, match="does not run Slapo pipelines"):
        slapo.build(sch, target="deepspeed", pipeline="1F1B")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_deepspeed_zero_trains_single_process(deepspeed_one_rank):
    """ZeRO-2 on one rank (DeepSpeed starts a 1-rank group from these variables)."""
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    ids = models.ids(batch=2)
    batches = [{"input_ids": ids, "labels": ids}] * 2
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, target="deepspeed",
                        deepspeed_config={"zero_optimization": {"stage": 2}})
    got = [tm.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-4, atol=0)


def test_init_mesh_argument_errors(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    with pytest.raises(slapo.SchedulingError, match="not launched by torchrun"):
        init_mesh(dp=2)
    with pytest.raises(slapo.SchedulingError, match="positive int"):
        init_mesh(dp=0)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    with pytest.raises(slapo.SchedulingError, match="needs 2 ranks, but the job has 4"):
        init_mesh(dp=2)
    assert not dist.is_initialized()  # nothing was started


def test_init_mesh_single_process(monkeypatch):
    """One process without torchrun: a 1-rank mesh (and process group) is created."""
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert not dist.is_initialized()
    try:
        mesh = init_mesh()
        assert mesh.mesh_dim_names == ("dp", "pp", "tp")
        assert tuple(mesh.shape) == (1, 1, 1)
        model = models.gpt2(seed=0)
        ref = copy.deepcopy(model)
        tm, _ = slapo.build(slapo.create_schedule(model, mesh=mesh), optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": LR}, data_parallel="fsdp")
        ids = models.ids(batch=2)
        batches = [{"input_ids": ids, "labels": ids}] * 2
        got = [tm.train_step(b) for b in batches]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(ref, batches)),
                                   rtol=1e-5, atol=0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# 2 ranks: errors must be raised on every rank, before any collective (no hang)
# ------------------------------------------------------------------------------------------------

def job_mesh_errors():
    import models

    import slapo
    import slapo.runtime

    msgs = []
    for kw in ({"dp": 4}, {"dp": 1}, {"dp": 2, "tp": 2}):
        try:
            slapo.runtime.init_mesh(**kw)
        except slapo.SchedulingError as e:
            msgs.append(str(e))
    assert len(msgs) == 3 and all("but the job has 2" in m for m in msgs), msgs
    mesh = slapo.runtime.init_mesh(dp=2)
    # a schedule sharded over the whole world (no mesh) cannot run on a dp=2 mesh
    sch = slapo.create_schedule(models.gpt2())
    try:
        slapo.build(sch, mesh=mesh, data_parallel="ddp")
    except slapo.SchedulingError as e:
        msgs.append(str(e))
    assert "tensor-parallel group has 2" in msgs[-1], msgs[-1]
    # micro-batch/dp split error on a dp=2 model: raised on both ranks
    tm, _ = slapo.build(slapo.create_schedule(models.gpt2(), mesh=mesh),
                        optimizer=torch.optim.AdamW, data_parallel="ddp", grad_accum=2)
    ids = models.ids(batch=6)
    try:
        tm.train_step({"input_ids": ids, "labels": ids})
    except slapo.SchedulingError as e:
        msgs.append(str(e))
    assert "data-parallel ranks=2 x grad_accum=2" in msgs[-1], msgs[-1]
    return msgs


def test_mesh_and_batch_errors_on_every_rank(dist2):
    res = dist2.run(job_mesh_errors)
    assert res[0] == res[1] and len(res[0]) == 5
