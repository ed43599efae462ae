"""The row-parallel bias under sequence parallelism, on 2 real gloo ranks, against one process in
float64.

Why this file: 2023 Slapo's `tests/test_shard.py::test_seq_para` (run by
scripts/run_slapo2023_suite.py) fails here on its comparing rank because it all-reduces
`linear2.bias.grad` itself. In 2023 each rank's gradient of a row-parallel bias added after a
reduce-scatter covered only its own tokens; today the reduce-scatter kernel sums it over the group
(`slapo/sharding.py`, `_BiasAfterReduceKernel`), so every rank already holds the full gradient
and a second all-reduce doubles it (docs/migrating.md). These tests pin today's contract on the
2023 test's own model and schedule: output and every gradient equal to one process, on every
rank. `tests/test_sequence_parallel.py::test_reduce_scatter_before_bias` checks one layer alone
(float32, Linear and HF Conv1D); this one checks the composed schedule in float64.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slapo

WORLD = 2
SEQ_AXIS = 1


class TwoLinear(nn.Module):
    """2023's test_seq_para model: column-parallel linear1, row-parallel linear2 (with a bias)."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(30, 30)
        self.linear2 = nn.Linear(30, 30)

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        return F.relu(self.linear2(self.linear1(data)))


def _split_2023(rank: int):
    """2023's own split pre-hook (plain autograd split: backward zero-fills the other slices)."""

    def sequence_partition(module, args):
        return args[0].split(args[0].shape[SEQ_AXIS] // WORLD, dim=SEQ_AXIS)[rank].contiguous()

    return sequence_partition


def _schedule(model: nn.Module, variant: str, rank: int) -> nn.Module:
    """The 2023 schedule with its own split ("2023") or slapo's `scatter` split ("scatter").
    2023's schedule also all-reduced linear1's input gradient ("bwd_post"), which the
    all_gather's backward already sums: the input gradient came out 2x (world size), silently.
    That call is refused now (`sync`: `_refuse_second_input_grad_reduction`)."""
    from slapo.errors import SchedulingError

    sch = slapo.create_schedule(model)
    if variant == "2023":
        sch["linear1"].sync(mode="fwd_pre", sync_op_or_fn=_split_2023(rank))
    else:
        sch["linear1"].sync(mode="fwd_pre", sync_op_or_fn="scatter", axis=SEQ_AXIS)
    sch["linear1"].sync(mode="fwd_pre", sync_op_or_fn="all_gather", axis=SEQ_AXIS)
    sch["linear1"].shard("weight", axis=0)
    sch["linear1"].shard("bias", axis=0)
    with pytest.raises(SchedulingError, match="sum it a second time"):
        sch["linear1"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    sch["linear2"].shard("weight", axis=1)
    sch["linear2"].sync(mode="fwd_post", sync_op_or_fn="reduce_scatter", axis=SEQ_AXIS)
    sch.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=SEQ_AXIS,
             tensor_parallel_output_grad=False)
    return slapo.build(sch, init_weights=False)[0]


def _run(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and input gradient of a weighted-sum loss (every token weighted differently)."""
    x = x.clone().requires_grad_()
    out = model(x)
    (out * g).sum().backward()
    return out.detach(), x.grad


def job_seq_para_bias(variant: str) -> dict:
    """Both ranks: the scheduled model's output and every gradient equal the one-process ones.
    Returns the numbers the report quotes (max differences and the 2023 double count)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = TwoLinear().double()
    model = _schedule(copy.deepcopy(ref), variant, rank)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 16, 30, dtype=torch.float64, generator=gen)
    g = torch.randn(3, 16, 30, dtype=torch.float64, generator=gen)
    out_ref, xg_ref = _run(ref, x, g)
    out, xg = _run(model, x, g)

    torch.testing.assert_close(out, out_ref)
    expect = {"linear1.weight": ref.linear1.weight.grad.chunk(WORLD, 0)[rank],
              "linear1.bias": ref.linear1.bias.grad.chunk(WORLD, 0)[rank],
              "linear2.weight": ref.linear2.weight.grad.chunk(WORLD, 1)[rank],
              "linear2.bias": ref.linear2.bias.grad}  # replicated: the full gradient, every rank
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(expect)
    for name, want in expect.items():
        torch.testing.assert_close(got[name].grad, want, msg=lambda m, n=name: f"{n}.grad: {m}")
    if variant == "2023":  # a plain split: each rank holds its own tokens' input gradient
        dist.all_reduce(xg)
    torch.testing.assert_close(xg, xg_ref)
    return _conventions(model, ref, x, g, rank)


def _conventions(model: nn.Module, ref: nn.Module, x, g, rank: int) -> dict:
    """The numbers that tell the two conventions apart: this rank's own tokens' share of the
    bias gradient (2023's per-rank value) and the full gradient all-reduced (2023's test)."""
    import torch.distributed as dist

    full = ref.linear2.bias.grad
    with torch.no_grad():
        live = ref.linear2(ref.linear1(x)) > 0  # where relu passes the gradient
    torch.testing.assert_close((live * g).sum((0, 1)), full)  # the formula below is the gradient
    own = (live * g).chunk(WORLD, SEQ_AXIS)[rank].sum((0, 1))
    twice = model.linear2.bias.grad.clone()
    dist.all_reduce(twice)
    return {"own_share_max_diff": (own - full).abs().max().item(),
            "allreduced_over_full": sorted({round(v, 9) for v in (twice / full).tolist()})}


@pytest.mark.dist
@pytest.mark.parametrize("variant", ["2023", "scatter"])
def test_seq_parallel_row_bias_matches_one_process(dist2, variant):
    """Every rank's row-parallel bias gradient is the full one-process gradient (not its own
    tokens' share), so 2023's test_seq_para, which all-reduces it again, sees exactly 2x."""
    for r in dist2.run(job_seq_para_bias, variant):
        assert r["own_share_max_diff"] > 1e-2, r  # one rank's tokens alone are not the gradient
        assert r["allreduced_over_full"] == [2.0], r
