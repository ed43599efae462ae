"""The checkpoint layout of TP shards inside FSDP2 shards (`slapo.train.shard_layout`).

Without processes: for every rank (d, t) of a dp x tp grid, the chunk FSDP2 holds (torch.chunk
of the TP-local tensor along its shard dim) must be exactly the box a DTensor with the layout's
placements gives that rank of the reshaped full tensor. A wrong view would save every element,
each in the wrong place, and resume would not notice (it reads back what it wrote): only
`slapo export` would, with a permuted model.
"""

from __future__ import annotations

import pytest
import sweep
import torch

from slapo import sharding
from slapo.train.shard_layout import fsdp_view

CASES = [
    # shape, TP axis, blocks, TP size, FSDP shard dim, dp size
    ((64, 96), 1, 3, 2, 0, 2),    # GPT-2 c_attn weight (Conv1D, fused q|k|v columns)
    ((96,), 0, 3, 2, 0, 2),       # its bias: no plain layout (gathered instead)
    ((32, 64), 0, 1, 2, 0, 2),    # row-parallel Conv1D weight / column-parallel Linear weight
    ((64, 32), 1, 1, 2, 0, 2),    # row-parallel Linear weight
    ((48, 8), 0, 1, 2, 0, 4),     # uneven FSDP chunks (24 rows over 4: 6 each) ...
    ((20, 8), 0, 1, 2, 0, 4),     # ... 10 rows over 4: 3, 3, 3, 1
    ((6, 8), 0, 1, 2, 0, 4),      # ... 3 rows over 4: one rank holds nothing
    ((64, 16), 0, 2, 2, 0, 2),    # fused gate|up, blocks divisible by dp
    ((64, 16), 0, 4, 2, 0, 2),
    ((48, 16), 0, 3, 2, 0, 2),    # blocks not divisible by dp: gathered
    ((8, 64, 4), 1, 2, 4, 0, 3),  # 3-D, TP on a middle axis
    ((8, 64, 4), 1, 1, 2, 2, 2),  # FSDP on a later dim than TP
]


def _fsdp_chunk(full, axis, blocks, tp, t, dim, dp, d):
    local = sharding.local_slice(full, axis, tp, t, blocks)
    chunks = torch.chunk(local, dp, dim=dim)
    return local, (chunks[d] if d < len(chunks) else local.narrow(dim, 0, 0))


@pytest.mark.parametrize("shape,axis,blocks,tp,dim,dp", CASES)
def test_every_ranks_fsdp_chunk_is_its_box_of_the_view(shape, axis, blocks, tp, dim, dp):
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    spec = sharding.ShardSpec(tuple(shape), axis, tp, 0, blocks)
    view = fsdp_view(spec, dim, dp)
    if view is None:
        assert axis == dim and blocks > 1 and blocks % dp, "only fused blocks not divisible"
        return
    vshape, tp_at, dp_at = view
    assert tp_at != dp_at
    reshaped = full.reshape(vshape)  # a reshape, never a permutation: export reshapes back
    seen = torch.zeros(full.numel(), dtype=torch.int64)
    for t in range(tp):
        for d in range(dp):
            local, chunk = _fsdp_chunk(full, axis, blocks, tp, t, dim, dp, d)
            # DTensor placements (Shard(dp_at) on mesh dim 0, Shard(tp_at) on dim 1)
            box = reshaped.chunk(tp, dim=tp_at)[t]
            pieces = box.chunk(dp, dim=dp_at)
            box = pieces[d] if d < len(pieces) else box.narrow(dp_at, 0, 0)
            assert torch.equal(box.flatten(), chunk.flatten()), (t, d)
            # the local shape the layout gives the chunk
            local_shape = list(vshape)
            local_shape[tp_at] //= tp
            local_shape[dp_at] = chunk.shape[dim] * vshape[dp_at] // local.shape[dim]
            assert list(box.shape) == local_shape, (t, d)
            seen[box.flatten()] += 1
    assert torch.equal(seen, torch.ones_like(seen))  # every element saved exactly once


def test_uneven_tp_split_has_no_view():
    assert fsdp_view(sharding.ShardSpec((10, 4), 0, 4, 0, 1), 1, 2) is None


# ---- every family: a tp=2 x dp=2 (FSDP2) checkpoint holds the whole model and resumes it ----
# a sample by default (tests/sweep.py: ~75 s on CI for all ten): the tied MLM decoder (BERT),
# one shared layer (ALBERT), Conv1D (GPT-2), optional projections (OPT), the head-sharded bias and
# tied head (T5), grouped k/v with per-head norms (Qwen3); every family with SLAPO_SWEEP=all
FAMILIES = sweep.sample(["bert_mlm", "roberta", "albert", "gpt2", "gpt_neo", "opt", "t5", "llama",
                         "qwen2", "qwen3"], ["bert_mlm", "albert", "gpt2", "opt", "t5", "qwen3"])


def job_every_family_checkpoint(out: str) -> dict:
    """For each family on 4 ranks: the ready TP schedule inside FSDP2, one AdamW step, a run
    checkpoint. Rank 0 reads it back in one process as `slapo export` does; every rank loads it
    into a differently initialised copy. Both must hold exactly the consolidated model, and the
    copy's next step (restored AdamW moments) must give the original's loss."""
    from pathlib import Path

    import models

    import slapo
    from slapo import model_schedule
    from slapo.train import run_state
    from slapo.train.export import load_checkpoint_model

    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    mesh = slapo.init_mesh(dp=2, tp=2)
    checked = {}
    for name in FAMILIES:
        batch = models.batch_for(name, batch=4)
        built = []
        for seed in (0, 7):
            sch = model_schedule.apply(getattr(models, name)(seed=seed), tp=2, mesh=mesh)
            built.append(slapo.build(sch, mesh=mesh, data_parallel="fsdp", seed=seed,
                                     optimizer=torch.optim.AdamW,
                                     optimizer_kwargs={"lr": 1e-2}))
        (model, opt), (copy, copy_opt) = built
        model.train_step(batch)
        whole = slapo.consolidate(model)
        path = Path(out) / name
        run_state.save(path, model, opt, {"step": 1}, rank)
        if rank == 0:
            fresh = getattr(models, name)(seed=123)
            load_checkpoint_model(path, fresh)
            for k, v in fresh.state_dict().items():
                assert torch.equal(v, whole[k]), (name, "export", k)
        run_state.load(path, copy, copy_opt, rank)
        for k, v in slapo.consolidate(copy).items():
            assert torch.equal(v, whole[k]), (name, "resume", k)
        checked[name] = (model.train_step(batch), copy.train_step(batch))
    return checked


@pytest.mark.dist
def test_every_family_tp_inside_fsdp2_checkpoint_exports_and_resumes(dist4, tmp_path):
    res = dist4.run(job_every_family_checkpoint, str(tmp_path), timeout=600)
    assert set(res[0]) == set(FAMILIES)
    for name, (loss, resumed) in res[0].items():
        assert loss == resumed, name
