"""Optimizer offload (`build(optimizer_offload=True)`, `slapo train --optimizer-offload`;
`slapo/runtime/optimizer_offload.py`): the optimizer's state and step in host memory.

On CPU the host copies are distinct tensors, so the copies really run: the parameters and the
AdamW state after 3 steps (with clipping, accumulation, bf16, an LR that changes every step and
weights loaded between steps) are bit-identical to the device optimizer's, in one process, under
DDP, FSDP2 and TP on 2 ranks, through a pipeline, and after resuming from a checkpoint. Each broken
data flow (a parameter not copied back, a gradient not copied to the host, the LR not passed on,
a loaded weight not taken) is caught by the same comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import make_batches

from slapo.cli import main
from slapo.errors import SchedulingError
from slapo.runtime.optimizer_offload import HostOffloadOptimizer

pytestmark = pytest.mark.usefixtures("one_thread")

LR = 1e-2


# ---- the API, one process ---------------------------------------------------------------------
def _train(offload: bool, **kw):
    """3 steps of a tiny GPT-2 with AdamW (weight decay on); the LR changes every step (as the
    loop sets it on `param_groups`), and after the first step the weights are reloaded from a
    state dict (what resuming does), so the host copies must follow the device."""
    import models

    import slapo

    model = models.gpt2(seed=0, layers=2)
    reload = {k: v.clone() * 0.9 for k, v in model.state_dict().items()}
    sch = slapo.create_schedule(model)
    tm, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_offload=offload,
                          optimizer_kwargs={"lr": LR, "weight_decay": 0.1}, **kw)
    losses = []
    for i, batch in enumerate(make_batches()[:3]):
        for group in opt.param_groups:
            group["lr"] = LR * (i + 1) / 3
        losses.append(tm.train_step(batch))
        if i == 0:
            tm.load_state_dict(reload)
    return tm, opt, losses


def _mismatches(a, b) -> list[str]:
    """Names of the parameters (and AdamW moments) that are not bit-identical."""
    sb = dict(b[0].named_parameters())
    bad = []
    for name, p in a[0].named_parameters():
        q = sb[name]
        if not torch.equal(p.detach(), q.detach()):
            bad.append(name)
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(a[1].state[p][key], b[1].state[q][key]):
                bad.append(f"{name}.{key}")
    return bad


@pytest.fixture(scope="module")
def reference():
    return _train(False, grad_clip=0.5, grad_accum=2)


def test_three_steps_are_bit_identical_and_state_is_on_the_host(reference):
    off = _train(True, grad_clip=0.5, grad_accum=2)
    assert off[2] == reference[2]
    assert _mismatches(reference, off) == []
    opt = off[1]
    assert isinstance(opt, HostOffloadOptimizer) and type(opt.inner) is torch.optim.AdamW
    assert opt.inner.param_groups[0]["foreach"] is True
    assert opt.param_groups[0]["lr"] == opt.inner.param_groups[0]["lr"] == LR
    params = list(off[0].parameters())
    device_ptrs = {p.data_ptr() for p in params}
    for m in opt._mirrors:  # real copies: host memory distinct from the parameters
        assert m.host.data_ptr() not in device_ptrs and m.grad.data_ptr() not in device_ptrs
        assert m.host.device.type == "cpu" and m.host.grad is None
        state = opt.state[m.param]
        assert state is opt.inner.state[m.host]
        assert state["exp_avg"].data_ptr() not in device_ptrs
        assert torch.equal(m.host, m.param.detach())
    assert len(opt._mirrors) == len(params)


@pytest.mark.parametrize("kw", [{}, {"precision": "bf16"}, {"precision": "fp16"}])
def test_bit_identical_without_clipping_in_bf16_and_fp16(kw):
    ref, off = _train(False, **kw), _train(True, **kw)
    assert off[2] == ref[2]
    assert _mismatches(ref, off) == []


def _skip_grad(self, m):  # the host buffer keeps what it held (zeros): the gradient never came
    m.host.grad = m.grad


MUTATIONS = {
    "param_not_copied_back": ("_param_to_device", lambda self, m: None),
    "grad_not_copied_to_host": ("_grad_to_host", _skip_grad),
    "lr_not_passed_to_host": ("_push_hyperparameters", lambda self: None),
    "loaded_weights_not_taken": ("_param_to_host", lambda self, m: None),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_broken_data_flow_is_caught(mutation, reference, monkeypatch):
    name, broken = MUTATIONS[mutation]
    monkeypatch.setattr(HostOffloadOptimizer, name, broken)
    off = _train(True, grad_clip=0.5, grad_accum=2)
    assert _mismatches(reference, off), mutation


def test_state_dict_round_trip():
    """`state_dict` / `load_state_dict` go through the host optimizer (the state stays on the
    host, the saved LR is taken, the host kernels are kept)."""
    tm, opt, _ = _train(True)
    sd = opt.state_dict()
    assert sd["state"][0]["exp_avg"].device.type == "cpu"
    tm2, opt2, _ = _train(True)
    for group in opt2.param_groups:
        group["lr"] = 0.5
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["lr"] == LR and opt2.inner.param_groups[0]["foreach"] is True
    for p, q in zip(tm.parameters(), tm2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])
        assert opt2.state[q]["exp_avg_sq"].data_ptr() != q.data_ptr()


def test_an_lr_scheduler_reaches_the_host_step():
    """torch's LR schedulers write `param_groups` of the optimizer they are given: the host
    optimizer steps with their LR (bit-identical to the same schedule on the device)."""
    def run(offload: bool) -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 4)
        opt = HostOffloadOptimizer(layer.parameters(), torch.optim.AdamW, lr=0.1) if offload \
            else torch.optim.AdamW(layer.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            opt.zero_grad()
            layer(x).pow(2).mean().backward()
            opt.step()
            sched.step()
        if offload:
            assert opt.inner.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
        return torch.cat([p.detach().flatten() for p in layer.parameters()])

    assert torch.equal(run(True), run(False))


# ---- bad input ----------------------------------------------------------------------------------
def _sch():
    import models

    import slapo

    return slapo.create_schedule(models.gpt2(seed=0, layers=1))


BAD = {
    "not_an_optimizer_class": (dict(optimizer=lambda ps: torch.optim.AdamW(ps)),
                               ("torch.optim.Optimizer class", "optimizer_kwargs")),
    "no_optimizer": (dict(optimizer=None), ("needs an optimizer", "optimizer=torch.optim.AdamW")),
    "deepspeed_target": (dict(optimizer=torch.optim.AdamW, target="deepspeed"),
                         ("target='deepspeed'", "offload_optimizer")),
    "not_a_bool": (dict(optimizer=torch.optim.AdamW, optimizer_offload="yes"),
                   ("optimizer_offload='yes'", "True or False")),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_refused_before_anything_changes(case):
    import slapo

    kw, needles = BAD[case]
    kw = {"optimizer_offload": True, **kw}
    sch = _sch()
    before = {n: (p, p.detach().clone()) for n, p in sch.mod.named_parameters()}
    with pytest.raises(SchedulingError) as e:
        slapo.build(sch, **kw)
    for needle in needles:
        assert needle in str(e.value), str(e.value)
    assert "Fix" in str(e.value) or e.value.fix
    after = dict(sch.mod.named_parameters())
    assert after.keys() == before.keys() and not hasattr(sch.mod, "train_step")
    for n, (p, v) in before.items():
        assert after[n] is p and torch.equal(p.detach(), v)


def test_a_host_without_room_for_the_state_is_refused(monkeypatch):
    """The host state (16 B per parameter element, times the ranks sharing the host) against
    the host's available memory: refused with the numbers before any host buffer exists, and
    the user's weights unchanged."""
    import slapo
    import slapo.runtime.optimizer_offload as oo

    sch = _sch()
    params = [p for p in sch.mod.parameters()]
    need = oo.check_host_budget(params, available=10**15)
    assert need == 16 * sum(p.numel() for p in params)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SchedulingError, match="2 rank\\(s\\) on this host"):
        oo.check_host_budget(params, available=need + 1)  # one rank fits, two do not
    before = {n: p.detach().clone() for n, p in sch.mod.named_parameters()}
    monkeypatch.setattr(oo, "host_memory_available", lambda: need)
    with pytest.raises(SchedulingError, match="GiB is available"):
        slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_offload=True)
    assert all(torch.equal(p.detach(), before[n]) for n, p in sch.mod.named_parameters())


# ---- slapo train: checkpoints -------------------------------------------------------------------
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, seq_len=32, batch_size=8, steps=4,
            progress=False, plot=False, eval_batches=0, lr=1e-2, warmup=2, grad_accum=2,
            weight_decay=0.1, save_every=2)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint (model and optimizer state), whole, in one process."""
    import torch.distributed.checkpoint as dcp

    from slapo.train import run_state
    from slapo.train.checkpoint_read import SafeLoadPlanner, SafeReader

    meta = SafeReader(str(path)).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.items() if hasattr(m, "size")}
    with run_state._quiet_single_process():
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path),
                 no_dist=True)
    return state


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), set(a) ^ set(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


def _final(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint_tensors(out / "checkpoints" / "step_000004")


def _cli(out: Path, *flags: str) -> list[float]:
    argv = ["train", "--no-progress", "--out", str(out)]
    for k, v in TINY.items():
        if isinstance(v, bool):
            argv.append(f"--{'' if v else 'no-'}{k.replace('_', '-')}")
        else:
            argv += [f"--{k.replace('_', '-')}", str(v)]
    assert main([*argv, *flags]) == 0
    return json.loads((out / "metrics.json").read_text())["losses"]


def test_train_flag_resumes_bit_identically(tmp_path):
    """`slapo train --optimizer-offload`: same losses, weights and AdamW state as without it;
    resumed from its own checkpoint or from one written without offload, the same again."""
    plain = _cli(tmp_path / "plain")
    off = _cli(tmp_path / "off", "--optimizer-offload")
    assert off == plain
    ref = _final(tmp_path / "plain")
    assert any(k.endswith(".exp_avg_sq") for k in ref)
    assert _differ(ref, _final(tmp_path / "off")) == []
    for source in ("off", "plain"):
        step2 = tmp_path / source / "checkpoints" / "step_000002"
        resumed = _cli(tmp_path / f"resumed-{source}", "--optimizer-offload", "--resume",
                       str(step2))
        assert resumed == plain, source
        assert _differ(ref, _final(tmp_path / f"resumed-{source}")) == [], source


# ---- 2 ranks: DDP, FSDP2, TP, a pipeline --------------------------------------------------------
def job_train(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


def _dist_runs(dist2, tmp_path: Path, **knobs) -> None:
    """Without offload, with it, and with it resumed from its step-2 checkpoint: equal losses
    on both ranks and bit-identical final checkpoints (weights and optimizer state)."""
    opts = {**TINY, **knobs}
    plain = dist2.run(job_train, {**opts, "out": str(tmp_path / "plain")}, timeout=300)
    off = dist2.run(job_train, {**opts, "out": str(tmp_path / "off"),
                                "optimizer_offload": True}, timeout=300)
    step2 = tmp_path / "off" / "checkpoints" / "step_000002"
    resumed = dist2.run(job_train, {**opts, "out": str(tmp_path / "resumed"),
                                    "optimizer_offload": True, "resume": str(step2)},
                        timeout=300)
    assert plain[0] == plain[1] == off[0] == off[1] == resumed[0]
    ref = _final(tmp_path / "plain")
    assert _differ(ref, _final(tmp_path / "off")) == []
    assert _differ(ref, _final(tmp_path / "resumed")) == []


@pytest.mark.dist
def test_ddp_two_ranks_bit_identical_and_resumes(dist2, tmp_path):
    _dist_runs(dist2, tmp_path)


@pytest.mark.dist
def test_fsdp2_two_ranks_bit_identical_and_resumes(dist2, tmp_path):
    _dist_runs(dist2, tmp_path, dp_shard=True)


@pytest.mark.dist
def test_pipeline_two_stages_bit_identical_and_resumes(dist2, tmp_path):
    _dist_runs(dist2, tmp_path, pp_stages=2)


@pytest.mark.dist
def test_tensor_parallel_two_ranks_bit_identical_and_resumes(dist2, tmp_path):
    """TP shards are plain local tensors: their host moments are saved whole by the
    checkpoint's shard layout, as the device optimizer's are."""
    _dist_runs(dist2, tmp_path, tp=2, attention="sdpa")
