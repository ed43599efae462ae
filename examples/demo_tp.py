"""Schedule a Hugging Face BERT for tensor parallelism + checkpointing, and prove it correct.

    torchrun --nproc-per-node 2 examples/demo_tp.py

The model definition is untouched: the schedule shards attention and MLP Megatron-style,
checkpoints one layer, and `slapo.Verify` compares outputs, every gradient and one optimizer
step against the original model. Then a few training steps run on the scheduled model.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import BertConfig, BertModel  # noqa: E402

import slapo  # noqa: E402
from slapo.distributed.group import leave_process_group  # noqa: E402


def log(*args) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def tensor_parallel(sch: slapo.Schedule) -> None:
    """Megatron-style TP for every BERT layer: column-parallel q/k/v and FFN-in, row-parallel
    attention-out and FFN-out, with the matching collectives."""
    for layer in sch["encoder.layer"]:
        attn = layer["attention.self"]
        for name in ("query", "key", "value"):
            attn[name].shard(["weight", "bias"], axis=0)
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        out = layer["attention.output.dense"]
        out.shard("weight", axis=1)
        out.sync(mode="fwd_post", sync_op_or_fn="all_reduce")   # bias added once, after the sum
        layer["intermediate.dense"].shard(["weight", "bias"], axis=0)
        layer["intermediate.dense"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        layer["output.dense"].shard("weight", axis=1)
        layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")


def main() -> None:
    # the job's mesh (one process, or every torchrun rank as tensor-parallel): slapo.init_mesh
    mesh = slapo.init_mesh(dp=1, tp=int(os.environ.get("WORLD_SIZE", "1")), device="cpu")
    torch.manual_seed(0)  # every rank builds the same model
    config = BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=1024, vocab_size=1024, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config)
    n_params = sum(p.numel() for p in model.parameters())
    input_ids = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator()
                              .manual_seed(1))
    sch = slapo.create_schedule(model, mesh=mesh)
    log(f"BertModel: {n_params / 1e6:.2f} M parameters, tensor-parallel size {sch.tp_size}")

    def loss_fn(out):
        return out.last_hidden_state.pow(2).mean()

    t0 = time.perf_counter()
    with slapo.Verify(sch, example_inputs=[input_ids], loss_fn=loss_fn) as check:
        tensor_parallel(sch)
        sch["encoder.layer.1"].checkpoint()
    log("\nSchedule (only scheduled modules shown):")
    log(sch.tree(only_scheduled=True))
    grads = [v for k, v in check.report.items() if k.startswith("grad ")]
    outs = [v for k, v in check.report.items() if k.startswith("output")]
    log(f"\nVerified in {time.perf_counter() - t0:.1f} s: {len(outs)} outputs, {len(grads)} "
        f"parameter gradients and {len(grads)} parameters after one optimizer step match the "
        f"original model (max abs error {max(check.report.values()):.2e}).")

    local = sum(p.numel() for p in model.parameters())
    log(f"Parameters held by this rank: {local / 1e6:.2f} M of {n_params / 1e6:.2f} M")
    model, optimizer = slapo.build(sch, optimizer=torch.optim.AdamW,
                                   optimizer_kwargs={"lr": 1e-3})
    for step in range(5):
        optimizer.zero_grad()
        loss = loss_fn(model(input_ids))
        loss.backward()
        optimizer.step()
        log(f"step {step}: loss {loss.item():.5f}")
    leave_process_group()


if __name__ == "__main__":
    main()
