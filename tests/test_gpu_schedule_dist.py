"""The GPU schedule composed with data, tensor, sequence and pipeline parallelism, on 2 gloo
ranks.

Compiled blocks (aot_eager: dynamo + AOTAutograd, as inductor sees them, without code
generation), selective checkpointing and the fused loss must train exactly as one process does:
5 AdamW steps through `slapo.build(...).train_step`, losses equal to the single-process run.
"""

from __future__ import annotations

import copy

import pytest
import sweep
import torch
from reference import hidden_loss, make_batches, reference_losses

pytestmark = pytest.mark.dist

GPU_KNOBS = dict(attention="sdpa", compile_blocks="aot_eager", ckpt_ratio=1.0,
                 ckpt_policy="selective")


def _bert_loss(outputs, batch):
    return hidden_loss(outputs.last_hidden_state)


def job_tp_gpu_schedule(family: str, sequence_parallel: bool):
    """TP (or TP + SP) x compiled blocks x SAC x fused loss == one process."""
    import models

    import slapo
    from slapo import model_schedule

    model = getattr(models, family)(seed=0)
    ref = copy.deepcopy(model)
    mesh = slapo.init_mesh(tp=2)
    lm = family != "bert"  # tests' BERT is a BertModel: no head, no fused loss, own loss_fn
    sch = model_schedule.apply(model, mesh=mesh, fused_loss=lm, vocab_parallel=False,
                               sequence_parallel=sequence_parallel, **GPU_KNOBS)
    loss_fn = None if lm else _bert_loss
    trained, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                             loss_fn=loss_fn)
    batches = make_batches()
    if not lm:
        batches = [{"input_ids": b["input_ids"]} for b in batches]
    losses = [trained.train_step(b) for b in batches]
    expected = reference_losses(ref, batches, loss_fn=loss_fn)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    return losses


def job_pp_gpu_schedule():
    """2 pipeline stages (1F1B) holding compiled, selectively checkpointed blocks."""
    import models

    import slapo
    import slapo.runtime
    from slapo import model_schedule

    model = models.gpt2(seed=0, layers=4)
    ref = copy.deepcopy(model)
    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    sch = model_schedule.apply(model, mesh=mesh, pp_stages=2, **GPU_KNOBS)
    trained, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                             pipeline="1F1B", num_microbatches=2)
    batches = make_batches()
    losses = [trained.train_step(b) for b in batches]
    expected = reference_losses(ref, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    return losses


def job_dp_gpu_schedule(data_parallel: str):
    """DDP / FSDP2 over 2 ranks with compiled blocks, SAC and the fused loss (the head's weight is
    read inside the fused op, which FSDP2 must have gathered) == one process."""
    import models

    import slapo
    import slapo.runtime
    from slapo import model_schedule

    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    mesh = slapo.runtime.init_mesh(dp=2)
    sch = model_schedule.apply(model, mesh=mesh, fused_loss=True, **GPU_KNOBS)
    trained, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": 1e-3},
                             data_parallel=data_parallel)
    batches = make_batches()
    losses = [trained.train_step(b) for b in batches]
    expected = reference_losses(ref, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    return losses


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_data_parallel_with_gpu_schedule_matches_single_process(dist2, data_parallel):
    losses = dist2.run(job_dp_gpu_schedule, data_parallel)
    assert losses[0] == losses[1]


# a sample by default (tests/sweep.py): each family once, with and without SP on 2 of them
@pytest.mark.parametrize(("family", "sp"), sweep.spread(["gpt2", "llama", "bert"], [False, True], 2))
def test_tp_with_gpu_schedule_matches_single_process(dist2, family, sp):
    losses = dist2.run(job_tp_gpu_schedule, family, sp)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]


def test_pipeline_with_compiled_blocks_matches_single_process(dist2):
    losses = dist2.run(job_pp_gpu_schedule)
    assert losses[0] == losses[1]
