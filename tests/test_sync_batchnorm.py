"""`sync_batchnorm`: BatchNorm statistics over the data-parallel ranks, so DDP/FSDP2 on n ranks
computes what one process computes on the whole batch (outputs, input and parameter gradients,
running statistics), on CPU and gloo where torch's `nn.SyncBatchNorm` refuses to run."""

from __future__ import annotations

import copy

import pytest
import sweep
import torch
import torch.distributed as dist
import torch.nn as nn
import vision_models as vm
from test_wideresnet_training import (
    _assert_trained_alike,
    _batches,
    _close,
    _train,
    reference_steps,
)

import slapo
from slapo import model_schedule, sharding

pytestmark = pytest.mark.dist


def _net() -> nn.Module:
    """No bias before a BatchNorm (it cancels: its gradient is 0 in exact arithmetic, so a
    comparison would judge roundoff), as in real CNNs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 6, bias=False),
                         nn.BatchNorm1d(6, momentum=None))


def job_matches_the_whole_batch() -> dict:
    """Each rank runs its half of the batch through the synced net; the reference runs the
    whole batch through the original. Inputs far from zero mean (the two-pass variance)."""
    rank = dist.get_rank()
    net = _net()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 6, 6, generator=g) * 3 + 5
    w = torch.randn(8, 6, generator=g)  # a loss that weighs every output differently
    slapo.create_schedule(net).sync_batchnorm(group=dist.group.WORLD)
    for step in range(2):  # the running statistics accumulate over two steps
        mine = x.chunk(2)[rank].clone().requires_grad_()
        out = net(mine)
        (out * w.chunk(2)[rank]).sum().backward()
        whole = x.clone().requires_grad_()
        ref_out = ref(whole)
        (ref_out * w).sum().backward()
        _close(out, ref_out.chunk(2)[rank], f"step {step} output", rel=1e-5)
        _close(mine.grad, whole.grad.chunk(2)[rank], f"step {step} input grad", rel=1e-5)
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        summed = p.grad.clone()
        dist.all_reduce(summed)  # the whole batch's loss is the sum of the halves'
        _close(summed, q.grad, f"grad {name}", rel=1e-5)
    for (name, b), c in zip(net.named_buffers(), ref.buffers(), strict=True):
        _close(b, c, f"buffer {name}", rel=1e-6)
    net.eval(), ref.eval()
    _close(net(x.chunk(2)[rank]), ref(x).chunk(2)[rank], "eval output", rel=1e-6)
    for m in (net[1], ref[1]):  # no running statistics: batch statistics in eval mode too
        m.track_running_stats, m.running_mean, m.running_var = False, None, None
    _close(net(x.chunk(2)[rank]), ref(x).chunk(2)[rank], "eval, batch statistics", rel=1e-5)
    return [type(m).__name__ for m in net]  # classes kept


def test_synced_batchnorm_computes_the_whole_batch(dist2):
    classes = dist2.run(job_matches_the_whole_batch)[0]
    assert classes[1] == "BatchNorm2d" and classes[5] == "BatchNorm1d"


def job_wideresnet_data_parallel(kind: str, tp: int, compiled: bool = False):
    """WideResNet (half its blocks checkpointed) under DDP or FSDP2 with sync_batchnorm, and
    with channel TP inside (each TP rank's BatchNorms hold other channels: synced over dp
    only): 2 SGD steps equal one process on the whole batch, running statistics included.

    In float64: the test net's last stage normalises 8 values per channel (1 x 1 pixels), so
    its gradients amplify roundoff ~1000x (fp32: step 1 agreed to 2e-6, step 2 to 4e-3, step 3
    to 0.1, for the unsynced reference against itself with other summation orders too)."""
    dp = dist.get_world_size() // tp
    mesh = slapo.init_mesh(dp=dp, tp=tp)
    model = vm.tiny(seed=8).double()
    ref = copy.deepcopy(model)
    batches = [{k: v.double() if v.is_floating_point() else v for k, v in b.items()}
               for b in _batches(n=2, batch=8)]
    torch._dynamo.reset()
    sch = slapo.create_schedule(model, mesh=mesh)
    sch.sync_batchnorm()  # before compile_blocks: the kernel is traced into each block's graph
    model_schedule.apply(sch, ckpt_ratio=0.5, compile_blocks="aot_eager" if compiled else False)
    got = _train(sch, batches, data_parallel=kind)
    want = reference_steps(ref, batches, 1)  # the whole batch at once
    specs = {n: sharding.shard_spec(p) for n, p in got[0].named_parameters()}
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else sharding.gather_full(p, specs[n])
            for n, p in got[2][-1].items()}
    _assert_trained_alike((got[0], got[1], [full]), (want[0], want[1][-1:], None), kind)
    for name, b in got[0].named_buffers():
        _close(sharding.gather_full(b), want[2][0][name], f"{kind}: buffer {name}")
    return got[1]


# compiled blocks (one graph per distinct block: ~40-60 s on CI) under DDP and FSDP2 with
# SLAPO_SWEEP=all (tests/sweep.py); by default compiled WideResNet blocks with collectives
# inside run in test_wideresnet (channel TP) and synced BatchNorm uncompiled here
@pytest.mark.parametrize("kind, compiled", sweep.sample(
    [(k, c) for k in ("ddp", "fsdp") for c in (False, True)],
    [("ddp", False), ("fsdp", False)]))
def test_wideresnet_with_synced_batchnorm_trains_like_one_process(dist2, kind, compiled):
    losses = dist2.run(job_wideresnet_data_parallel, kind, 1, compiled)
    assert losses[0] == losses[1]


def test_wideresnet_channel_tp_inside_ddp_syncs_over_dp_only(dist4):
    losses = dist4.run(job_wideresnet_data_parallel, "ddp", 2)
    assert all(v == losses[0] for v in losses)


def job_refusals() -> list[str]:
    """Bad calls are refused before anything changes."""
    msgs = []
    net = _net()
    sch = slapo.create_schedule(net)
    for call in (lambda: sch.sync_batchnorm(),  # no mesh: the dp ranks are unknown
                 lambda: sch["0"].sync_batchnorm(group=dist.group.WORLD)):  # no BatchNorm
        with pytest.raises(slapo.SchedulingError) as e:
            call()
        msgs.append(str(e.value))
    assert not any(h for _, h in sch.applied())
    sch.sync_batchnorm(group=dist.group.WORLD)
    with pytest.raises(slapo.SchedulingError) as e:
        sch.sync_batchnorm(group=dist.group.WORLD)
    msgs.append(str(e.value))
    return msgs


def test_bad_calls_are_refused_naming_the_fix(dist2):
    no_mesh, no_bn, twice = dist2.run(job_refusals)[0]
    assert "no mesh" in no_mesh and "dist.group.WORLD" in no_mesh, no_mesh
    assert "no BatchNorm" in no_bn, no_bn
    assert "already runs the kernel 'sync_batchnorm'" in twice, twice
