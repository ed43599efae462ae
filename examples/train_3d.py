"""Train a LLaMA-style model with tensor, pipeline and data parallelism composed on one mesh.

    torchrun --nproc-per-node 4 examples/train_3d.py                          # tp=2 x pp=2
    torchrun --nproc-per-node 4 examples/train_3d.py --dp 2 --pp 2 --tp 1 --data-parallel fsdp
    torchrun --nproc-per-node 8 examples/train_3d.py --dp 2 --pp 2 --tp 2 --data-parallel fsdp
    python examples/train_3d.py --dp 1 --pp 1 --tp 1                          # one process

`--check` also trains, on every rank, a one-process copy of the same model (the same per-path
seeds, so the same initial weights) on the same batches, and fails unless the parallel run's
losses match it: the baseline is plain PyTorch, not Slapo.

Multi-node: the same script under torchrun's rendezvous on every node, e.g. 2 nodes x 4 GPUs:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \
             --rdzv-endpoint HOST:29400 --rdzv-id myjob examples/train_3d.py --dp 2 --pp 2 --tp 2

The model is built on the meta device (no memory), scheduled (TP sharding, activation
checkpointing and pipeline cuts from `slapo.model_schedule`), and `slapo.build` materialises on
each rank only the shards of the stages it runs. The training loop is the same whatever the
parallelism: `loss = model.train_step(batch)`.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import slapo  # noqa: E402
import slapo.model_schedule  # noqa: E402
from slapo.distributed.group import leave_process_group  # noqa: E402
from slapo.runtime import init_mesh  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="3-D parallel training with Slapo")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--schedule", default="1F1B", help="GPipe, 1F1B, Interleaved1F1B, ...")
    ap.add_argument("--virtual-stages", type=int, default=None)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--data-parallel", choices=["ddp", "fsdp"], default=None)
    ap.add_argument("--ckpt-ratio", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="global batch (samples)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--check", action="store_true",
                    help="compare the losses with a one-process PyTorch run (exit 1 if not equal)")
    return ap.parse_args()


def log(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def model_config(args) -> LlamaConfig:
    return LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=2 * args.hidden, vocab_size=256,
                       max_position_embeddings=args.seq, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)


def synthetic_batches(args, device):
    """A fixed pool of random token batches, the same on every rank (`batch_is_global`)."""
    g = torch.Generator().manual_seed(0)
    pool = [torch.randint(0, 256, (args.batch, args.seq), generator=g) for _ in range(2)]
    for step in range(args.steps):
        ids = pool[step % len(pool)].to(device)
        yield {"input_ids": ids, "labels": ids}


def main() -> None:
    args = parse_args()
    mesh = init_mesh(dp=args.dp, pp=args.pp, tp=args.tp)   # also joins the torchrun job
    device = torch.device("cuda", torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device("cpu")

    with slapo.init_empty_weights():
        model = LlamaForCausalLM(model_config(args))
    pipelined = args.pp > 1
    virtual = args.virtual_stages or (2 if args.schedule in ("Interleaved1F1B", "LoopedBFS",
                                                            "InterleavedZeroBubble",
                                                            "ZBVZeroBubble", "DualPipeV") else 1)
    sch = slapo.model_schedule.apply(model, mesh=mesh, ckpt_ratio=args.ckpt_ratio,
                                     pp_stages=args.pp * virtual if pipelined else 1)
    model, _ = slapo.build(
        sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": args.lr}, seed=0,
        device=device, pipeline=args.schedule if pipelined else None,
        num_microbatches=args.microbatches if pipelined else None,
        virtual_stages=virtual if pipelined else None, data_parallel=args.data_parallel,
        grad_clip=1.0)
    log(f"mesh dp={args.dp} pp={args.pp} tp={args.tp}, pipeline="
        f"{args.schedule if pipelined else None}, data_parallel={args.data_parallel}, "
        f"device={device}")

    t0 = time.perf_counter()
    losses = []
    for step, batch in enumerate(synthetic_batches(args, device)):
        losses.append(model.train_step(batch))
        log(f"step {step:3d}  loss {losses[-1]:.4f}")
    log(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s")
    ok = check(args, device, losses) if args.check else True
    leave_process_group()
    if not ok:
        raise SystemExit(1)


def reference_losses(args, device) -> list[float]:
    """The same model, weights and batches in one process with plain PyTorch: AdamW, clipping."""
    from slapo.init import materialize

    with slapo.init_empty_weights():
        ref = LlamaForCausalLM(model_config(args))
    materialize(ref, device, seed=0)     # build's per-path seeds: the parallel run's weights
    opt = torch.optim.AdamW(ref.parameters(), lr=args.lr)
    out = []
    for batch in synthetic_batches(args, device):
        opt.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        out.append(loss.item())
    return out


def check(args, device, losses: list[float]) -> bool:
    ref = reference_losses(args, device)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
    ok = worst < 1e-4
    log(f"one-process PyTorch losses: {' '.join(f'{x:.4f}' for x in ref)}")
    log(f"check: largest relative loss difference {worst:.2e} -> {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    main()
