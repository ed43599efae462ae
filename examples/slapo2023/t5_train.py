"""T5 training written the Slapo 2023 way (as a 2023 user's script looks), TP over the world.

2023 names used: `model_schedule.apply_schedule(model, "t5", model_config=..., attn_op_name=...,
ckpt_ratio=..., checkpoint_method=..., bcast_input=..., delay_init=...)` (2023's T5 schedule
takes no `prefix`: encoder and decoder hang off the model itself), `slapo.Verify(sch, [...],
eval_mode=True, enable=...)` around the schedule step, `slapo.init_empty_weights(enable=...)`,
`slapo.build(sch, init_weights=model._init_weights)` on the native target, `slapo.set_random_seed
(seed, dp_rank, pp_rank, tp_rank)` after build, `slapo.get_logger(...).info(..., ranks=0)`.
See docs/migrating.md for what each does here.

The tensor-parallel group is the whole world (2023: `group=None` meant the default group), so
every rank holds 1/world of every attention head set, FF width and the shared vocabulary.
`--verify 1` (the default; needs `--delay-init 0`, real weights to compare) checks the scheduled
model's outputs and gradients against the unscheduled one before training.

    python examples/slapo2023/t5_train.py --steps 5                      # one process (CPU)
    torchrun --nproc-per-node 2 examples/slapo2023/t5_train.py           # TP=2 over gloo/NCCL
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

import slapo
from slapo.model_schedule import apply_schedule

logger = slapo.get_logger("t5-2023")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--d-ff", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32, help="encoder length")
    p.add_argument("--dec-seq", type=int, default=16, help="decoder length (2023: 512 vs 1024)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-ratio", type=float, default=0.5)
    p.add_argument("--checkpoint-method", default="uniform")
    p.add_argument("--attn-op-name", default="cuda")
    p.add_argument("--delay-init", type=int, default=0)
    p.add_argument("--verify", type=int, default=1)
    args = p.parse_args(argv)
    if args.verify and args.delay_init:
        p.error("--verify 1 compares real weights; pass --delay-init 0 (or --verify 0)")
    return args


def init_dist() -> int:
    """Join torchrun's ranks when launched by it; the world is one rank otherwise."""
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1


def get_model(args: argparse.Namespace):
    """A tiny T5 v1 (ReLU FF, untied `wi`) from its config: nothing downloads."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=args.vocab, d_model=args.d_model, d_kv=args.d_model // args.heads,
                      d_ff=args.d_ff, num_layers=args.layers, num_decoder_layers=args.layers,
                      num_heads=args.heads, dropout_rate=0.0, use_cache=False,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(2013)  # every rank builds the same weights
    with slapo.init_empty_weights(enable=bool(args.delay_init)):
        model = T5ForConditionalGeneration(config)
    return config, model


def get_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """The same synthetic batch on every rank (TP ranks must see the same tokens)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, args.vocab, (args.batch, args.seq), generator=g)
    labels = torch.randint(2, args.vocab, (args.batch, args.dec_seq), generator=g)
    return {"input_ids": ids, "labels": labels}


def schedule(model, config, args: argparse.Namespace, batch: dict):
    """2023: verify by entering Verify, then applying the schedule inside it."""
    verify = (slapo.Verify(slapo.create_schedule(model), example_kwargs=batch, eval_mode=True)
              if args.verify else contextlib.nullcontext())
    with verify:
        sch = apply_schedule(model, "t5", model_config=config, attn_op_name=args.attn_op_name,
                             ckpt_ratio=args.ckpt_ratio,
                             checkpoint_method=args.checkpoint_method,
                             delay_init=bool(args.delay_init))
    if args.verify:
        logger.info("Verify: the scheduled T5 matches the unscheduled one", ranks=0)
    return sch


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    world = init_dist()
    rank = dist.get_rank() if dist.is_initialized() else 0
    config, model = get_model(args)
    batch = get_batch(args)
    sch = schedule(model, config, args, batch)
    model, _ = slapo.build(sch, init_weights=model._init_weights)
    mine = sum(p.numel() for p in model.parameters())
    logger.info(f"TP={sch.tp_size}: rank {rank} holds {mine} parameters", ranks=0)
    slapo.set_random_seed(2013, 0, 0, rank)  # 2023: seed after build (dp, pp, tp ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        logger.info(f"step {step} loss {losses[-1]:.4f} (world {world})", ranks=0)
    return losses


if __name__ == "__main__":
    try:
        main()
    finally:  # the 2023 way out; under gloo it lets the worker threads finish (leave_process_group)
        slapo.cleanup()
