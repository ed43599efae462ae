"""WideResNet training step: unscheduled vs `model_schedule.apply` checkpointing and channel TP.

    python benchmarks/wideresnet.py [--device cpu|cuda] [--tp 2] [--out wideresnet.json]

The model is the torchvision-layout WideResNet of `tests/vision_models.py` (imported by path,
as `examples/slapo2023/wideresnet_train.py` does: one definition of the layout, which the
tests check against torchvision's module names; torchvision itself cannot be installed beside a
CPU torch), small by default (`--base-planes 16`, width x2 as wide_resnet50_2, layers 2/2/2/2,
64x64 images) so the whole run takes well under 90 s on 2 CPU cores. A step is
`slapo.build(...)`'s `model.train_step(batch)`: forward, cross-entropy, backward, SGD step.

Rows (every one built from the same seed, trained on the same batch):

* `unscheduled`, `ckpt 0.5`, `ckpt 1.0`: one process (`--threads` threads), `apply(model,
  ckpt_ratio=r)`; with `--compile BACKEND` also `compiled` (`compile_blocks=BACKEND`: every
  block its own graph) and `compiled + SAC 1.0` (with selective checkpointing in every block);
* `tp=2`: `apply(model, tp=2)` on `--tp` ranks that the benchmark spawns itself with
  torch.multiprocessing (gloo on CPU, NCCL on CUDA when there are that many GPUs; else the row
  is skipped with a note). Each rank runs 1 thread and computes the whole batch (TP splits
  channels, not samples), so images/s is the global batch over the slowest rank's step time,
  and saved bytes are *per rank*. Spawning (not torchrun) keeps it one command; decided here.

Columns: images/s (median step over `--rounds` rounds of `--steps` steps, the one-process
variants alternating within each round so a slow phase of a shared VM hits all of them);
saved MiB (`slapo.profile.saved_bytes` of one training-mode forward, parameters and BN buffers
excluded: the activation memory the schedule changes); peak MiB (CUDA only: one step's peak
above what was allocated before it, `slapo.profile.meter`); `loss ok` (the first step's loss
equals the unscheduled model's within 1e-4 relative: the schedule did not change the math).
Absolute numbers on a shared CPU are noise; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import slapo  # noqa: E402
from slapo import model_schedule  # noqa: E402
from slapo.distributed.group import leave_process_group  # noqa: E402
from slapo.profile import meter, saved_bytes  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
ONE_PROCESS = {"unscheduled": None, "ckpt 0.5": {"ckpt_ratio": 0.5},
               "ckpt 1.0": {"ckpt_ratio": 1.0}}
ROW_KEYS = ("variant", "knobs", "ranks", "threads", "images_per_s", "step_s", "saved_bytes",
            "peak_bytes", "loss", "loss_ok", "speedup", "saved_ratio", "times")


def vision_models():
    """`tests/vision_models.py`, loaded by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("vision_models", ROOT / "tests" /
                                                  "vision_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def make_model(args) -> torch.nn.Module:
    """The WideResNet under the 2023 loss wrapper (`forward(x, labels)` -> {"loss": ...})."""
    vm = vision_models()
    layers = tuple(int(v) for v in args.layers.split(","))
    net = vm.wide_resnet(args.width, layers, args.classes, base_planes=args.base_planes, seed=0)
    return vm.ResNetWithLoss(net)


def make_batch(args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, 3, args.image, args.image, generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    return {"x": x.to(device), "labels": y.to(device)}


def _loss(out: dict, batch: dict) -> torch.Tensor:
    return out["loss"]


def scheduled(model, knobs: dict | None, mesh=None):
    """(schedule, wrapped model): `apply(**knobs)`, or the model as written when None."""
    sch = slapo.create_schedule(model, mesh=mesh) if mesh is not None \
        else slapo.create_schedule(model)
    if knobs is not None:
        model_schedule.apply(sch, **knobs)
    return sch


def forward_saved_bytes(module, batch: dict) -> int:
    """Bytes one training-mode forward saves for backward; the BN running statistics this
    extra forward updates are restored, so every variant trains from the same state."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    n = saved_bytes(lambda b: module(**b), batch, exclude=[module])
    with torch.no_grad():
        for k, b in module.named_buffers():
            b.copy_(buffers[k])
    return n


def one_step(tm, batch, device: torch.device) -> tuple[float, float]:
    """(seconds, loss) of one `train_step`."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = tm.train_step(batch)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, float(loss)


def peak_of_step(tm, batch, device: torch.device) -> int | None:
    """CUDA peak of one step above what is allocated before it (None on CPU: the RSS meter
    there hides activations behind the allocator's reuse)."""
    if device.type != "cuda":
        return None
    before = torch.cuda.memory_allocated(device)
    meter.reset_peak(device)
    one_step(tm, batch, device)
    return meter.peak_bytes(device) - before


class Variant:
    """One built model: its row, and the state needed to time it."""

    def __init__(self, name: str, knobs, args, device, mesh=None):
        model = make_model(args).to(device)
        sch = scheduled(model, knobs, mesh)
        self.batch = make_batch(args, device)
        self.saved = forward_saved_bytes(sch.mod, self.batch)
        self.tm, _ = slapo.build(sch, mesh=mesh, optimizer=torch.optim.SGD,
                                 optimizer_kwargs={"lr": 0.01}, loss_fn=_loss)
        self.device, self.name, self.knobs, self.times = device, name, knobs, []
        _, self.loss = one_step(self.tm, self.batch, device)  # first step: the loss checked
        for _ in range(args.warmup):
            one_step(self.tm, self.batch, device)
        self.peak = peak_of_step(self.tm, self.batch, device)

    def time(self, steps: int) -> None:
        self.times += [one_step(self.tm, self.batch, self.device)[0] for _ in range(steps)]

    def row(self, args, ranks: int, threads: int, step_s: float | None = None) -> dict:
        step_s = statistics.median(self.times) if step_s is None else step_s
        return {"variant": self.name, "knobs": self.knobs, "ranks": ranks, "threads": threads,
                "images_per_s": args.batch / step_s, "step_s": step_s,
                "saved_bytes": self.saved, "peak_bytes": self.peak, "loss": self.loss,
                "times": self.times}


def one_process_variants(args) -> dict[str, dict | None]:
    """The one-process rows: `ONE_PROCESS`, and with `--compile BACKEND` every block compiled
    (alone, and with selective checkpointing in every block)."""
    rows = dict(ONE_PROCESS)
    if args.compile:
        rows["compiled"] = {"compile_blocks": args.compile}
        rows["compiled + SAC 1.0"] = {"compile_blocks": args.compile, "ckpt_ratio": 1.0,
                                      "ckpt_policy": "selective"}
    return rows


def run_one_process(args, device: torch.device) -> list[dict]:
    torch.set_num_threads(args.threads)
    variants = [Variant(n, k, args, device) for n, k in one_process_variants(args).items()]
    for _ in range(args.rounds):
        for v in variants:
            v.time(args.steps)
    return [v.row(args, 1, args.threads) for v in variants]


# ---- tensor parallelism on spawned ranks ------------------------------------------------------

def run_tp_rank(args) -> dict:
    """`apply(tp=...)` on this rank (process group up); the slowest rank's median step."""
    from slapo.runtime import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dp=1, pp=1, tp=args.tp)
    device = torch.device("cuda", torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device("cpu")
    v = Variant(f"tp={args.tp}", {"tp": args.tp}, args, device, mesh)
    for _ in range(args.rounds):
        dist.barrier()
        v.time(args.steps)
    t = torch.tensor([statistics.median(v.times)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    saved = torch.tensor([v.saved], dtype=torch.float64, device=device)
    dist.all_reduce(saved, op=dist.ReduceOp.MAX)
    row = v.row(args, args.tp, 1, step_s=float(t))
    row["saved_bytes"] = int(saved.item())  # per rank (the ranks' shards are equal; max)
    return row


def _tp_worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    backend = "nccl" if args.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, timeout=timedelta(seconds=300))
    try:
        row = run_tp_rank(args)
        if rank == 0:
            queue.put(row)
    finally:
        leave_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(args) -> dict | None:
    """Spawn `--tp` ranks; None (with a note) when CUDA has fewer GPUs than ranks."""
    if args.tp < 2:
        return None
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        print(f"tp={args.tp} skipped: {torch.cuda.device_count()} GPU(s); NCCL needs one per rank")
        return None
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_tp_worker, args=(args.tp, _free_port(), args, queue), nprocs=args.tp,
                       join=True, start_method="spawn")
    return queue.get(timeout=10)


# ---- report -----------------------------------------------------------------------------------

def finish_rows(rows: list[dict]) -> list[dict]:
    """Ratios against the first row (unscheduled) and the loss check."""
    base = rows[0]
    for r in rows:
        r["speedup"] = r["images_per_s"] / base["images_per_s"]
        r["saved_ratio"] = r["saved_bytes"] / max(base["saved_bytes"], 1)
        r["loss_ok"] = abs(r["loss"] - base["loss"]) <= 1e-4 * abs(base["loss"]) + 1e-6
    return rows


def print_table(rows: list[dict], title: str) -> None:
    print(f"\n{title}")
    head = f"{'variant':<19}{'ranks x thr':>12}{'images/s':>10}{'speedup':>9}" \
           f"{'saved MiB':>11}{'saved vs base':>15}{'peak MiB':>10}{'loss ok':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.1f}"
        print(f"{r['variant']:<19}{r['ranks']:>7} x {r['threads']:<2}"
              f"{r['images_per_s']:>10.1f}{r['speedup']:>8.2f}x"
              f"{r['saved_bytes'] / 2**20:>11.2f}{r['saved_ratio']:>14.2f}x{peak:>10}"
              f"{'yes' if r['loss_ok'] else 'NO':>9}")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--width", type=int, default=128, help="width_per_group (128 = x2)")
    ap.add_argument("--base-planes", type=int, default=16, help="64 = torchvision's sizes")
    ap.add_argument("--layers", default="2,2,2,2", help="blocks of layer1..layer4")
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--image", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="threads of the one-process rows (1: robust on a shared CPU, where "
                         "OpenMP threads oversubscribed by other jobs stall for seconds)")
    ap.add_argument("--tp", type=int, default=2, help="TP ranks to spawn (0: no TP row)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="add rows with every block compiled by this torch.compile backend "
                         "(inductor on a GPU; compiling takes a minute on a CPU)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda, but torch sees no CUDA device (use --device cpu)")
    return args


def main(argv=None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows = run_one_process(args, device)
    tp_row = run_tp(args)
    rows = finish_rows(rows + ([tp_row] if tp_row else []))
    name = device_name(device)
    print_table(rows, f"WideResNet width {args.width} base {args.base_planes} layers "
                      f"{args.layers}, {args.image}px, batch {args.batch}, {name}, "
                      f"torch {torch.__version__}")
    out = {"args": vars(args), "torch": torch.__version__, "device": name, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
        print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
