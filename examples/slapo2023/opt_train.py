"""OPT training written the Slapo 2023 way ("Slapo-ZeRO3": the schedule under DeepSpeed ZeRO).

2023 names used: `model_schedule.apply_schedule(model, "opt", model_config=..., prefix="model",
group=..., attn_op_name=..., ckpt_ratio=..., checkpoint_method=..., delay_init=...)`,
`slapo.Verify(sch, [...], eval_mode=True)` around the schedule step,
`slapo.init_empty_weights(enable=...)`, `slapo.build(sch, target="deepspeed", config=ds_config,
init_weights=model._init_weights)` with the DeepSpeed config dict (ZeRO stage, optimizer
section), and the DeepSpeed engine loop `loss = model(...).loss; model.backward(loss);
model.step()`, `slapo.get_logger(...).info(..., ranks=0)`. See docs/migrating.md.

As in 2023's ZeRO-3 runs the schedule has no tensor parallelism: each rank is its own TP group
of one (made the 2023 way, `dist.new_group` over consecutive ranks), and DeepSpeed shards
parameters, gradients and optimizer state over the whole world. Every rank reads its own slice
of the global batch (data parallel); the logged loss is this rank's.

DeepSpeed on CPU: set `DS_ACCELERATOR=cpu` before it is first imported (done here when no GPU
is visible), and launch with torchrun (DeepSpeed reads `LOCAL_RANK`), one process too:

    torchrun --nproc-per-node 2 examples/slapo2023/opt_train.py --zero-stage 3     # gloo on CPU
    torchrun --nproc-per-node 1 examples/slapo2023/opt_train.py
"""

from __future__ import annotations

import argparse
import contextlib
import os

import torch
import torch.distributed as dist

import slapo
from slapo.model_schedule import apply_schedule

logger = slapo.get_logger("opt-2023")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--grad-clip", type=float, default=1.0, help="global grad 2-norm; 0 = off")
    p.add_argument("--ckpt-ratio", type=float, default=0.5)
    p.add_argument("--checkpoint-method", default="uniform")
    p.add_argument("--attn-op-name", default="cuda")
    p.add_argument("--delay-init", type=int, default=0)
    p.add_argument("--verify", type=int, default=1)
    args = p.parse_args(argv)
    if args.verify and args.delay_init:
        p.error("--verify 1 compares real weights; pass --delay-init 0 (or --verify 0)")
    return args


def init_dist() -> tuple[int, int]:
    """torchrun's world (DeepSpeed needs its environment); (world size, rank)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed's first import
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun: DeepSpeed needs its environment "
                         "(torchrun --nproc-per-node 1 examples/slapo2023/opt_train.py)")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_world_size(), dist.get_rank()


def create_tp_group(tp: int):
    """2023: consecutive ranks form a TP group; every rank creates every group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + tp))) for s in range(0, world, tp)]
    return groups[rank // tp]


def get_model(args: argparse.Namespace):
    """A tiny OPT (ReLU FF, pre-LN) from its config: nothing downloads."""
    from transformers import OPTConfig, OPTForCausalLM

    config = OPTConfig(vocab_size=args.vocab, hidden_size=args.hidden, ffn_dim=args.ffn,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       max_position_embeddings=args.seq, word_embed_proj_dim=args.hidden,
                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                       layerdrop=0.0, use_cache=False, pad_token_id=1)
    torch.manual_seed(2013)  # every rank builds the same weights
    with slapo.init_empty_weights(enable=bool(args.delay_init)):
        model = OPTForCausalLM(config)
    return config, model


def ds_config(args: argparse.Namespace, world: int) -> dict:
    """2023's DeepSpeed config: ZeRO stage, batch sizes, its own optimizer section.

    `gradient_clipping` is spelled out: DeepSpeed's default for a config without it changed
    between releases (0 = off in 2023's, 1.0 in recent ones), so a script that relies on the
    default trains differently depending on the installed DeepSpeed."""
    return {
        "train_batch_size": args.micro_batch * world,
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 0.0,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.zero_stage},
        "gradient_clipping": args.grad_clip,
        "steps_per_print": 10**9,
    }


def get_batch(args: argparse.Namespace, world: int, rank: int) -> torch.Tensor:
    """This rank's slice of one global batch (the same global batch on every launch)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, args.vocab, (args.micro_batch * world, args.seq), generator=g)
    return ids[rank * args.micro_batch:(rank + 1) * args.micro_batch]


def schedule(model, config, args: argparse.Namespace, ids: torch.Tensor, group):
    """2023: verify by entering Verify, then applying the schedule inside it."""
    verify = (slapo.Verify(slapo.create_schedule(model, group=group), [ids], eval_mode=True)
              if args.verify else contextlib.nullcontext())
    with verify:
        sch = apply_schedule(model, "opt", model_config=config, prefix="model", group=group,
                             attn_op_name=args.attn_op_name, ckpt_ratio=args.ckpt_ratio,
                             checkpoint_method=args.checkpoint_method,
                             delay_init=bool(args.delay_init))
    if args.verify:
        logger.info("Verify: the scheduled OPT matches the unscheduled one", ranks=0)
    return sch


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    world, rank = init_dist()
    config, model = get_model(args)
    ids = get_batch(args, world, rank)
    sch = schedule(model, config, args, ids, create_tp_group(1))
    model, _ = slapo.build(sch, target="deepspeed", config=ds_config(args, world),
                           init_weights=model._init_weights)
    losses = []
    for step in range(args.steps):
        loss = model(input_ids=ids, labels=ids).loss
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        logger.info(f"step {step} loss {losses[-1]:.4f} (world {world}, "
                    f"ZeRO-{args.zero_stage})", ranks=0)
    return losses


if __name__ == "__main__":
    try:
        main()
    finally:  # the 2023 way out; under gloo it lets the worker threads finish (leave_process_group)
        slapo.cleanup()
