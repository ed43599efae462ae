"""GPT-2 training written the Slapo 2023 way (as a 2023 user's script looks), run natively.

2023 names used: `slapo.init_empty_weights(enable=...)`, `model_schedule.apply_schedule(model,
"gpt2", model_config=..., prefix=..., attn_op_name=..., ckpt_ratio=..., checkpoint_method=...)`,
`slapo.build(sch, init_weights=model._init_weights)`, `slapo.set_random_seed(seed, dp_rank,
pp_rank, tp_rank)` after build, `slapo.get_logger(...).info(..., ranks=0)`,
`slapo.utils.report.report_memory`. See docs/migrating.md for what each does here.

    python examples/slapo2023/gpt2_train.py --steps 5                    # one process (CPU)
    torchrun --nproc-per-node 2 examples/slapo2023/gpt2_train.py         # TP=2 over gloo/NCCL
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import slapo
from slapo.model_schedule import apply_schedule
from slapo.utils.report import report_memory

logger = slapo.get_logger("gpt2-2023")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-ratio", type=float, default=0.5)
    p.add_argument("--checkpoint-method", default="uniform")
    p.add_argument("--attn-op-name", default="cuda")
    p.add_argument("--delay-init", type=int, default=1)
    return p.parse_args(argv)


def init_dist() -> int:
    """Join torchrun's ranks when launched by it; the world is one rank otherwise."""
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    world = init_dist()
    rank = dist.get_rank() if dist.is_initialized() else 0
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                        vocab_size=args.vocab, n_positions=args.seq, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(2013)
    with slapo.init_empty_weights(enable=bool(args.delay_init)):
        model = GPT2LMHeadModel(config)
    sch = apply_schedule(model, "gpt2", model_config=config, prefix="transformer",
                         attn_op_name=args.attn_op_name, ckpt_ratio=args.ckpt_ratio,
                         checkpoint_method=args.checkpoint_method,
                         delay_init=bool(args.delay_init))
    model, _ = slapo.build(sch, init_weights=model._init_weights)
    slapo.set_random_seed(2013, 0, 0, rank)  # 2023: seed after build (dp, pp, tp ranks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data)
    losses = []
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        logger.info(f"step {step} loss {losses[-1]:.4f} (world {world})", ranks=0)
    if rank == 0:
        report_memory("after training")
    return losses


if __name__ == "__main__":
    try:
        main()
    finally:  # the 2023 way out; under gloo it lets the worker threads finish (leave_process_group)
        slapo.cleanup()
