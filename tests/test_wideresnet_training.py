"""WideResNet through the training runtime: selective checkpointing, gradient accumulation,
bf16 mixed precision, DDP and FSDP2, each against a hand-written loop on the unscheduled model.

BatchNorm makes the references specific (test_wideresnet.py's module doc says why): training-
mode BN normalises each forward's samples with their own statistics and updates its running
statistics once per forward. So a step that splits the batch (grad_accum micro-batches, data-
parallel ranks) equals the unscheduled model run on the *same pieces* one after the other, loss
averaged, and the running statistics follow the forward that each rank ran:
- grad_accum: every micro-batch, in order, on the one model;
- DDP: each rank's own half; at each forward DDP first copies rank 0's buffers to every rank
  (`broadcast_buffers`), so rank 1 carries rank 0's statistics updated by its own half;
- FSDP2: each rank's own halves only (FSDP2 never synchronises buffers).
Parameters after each SGD step, the losses and every running statistic are compared.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import vision_models as vm

import slapo
from slapo import model_schedule
from slapo.module_patch import wrappers

LR = 0.1
BF16 = torch.bfloat16


def _loss(out, batch):
    return F.cross_entropy(out, batch["labels"])


def _close(got, want, what, rel=1e-4):
    got, want = got.detach().double(), want.detach().double()
    err = (got - want).abs().max().item() if want.numel() else 0.0
    bound = rel * (want.abs().max().item() if want.numel() else 0.0) + 1e-6
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"


def _buffers(model) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _load_buffers(model, state: dict[str, torch.Tensor]) -> None:
    for n, b in model.named_buffers():
        b.copy_(state[n])


def reference_steps(ref, batches, pieces: int, *, buffers="shared", dtype=None):
    """The unscheduled model trained on each batch split in `pieces` (one per micro-batch or
    data-parallel rank), gradients averaged, SGD. Running statistics: "shared" (one model runs
    every piece in order: grad_accum), "per_rank" (each piece index keeps its own: FSDP2's
    ranks) or "ddp" (per rank, rank 0's as the step began copied to every rank first).
    Returns the losses, the parameters after each step, and the buffers of each piece index."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    rank_buffers = [_buffers(ref) for _ in range(pieces)]
    losses, params = [], []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        total, rank0_before = 0.0, rank_buffers[0]
        for r, (x, y) in enumerate(zip(batch["x"].chunk(pieces), batch["labels"].chunk(pieces))):
            _load_buffers(ref, {"shared": rank_buffers[(r - 1) % pieces], "ddp": rank0_before,
                                "per_rank": rank_buffers[r]}[buffers])
            with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(ref(x), y)
            (loss / pieces).backward()
            rank_buffers[r] = _buffers(ref)
            total += loss.item() / pieces
        opt.step()
        losses.append(total)
        params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return losses, params, rank_buffers


def _batches(n=2, batch=4):
    return [dict(zip(("x", "labels"), vm.images(batch=batch, seed=20 + i))) for i in range(n)]


def _train(model, batches, **build_kw):
    tm, _ = slapo.build(model if isinstance(model, slapo.Schedule) else
                        slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR}, loss_fn=_loss, **build_kw)
    params = []
    losses = []
    for b in batches:
        losses.append(tm.train_step(b))
        params.append({n: p.detach().clone() for n, p in tm.named_parameters()})
    return tm, losses, params


def _assert_trained_alike(got, want, what):
    (tm, losses, params), (ref_losses, ref_params, _) = got, want
    assert losses == pytest.approx(ref_losses, rel=1e-5), (what, losses, ref_losses)
    for step, (p, rp) in enumerate(zip(params, ref_params, strict=True)):
        assert list(p) == list(rp), what
        for name in rp:
            _close(p[name], rp[name], f"{what}: {name} after step {step}")
    return tm


# ---------------------------------------------------------------------------- one process

def test_selective_checkpointing_trains_like_the_model_and_counts_bn_once(one_thread):
    """ckpt_policy="selective" (keep the convolutions' outputs, recompute BN/ReLU) on every
    block: outputs, gradients, stepped parameters and running statistics as the original."""
    from test_wideresnet import train_step_matches

    model, ref = vm.tiny(seed=2), vm.tiny(seed=2)
    sch = model_schedule.apply(model, ckpt_ratio=1.0, ckpt_policy="selective")
    blocks = [b for s in slapo.model_schedule.wideresnet.stage_nodes(sch) for b in s]
    assert all(any(w.name == "checkpoint" for w in wrappers(b.mod)) for b in blocks)
    x, y = vm.images(seed=3)
    assert train_step_matches(model, ref, x, y) > 100
    assert int(model.layer1[0].bn1.num_batches_tracked) == 1


def test_grad_accum_equals_micro_batches_one_after_the_other(one_thread):
    model = vm.tiny(seed=4)
    ref = copy.deepcopy(model)
    batches = _batches()
    sch = model_schedule.apply(model, ckpt_ratio=0.5)
    want = reference_steps(ref, batches, 2)
    tm = _assert_trained_alike(_train(sch, batches, grad_accum=2), want, "grad_accum=2")
    for name, b in tm.named_buffers():  # one model: the last micro-batch's statistics
        _close(b, want[2][1][name], f"buffer {name}")


def test_bf16_equals_the_hand_written_autocast_loop(one_thread):
    """mixed_precision="bf16": autocast around forward and loss, fp32 weights, gradients and
    running statistics; bit for bit the hand-written loop."""
    model = vm.tiny(seed=6)
    ref = copy.deepcopy(model)
    batches = _batches()
    got = _train(model_schedule.apply(model, ckpt_ratio=0.5), batches, mixed_precision="bf16")
    want = reference_steps(ref, batches, 1, dtype=BF16)
    fp32 = reference_steps(vm.tiny(seed=6), batches, 1)
    assert got[1] == want[0], (got[1], want[0])
    for name, p in want[1][-1].items():
        assert torch.equal(got[2][-1][name], p), name
    assert got[1] != fp32[0], "bf16 and fp32 gave identical losses: autocast had no effect"
    for name, b in got[0].named_buffers():
        assert b.dtype == want[2][0][name].dtype and torch.equal(b, want[2][0][name]), name
    assert all(p.dtype == torch.float32 for p in got[0].parameters())


# ---------------------------------------------------------------------------- 2 gloo ranks

def job_data_parallel(kind: str):
    """DDP or FSDP2 over 2 ranks (each takes its half of the global batch), 2 SGD steps."""
    rank = torch.distributed.get_rank()
    mesh = slapo.init_mesh(dp=2)
    model = vm.tiny(seed=8)
    ref = copy.deepcopy(model)
    batches = _batches(batch=8)
    sch = model_schedule.apply(slapo.create_schedule(model, mesh=mesh), ckpt_ratio=0.5)
    got = _train(sch, batches, data_parallel=kind)
    want = reference_steps(ref, batches, 2, buffers="ddp" if kind == "ddp" else "per_rank")
    tm = got[0]
    if kind == "fsdp":  # one unit per Bottleneck block (layer1..4 are nn.Sequential), + the root
        from torch.distributed.fsdp import FSDPModule

        units = [n for n, m in tm.named_modules() if isinstance(m, FSDPModule)]
        assert units == ["", *(f"layer{s}.{i}" for s, n in zip((1, 2, 3, 4), (2, 1, 2, 1))
                                for i in range(n))], units
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in
            got[2][-1].items()}
    _assert_trained_alike((tm, got[1], [full]), (want[0], want[1][-1:], None), kind)
    for name, b in tm.named_buffers():
        _close(b, want[2][rank][name], f"{kind} rank {rank}: buffer {name}")
    return got[1]


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_data_parallel_trains_like_each_ranks_half(dist2, kind):
    losses = dist2.run(job_data_parallel, kind)
    assert losses[0] == losses[1]


def test_loss_fn_entries_stay_out_of_the_forward(one_thread):
    """With a `loss_fn`, batch entries the forward does not name (`labels` for a torchvision
    net) go to the loss function only, as under a pipeline; without one, every entry still
    reaches the forward, so a misspelt key fails there (and a `**kwargs` forward gets all)."""
    from slapo.runtime.batch import call

    model = vm.tiny(seed=1)
    x, y = vm.images(seed=2)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR})
    with pytest.raises(TypeError, match="labels"):
        tm.train_step({"x": x, "labels": y})

    class TakesAll(torch.nn.Module):
        def forward(self, **kwargs):
            return sorted(kwargs)

    assert call(TakesAll(), {"x": x, "labels": y}, loss_fn_given=True) == ["labels", "x"]


def test_fsdp_units_are_blocks_in_lists_and_stages():
    """FSDP2 units: ModuleList elements (HF layers) and the blocks of a Sequential of one
    composite class (a ResNet stage, checkpointed or not), never a Sequential of layers."""
    from slapo.runtime.data_parallel import fsdp_blocks

    model = vm.tiny()
    model_schedule.apply(model, ckpt_ratio=0.5)  # patches some blocks' classes
    assert fsdp_blocks(model) == [b for s in (model.layer1, model.layer2, model.layer3,
                                              model.layer4) for b in s]
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    assert fsdp_blocks(mlp) == []
