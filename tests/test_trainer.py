"""The trainer is an explicit object, and `slapo.build` leaves the user's module its class
(issue 30).

`build_trainer` returns the `Trainer` (what `slapo train`, tune trials and the progressive demo
hold); `slapo.build` returns the user's module with the trainer's methods as instance
attributes (`runtime/built_model.py`). Checked here: `type(model)` is the class the model had
before build (one process and DDP on 2 gloo ranks; FSDP2's torch class is checked in
test_build_returns_module.py), `copy.deepcopy` gives the plain model, `model(...)` under DDP
all-reduces in a hand-written loop and runs the module's hooks once, and `generate` works
after build (also through DDP).
"""

from __future__ import annotations

import copy
import inspect

import models
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from reference import LR, reference_losses
from test_generate_schedule import assert_generates_alike, prompts

import slapo
from slapo.runtime import Trainer, build_trainer

# everything build may put in a module's `__dict__`
ADDED = ("train_step", "eval_step", "local_batch", "optimizer", "runner", "step_config",
         "precision", "_slapo_built", "forward", "save_pretrained", "__deepcopy__")


def _added(model: nn.Module) -> list[str]:
    return sorted(set(vars(model)) & set(ADDED))


def _batches() -> list[dict]:
    return [{"input_ids": x, "labels": x} for x in (models.ids(4, seed=3), models.ids(4, seed=4))]


def test_build_trainer_and_build_keep_the_users_class(one_thread):
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    cls = type(model)
    trainer = build_trainer(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                            optimizer_kwargs={"lr": LR})
    assert isinstance(trainer, Trainer) and trainer.model is model and trainer.parts == [model]
    assert type(model) is cls and isinstance(model, slapo.TrainModule)
    assert _added(model) == sorted(set(ADDED) - {"forward"})  # no DDP: its own forward
    assert model.train_step.__self__ is trainer and model.optimizer is trainer.optimizer
    assert model.runner is trainer.runner and model.precision is trainer.precision
    # the trainer's step and the attached one are one step on one optimizer
    batches = _batches()
    got = [trainer.train_step(batches[0]), model.train_step(batches[1])]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-6, atol=0)
    # `slapo.build` returns the same shape
    other = models.gpt2(seed=1)
    tm, opt = slapo.build(slapo.create_schedule(other), optimizer=torch.optim.SGD)
    assert tm is other and type(tm) is cls and isinstance(tm.train_step.__self__, Trainer)
    assert tm.optimizer is opt


def test_train_step_records_the_gradient_norm_before_clipping(one_thread):
    """`Trainer.last_grad_norm`: the whole gradient's 2-norm before clipping (what the step
    clipped by), equal to a reference backward's; None without `grad_clip` (not computed)."""
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    batch = _batches()[0]
    ref(**batch).loss.backward()
    want = torch.stack([p.grad.norm() for p in ref.parameters()]).norm()
    trainer = build_trainer(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                            grad_clip=1e-3)
    assert trainer.last_grad_norm is None
    trainer.train_step(batch)
    torch.testing.assert_close(trainer.last_grad_norm, want, rtol=1e-5, atol=0)
    assert trainer.last_grad_norm > 1e-3  # it was clipped: the norm is the one before
    plain = build_trainer(slapo.create_schedule(models.gpt2(seed=0)),
                          optimizer=torch.optim.AdamW)
    plain.train_step(batch)
    assert plain.last_grad_norm is None


def test_deepcopy_is_the_plain_model(one_thread):
    model = models.gpt2(seed=0)
    cls = type(model)
    slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW)
    added = _added(model)
    twin = copy.deepcopy(model)
    assert type(twin) is cls and _added(twin) == [] and not hasattr(twin, "train_step")
    assert not isinstance(twin, slapo.TrainModule)
    assert _added(model) == added  # the original keeps its trainer
    ids = models.ids(2)
    torch.testing.assert_close(twin(ids).logits, model(ids).logits, rtol=0, atol=0)
    # nested in another object, the model is copied plain too (memo shared)
    box = copy.deepcopy({"m": model, "again": model})
    assert box["m"] is box["again"] and _added(box["m"]) == []


def test_generate_after_build(one_thread):
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW)
    assert_generates_alike(model, ref, prompts("gpt2"), "after slapo.build")


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


def job_ddp_keeps_the_class():
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2)
    rank = dist.get_rank()
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    cls = type(model)
    calls = []
    model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    tm, opt = slapo.build(slapo.create_schedule(model, mesh=mesh), data_parallel="ddp",
                          optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    assert tm is model and type(tm) is cls and "forward" in vars(tm)
    assert isinstance(tm.runner.module, torch.nn.parallel.DistributedDataParallel)
    assert inspect.signature(tm.forward) == inspect.signature(ref.forward)
    # a hand-written (2023) loop: each rank feeds its half of the batch through `model(...)`,
    # `backward()` all-reduces, `optimizer.step()` takes the whole batch's step
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        ids = models.ids(batch=4, seed=9 + step)
        half = ids[rank * 2:(rank + 1) * 2]
        calls.clear()
        tm(half, labels=half).loss.backward()
        assert len(calls) == 1, "the module's hooks ran more than once"
        opt.step()
        opt.zero_grad()
        ref(ids, labels=ids).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for (n, p), q in zip(tm.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=f"step {step}: {n}")
    # the trainer's step on the same module: the same loss on both ranks
    loss = tm.train_step(_batches()[0])
    # generate through DDP (every rank), and a plain copy without DDP or the trainer
    assert_generates_alike(tm, copy.deepcopy(tm), prompts("gpt2"), "ddp")
    twin = copy.deepcopy(tm)
    assert type(twin) is cls and _added(twin) == []
    # a user's own instance forward is what DDP runs, and comes back on the copy
    net = _Net()
    own = net.forward
    net.forward = lambda x: 2 * own(x)
    built, _ = slapo.build(slapo.create_schedule(net, mesh=mesh), data_parallel="ddp",
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    x = torch.ones(1, 4)
    torch.testing.assert_close(built(x), 2 * net.fc(x))
    plain = copy.deepcopy(built)
    torch.testing.assert_close(plain(x), 2 * net.fc(x))
    assert "forward" in vars(plain) and "train_step" not in vars(plain)
    return loss


@pytest.mark.dist
def test_ddp_keeps_the_class_and_model_call_all_reduces(dist2):
    res = dist2.run(job_ddp_keeps_the_class, timeout=600)
    assert res[0] == res[1]
