"""Expert compute of one Qwen3-MoE sparse block, forward + backward, HF's implementations
against Slapo's expert-parallel experts (`slapo.op.moe.ExpertParallelExperts`), in one run.

Rows (each the time of one forward + backward of the whole MoE block: router, experts, the
combine; the same block weights and tokens per rank):

* `hf eager`: HF's expert loop (`experts_implementation="eager"`), one process;
* `hf grouped_mm`: HF's default grouped GEMM, one process (what a user gets);
* `slapo ep=1`: Slapo's experts on one rank (its dispatch and grouped GEMMs, no peer): the
  overhead of the expert-parallel path itself;
* `slapo ep=N`: N processes (gloo on CPU, NCCL on CUDA), each holding E/N experts and its own
  tokens, all-to-all between them: "equal work" is the same tokens per rank as the
  one-process rows; `expert MiB` is what each rank holds.

Ratios are against `hf eager` and `hf grouped_mm` of the same run. `max diff` is the largest
difference of the block output from `hf eager`'s (rank 0's tokens). On CPU each process uses
`--threads` threads (default 1), so a rank and the one process compare at equal compute.

    PYTHONPATH=. python benchmarks/moe.py --json moe_cpu.json            # small CPU shapes
    PYTHONPATH=. python benchmarks/moe.py --shape 30b-a3b --device cuda  # Qwen3-30B-A3B layer
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (hidden, moe_intermediate, experts, top-k, tokens per rank)
SHAPES = {"cpu": (256, 128, 16, 4, 512), "30b-a3b": (2048, 768, 128, 8, 8192),
          "tiny": (64, 32, 4, 2, 32)}  # tiny: the test's


def block(shape: str, impl: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A Qwen3-MoE sparse block of `shape`, seed 0, HF's experts implementation `impl`."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hidden, inter, experts, k, _ = SHAPES[shape]
    cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                         num_experts_per_tok=k, norm_topk_prob=True)
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    mod = Qwen3MoeSparseMoeBlock(cfg)
    for p in mod.parameters():
        torch.nn.init.normal_(p, std=0.02)
    return mod.to(device=device, dtype=dtype)


def tokens(shape: str, rank: int, device: str, dtype: torch.dtype) -> torch.Tensor:
    hidden, _, _, _, n = SHAPES[shape]
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(1, n, hidden, generator=g).to(device=device, dtype=dtype)


def time_step(mod: torch.nn.Module, x: torch.Tensor, iters: int, device: str) -> float:
    """Median seconds of one forward + backward (after 2 warm-up steps)."""
    times = []
    for i in range(iters + 2):
        xi = x.detach().requires_grad_()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = mod(xi)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
        mod.zero_grad(set_to_none=True)
    return statistics.median(times)


def expert_mib(mod: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in mod.experts.parameters()) / 2**20


def output(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = mod(x)
    return (out[0] if isinstance(out, tuple) else out).float()


def slapo_block(shape: str, device: str, dtype: torch.dtype, group, ep: int, rank: int):
    """The block with its experts swapped for this rank's `E / ep` (grouped GEMMs)."""
    from slapo.op.moe import ExpertParallelExperts

    mod = block(shape, "grouped_mm", device, dtype)
    mod.experts = ExpertParallelExperts(mod.experts, group, ep, rank)
    return mod


def _ep_worker(rank: int, ep: int, args, init: str, out_path: str) -> None:
    torch.set_num_threads(args.threads)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=ep)
    try:
        dtype = getattr(torch, args.dtype)
        mod = slapo_block(args.shape, args.device, dtype, dist.group.WORLD, ep, rank)
        x = tokens(args.shape, rank, args.device, dtype)
        dist.barrier()
        seconds = time_step(mod, x, args.iters, args.device)
        # every rank runs the forward: its all-to-alls need each peer
        result = {"seconds": seconds, "expert_mib": expert_mib(mod), "out": output(mod, x).cpu()}
        all_seconds = [None] * ep
        dist.all_gather_object(all_seconds, seconds)
        if rank == 0:
            result["seconds"] = max(all_seconds)  # a step ends with the slowest rank
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def run_ep(ep: int, args) -> dict:
    """`slapo ep=<ep>` on `ep` processes (ep=1: in this one, a group of one); rank 0's
    result."""
    if ep == 1:
        return _in_process(args)
    with tempfile.TemporaryDirectory() as tmp:
        init, out_path = f"file://{tmp}/rendezvous", os.path.join(tmp, "out.pt")
        mp.spawn(_ep_worker, args=(ep, args, init, out_path), nprocs=ep, join=True)
        return torch.load(out_path, weights_only=True)


def _in_process(args) -> dict:
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if args.device == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"file://{tmp}/rendezvous", rank=0,
                                world_size=1)
        try:
            mod = slapo_block(args.shape, args.device, dtype, dist.group.WORLD, 1, 0)
            x = tokens(args.shape, 0, args.device, dtype)
            return {"seconds": time_step(mod, x, args.iters, args.device),
                    "expert_mib": expert_mib(mod), "out": output(mod, x).cpu()}
        finally:
            dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 on CPU, bfloat16 on CUDA by default")
    ap.add_argument("--ep", type=int, nargs="*", default=[2],
                    help="expert-parallel degrees to run (processes each)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    x = tokens(args.shape, 0, args.device, dtype)

    rows, ref = [], None
    for name, impl in (("hf eager", "eager"), ("hf grouped_mm", "grouped_mm")):
        mod = block(args.shape, impl, args.device, dtype)
        out = output(mod, x)
        ref = out if ref is None else ref
        rows.append({"variant": name, "seconds": time_step(mod, x, args.iters, args.device),
                     "expert_mib": expert_mib(mod), "max_diff": (out - ref).abs().max().item()})
    for ep in [1, *args.ep]:
        res = run_ep(ep, args)
        rows.append({"variant": f"slapo ep={ep}", "seconds": res["seconds"],
                     "expert_mib": res["expert_mib"],
                     "max_diff": (res["out"].to(ref.device) - ref).abs().max().item()})
    n = SHAPES[args.shape][4]
    eager, grouped = rows[0]["seconds"], rows[1]["seconds"]
    for r in rows:
        r.update(tokens_per_s=n / r["seconds"], vs_eager=eager / r["seconds"],
                 vs_grouped=grouped / r["seconds"])

    hidden, inter, experts, k, _ = SHAPES[args.shape]
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() \
        or platform.machine()
    print(f"MoE block fwd+bwd, {args.shape}: hidden {hidden}, expert ffn {inter}, {experts} "
          f"experts, top-{k}, {n} tokens per rank, {args.dtype}, {device}, torch "
          f"{torch.__version__}, {args.threads} thread(s) per process")
    print(f"{'variant':<16}{'ms/step':>10}{'tok/s/rank':>12}{'vs eager':>10}{'vs grouped':>12}"
          f"{'expert MiB':>12}{'max diff':>11}")
    for r in rows:
        print(f"{r['variant']:<16}{r['seconds'] * 1e3:>10.2f}{r['tokens_per_s']:>12.0f}"
              f"{r['vs_eager']:>9.2f}x{r['vs_grouped']:>11.2f}x{r['expert_mib']:>12.2f}"
              f"{r['max_diff']:>11.1e}")
    if args.json:
        meta = {"shape": args.shape, "device": device, "dtype": args.dtype,
                "torch": torch.__version__, "threads": args.threads, "tokens_per_rank": n}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
