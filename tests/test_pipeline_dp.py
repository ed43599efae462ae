"""Pipelines with data parallelism on 4 gloo ranks (dp=2 x pp=2): FSDP2 matches one process;
DDP, which cannot hold a stage, is refused on every rank before anything is built."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import make_batches, reference_losses

pytestmark = pytest.mark.dist


def _scheduled(mesh):
    import models

    import slapo

    model = models.gpt2(seed=0, layers=4)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    sch["transformer.h.1"].cut_pipeline_stage()
    return slapo, sch, ref


def job_pp_dp(data_parallel: str):
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2, pp=2, tp=1)
    slapo, sch, ref = _scheduled(mesh)
    kwargs = dict(optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3}, pipeline="1F1B",
                  num_microbatches=2, data_parallel=data_parallel)
    if data_parallel == "ddp":
        before = {k: v.clone() for k, v in sch.mod.state_dict().items()}
        with pytest.raises(slapo.SchedulingError, match="data_parallel='fsdp'"):
            slapo.build(sch, **kwargs)
        assert all(torch.equal(v, before[k]) for k, v in sch.mod.state_dict().items())
        return "refused"
    trained, _ = slapo.build(sch, **kwargs)
    batches = make_batches()
    losses = [trained.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-5, atol=0)
    return losses


def test_pipeline_with_ddp_is_refused_on_every_rank(dist4):
    assert dist4.run(job_pp_dp, "ddp") == ["refused"] * 4


def test_pipeline_with_fsdp_matches_single_process(dist4):
    losses = dist4.run(job_pp_dp, "fsdp")
    assert all(x == losses[0] for x in losses)
