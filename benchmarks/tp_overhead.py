"""Slapo local-shard tensor parallelism vs DTensor `parallelize_module`, same model, same ranks.

    torchrun --nproc-per-node 2 benchmarks/tp_overhead.py [--out bench_tp.json]

Both shard a stack of Megatron MLP blocks (column-parallel up, row-parallel down) and run
forward+backward+AdamW steps; we report the median step time of each and the ratio within this
one run (absolute times on a shared VM are noise). Also checks the two give the same loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

import slapo
from slapo.distributed.group import leave_process_group


class MLP(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


def slapo_tp(model: nn.Module) -> nn.Module:
    sch = slapo.create_schedule(model)
    for blk in sch:
        blk["up"].shard(["weight", "bias"], axis=0)
        blk["up"].sync("bwd_post", "all_reduce")
        blk["down"].shard("weight", axis=1)
        blk["down"].sync("fwd_post", "all_reduce")
    return model


def dtensor_tp(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for blk in model:
        parallelize_module(blk, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def time_steps(model, x, steps: int, warmup: int = 2) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss = [], 0.0
    for i in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, loss.item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    base = nn.Sequential(*[MLP(args.hidden) for _ in range(args.layers)])
    x = torch.randn(args.tokens, args.hidden)
    rows = {}
    for name, fn in (("slapo", slapo_tp), ("dtensor", dtensor_tp), ("slapo_again", slapo_tp)):
        times, loss = time_steps(fn(copy.deepcopy(base)), x, args.steps)
        rows[name] = {"median_s": statistics.median(times), "loss": loss}
    if dist.get_rank() == 0:
        ref = rows["slapo"]["median_s"]
        print(f"world={dist.get_world_size()} hidden={args.hidden} layers={args.layers} "
              f"tokens={args.tokens} threads={torch.get_num_threads()}")
        print(f"{'variant':<12} {'median step (ms)':>16} {'ratio vs slapo':>15} {'final loss':>12}")
        for name, r in rows.items():
            print(f"{name:<12} {r['median_s'] * 1e3:>16.1f} {r['median_s'] / ref:>15.2f} "
                  f"{r['loss']:>12.6f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rows": rows,
                           "machine": os.uname().nodename}, f, indent=2)
    leave_process_group()


if __name__ == "__main__":
    main()
