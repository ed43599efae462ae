"""Step time of pipeline schedules and data-parallel variants against one process, in one run.

    python benchmarks/parallel.py                  # spawns 2 ranks itself (gloo on CPU, NCCL on GPU)
    python benchmarks/parallel.py --world 4 --layers 8 --json out.json
    torchrun --nproc-per-node 2 benchmarks/parallel.py   # or under torchrun

Every configuration trains the same GPT-2 (built from a config, nothing downloaded) on the same
global batch with `slapo.build(...)` and `model.train_step(batch)`; only the parallelism changes.
The baseline is the same step in a single process on one device (one CPU thread per rank, so a
CPU run compares 1 core with `world` cores). `ratio` = step time / baseline step time (below 1
is faster); `speedup` = its inverse. CPU timings on shared machines are noisy: the median of
`--steps` steps after `--warmup` is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from slapo.distributed.group import leave_process_group  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16, help="global batch (samples)")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--json", default=None, help="write the results here")
    return ap.parse_args(argv)


def make_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=4, vocab_size=512,
                     n_positions=args.seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def make_batch(args, device):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=g).to(device)
    return {"input_ids": ids, "labels": ids}


def configs(args, world: int) -> list[tuple[str, dict, int]]:
    """(name, build kwargs, cuts) per configuration; cuts = pipeline stages - 1."""
    out = [
        (f"DDP dp={world}", {"data_parallel": "ddp"}, 0),
        (f"FSDP2 dp={world} (reshard)", {"data_parallel": "fsdp"}, 0),
        (f"FSDP2 dp={world} (no reshard)", {"data_parallel": "fsdp",
                                            "reshard_after_forward": False}, 0),
    ]
    m = args.microbatches
    for sched in ("GPipe", "1F1B"):
        out.append((f"PP={world} {sched} mb={m}",
                    {"pipeline": sched, "num_microbatches": m}, world - 1))
    if args.layers >= 2 * world:
        for sched in ("Interleaved1F1B", "ZBVZeroBubble"):
            out.append((f"PP={world} {sched} v=2 mb={m}",
                        {"pipeline": sched, "num_microbatches": m}, 2 * world - 1))
    return out


def cut_layers(sch, n_layers: int, n_cuts: int) -> None:
    """Evenly spaced stage boundaries over the decoder layers."""
    per = n_layers / (n_cuts + 1)
    for i in range(1, n_cuts + 1):
        sch[f"transformer.h.{round(per * i) - 1}"].cut_pipeline_stage()


def time_steps(tm, batch, args, collective: bool = True) -> tuple[float, float]:
    """Median step time (the slowest rank's, when `collective`) and the last loss."""
    collective = collective and dist.is_initialized()
    for _ in range(args.warmup):
        tm.train_step(batch)
    times, loss = [], 0.0
    for _ in range(args.steps):
        if collective:
            dist.barrier()
        t0 = time.perf_counter()
        loss = tm.train_step(batch)
        times.append(time.perf_counter() - t0)
    if collective:  # the slowest rank decides the step time
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t), loss
    return statistics.median(times), loss


def baseline(args) -> tuple[float, float]:
    import slapo

    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model(args).to(device)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW)
    return time_steps(tm, make_batch(args, device), args, collective=False)


def run_rank(args) -> list[dict]:
    """Every configuration on this rank (the process group is initialised)."""
    import slapo
    from slapo.runtime import init_mesh

    torch.set_num_threads(args.threads)
    world = dist.get_world_size()
    results = []
    for name, kw, n_cuts in configs(args, world):
        pp = world if "pipeline" in kw else 1
        mesh = init_mesh(dp=world // pp, pp=pp, tp=1)
        model = make_model(args)
        device = torch.device("cuda", torch.cuda.current_device()) \
            if mesh.device_type == "cuda" else torch.device("cpu")
        model.to(device)
        sch = slapo.create_schedule(model, mesh=mesh)
        cut_layers(sch, args.layers, n_cuts)
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, **kw)
        step_s, loss = time_steps(tm, make_batch(args, device), args)
        results.append({"name": name, "step_s": step_s, "loss": loss})
        del tm
    return results


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    try:
        res = run_rank(args)
        if rank == 0:
            queue.put(res)
    finally:
        leave_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(args, world: int, base: tuple[float, float], results: list[dict]) -> dict:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    rows = [{"name": "1 process (baseline)", "step_s": base[0], "loss": base[1]}] + results
    for r in rows:
        r["ratio"] = r["step_s"] / base[0]
        r["speedup"] = base[0] / r["step_s"]
    print(f"\nGPT-2 L={args.layers} h={args.hidden} seq={args.seq} global batch={args.batch}, "
          f"{world} ranks, device={device}, {args.threads} thread(s)/rank, "
          f"median of {args.steps} steps")
    print(f"{'configuration':<36}{'step (ms)':>11}{'ratio':>8}{'speedup':>9}{'loss':>9}")
    for r in rows:
        print(f"{r['name']:<36}{r['step_s'] * 1e3:>11.1f}{r['ratio']:>8.2f}"
              f"{r['speedup']:>9.2f}{r['loss']:>9.4f}")
    out = {"device": device, "world": world, "torch": torch.__version__,
           "args": vars(args), "results": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.json}")
    return out


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(seconds=120))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        rank, world = dist.get_rank(), dist.get_world_size()
        base = baseline(args) if rank == 0 else (0.0, 0.0)
        dist.barrier()
        results = run_rank(args)
        leave_process_group()
        return report(args, world, base, results) if rank == 0 else None
    base = baseline(args)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args.world, port, args, queue))
             for r in range(args.world)]
    for p in procs:
        p.start()
    results = None
    while results is None:
        try:
            results = queue.get(timeout=5)
        except Exception:  # noqa: BLE001 - queue.Empty: check that the ranks are still alive
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit("a rank failed; see its traceback above") from None
    for p in procs:
        p.join(timeout=60)
    return report(args, args.world, base, results)


if __name__ == "__main__":
    main()
