"""The checkpoint layout of TP shards inside FSDP2 shards (`slapo.train.shard_layout`).

Without processes: for every rank (d, t) of a dp x tp grid, the chunk FSDP2 holds (torch.chunk
of the TP-local tensor along its shard dim) must be exactly the box a DTensor with the layout's
placements gives that rank of the reshaped full tensor. A wrong view would save every element,
each in the wrong place, and resume would not notice (it reads back what it wrote): only
`slapo export` would, with a permuted model.
"""

from __future__ import annotations

import pytest
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
