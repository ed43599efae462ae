"""BERT masked-LM training written the Slapo 2023 way, run natively.

2023 names used: `slapo.model_schedule.apply_schedule(model, "bert", model_config=...,
prefix="bert", attn_op_name=..., ckpt_ratio=..., checkpoint_method="head", bf16=...)`,
`slapo.Verify(sch, [inputs], eval_mode=True)` around a hand-written TP schedule step,
`slapo.build(sch, init_weights=model._init_weights)`, `slapo.get_logger(...).info(ranks=0)`.

    python examples/slapo2023/bert_train.py --steps 5                    # one process (CPU)
    torchrun --nproc-per-node 2 examples/slapo2023/bert_train.py         # TP=2 over gloo/NCCL
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import slapo
from slapo.model_schedule import apply_schedule

logger = slapo.get_logger("bert-2023")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ckpt-ratio", type=float, default=1.0)
    p.add_argument("--attn-op-name", default="cutlass")
    p.add_argument("--bf16", type=int, default=0)
    return p.parse_args(argv)


def init_dist() -> int:
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size() if dist.is_initialized() else 1


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    world = init_dist()
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, intermediate_size=4 * args.hidden,
                        vocab_size=args.vocab, max_position_embeddings=args.seq,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(2013)  # every rank builds the same weights
    model = BertForMaskedLM(config)
    data = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data)
    # A 2023 schedule is verified the 2023 way: enter Verify, then apply the schedule.
    with slapo.Verify(slapo.create_schedule(model), [ids], eval_mode=True, enable=not args.bf16):
        sch = apply_schedule(model, "bert", model_config=config, prefix="bert",
                             attn_op_name=args.attn_op_name, ckpt_ratio=args.ckpt_ratio,
                             checkpoint_method="head", bf16=bool(args.bf16))
    model, _ = slapo.build(sch, init_weights=model._init_weights)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    labels = ids.clone()
    losses = []
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=labels).loss
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
