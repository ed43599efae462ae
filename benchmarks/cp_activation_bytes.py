"""Activation bytes per rank under context parallelism: exact CPU bytes of every tensor one
forward of a LLaMA-shaped model saves for its backward (parameters excluded), at cp = the
number of ranks, for each `cp_attention` choice.

Run it once per degree (gloo on CPU; cp=1 is the model as HF runs it, unscheduled):

    python benchmarks/cp_activation_bytes.py --seq 2048
    torchrun --nproc-per-node 2 benchmarks/cp_activation_bytes.py --seq 2048
    torchrun --nproc-per-node 4 benchmarks/cp_activation_bytes.py --seq 2048

Bytes are counted per storage (`saved_tensors_hooks`; views of one storage count once), on
the rank holding the most, and printed as one JSON line per attention choice. What it shows:
every per-token activation is 1/cp of cp=1's; the all-gather choice also keeps each layer's
gathered K/V (the whole sequence's KV heads) for its backward, the ring keeps only its own
block's. Docs: docs/benchmarks.md ("Context parallelism").
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def _model(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=int(hidden * 8 / 3),
                      vocab_size=vocab, max_position_embeddings=1 << 16)
    return LlamaForCausalLM(cfg)


def saved_bytes(model: torch.nn.Module, batch: dict) -> int:
    """Bytes of the storages one forward (with the loss) saves for backward, parameters out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    del loss
    return sum(seen.values())


def measure(args: argparse.Namespace, mode: str | None) -> int:
    """This rank's saved bytes (`mode` None: cp=1, HF's own attention)."""
    import slapo
    from slapo.runtime.context_parallel import cp_batch
    from slapo.runtime.mesh import MeshInfo, ParallelDims, init_mesh

    model = _model(args.hidden, args.layers, args.heads, args.kv_heads, args.vocab)
    ids = torch.randint(0, args.vocab, (1, args.seq), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    if mode is None:
        return saved_bytes(model, batch)
    mesh = init_mesh(dims=ParallelDims(cp=int(os.environ["WORLD_SIZE"]), device="cpu"))
    sch = slapo.create_schedule(model, mesh=mesh)
    slapo.model_schedule.apply(sch, cp_attention=mode)
    info = MeshInfo.of(mesh)
    local = cp_batch(batch, info.cp, info.cp_rank)
    n = float((local["labels"] != -100).sum())
    local["num_items_in_batch"] = torch.tensor(n)
    return saved_bytes(model, local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    args = parser.parse_args()
    cp = int(os.environ.get("WORLD_SIZE", "1"))
    for mode in ((None,) if cp == 1 else ("allgather", "ring")):
        mine = torch.tensor([measure(args, mode)], dtype=torch.float64)
        if cp > 1:
            dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"cp": cp, "cp_attention": mode or "hf", "seq": args.seq,
                              "hidden": args.hidden, "layers": args.layers,
                              "max_rank_saved_bytes": int(mine.item())}), flush=True)


if __name__ == "__main__":
    main()
