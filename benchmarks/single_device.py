"""HF eager vs Slapo-scheduled training throughput on one device (GPT-2, BERT, LLaMA configs).

    python benchmarks/single_device.py [--models gpt2,bert,llama] [--out results.json]

For each model: the unmodified HF model with eager attention, then the scheduled model
(`model_schedule.apply` with SDPA attention, fused MLP activation, Tempo layers), each verified
against the baseline (outputs, gradients, one optimizer step). Reports tokens/s, the ratio
within this run, and saved-activation bytes. On a GPU it runs in bf16 and reports MFU against a
matmul peak measured on the spot. Absolute numbers on a shared CPU VM are noise; the ratios
within one run are what to read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from slapo import progressive  # noqa: E402

CONFIGS = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=256, n_layer=4, n_head=8,
                                                    vocab_size=2048, n_positions=512,
                                                    bos_token_id=0, eos_token_id=0)),
    "bert": ("BertConfig", "BertForMaskedLM", dict(hidden_size=256, num_hidden_layers=4,
                                                   num_attention_heads=8,
                                                   intermediate_size=1024, vocab_size=2048,
                                                   max_position_embeddings=512)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(hidden_size=256, num_hidden_layers=4,
                                                      num_attention_heads=8,
                                                      num_key_value_heads=4,
                                                      intermediate_size=704, vocab_size=2048,
                                                      max_position_embeddings=512,
                                                      bos_token_id=0, eos_token_id=0,
                                                      pad_token_id=0)),
}


def make_factory(name: str, dropout_free: bool = True):
    import transformers

    cfg_name, model_name, kw = CONFIGS[name]
    cfg = getattr(transformers, cfg_name)(**kw)
    for attr in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop",
                 "embd_pdrop", "attn_pdrop"):
        if dropout_free and hasattr(cfg, attr):
            setattr(cfg, attr, 0.0)

    def make():
        torch.manual_seed(0)
        return getattr(transformers, model_name)(cfg)

    return make, cfg


def train_flops_per_token(model: torch.nn.Module, cfg, seq: int) -> float:
    """Model FLOPs of one training token: 6 x (non-embedding parameters) for the GEMMs
    (forward 2, backward 4) plus the attention scores and context, 12 x layers x hidden x seq
    (the usual MFU convention; recomputation from checkpointing is not counted as useful)."""
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    params = sum(p.numel() for p in model.parameters()) - emb
    layers = getattr(cfg, "num_hidden_layers", None) or cfg.n_layer
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    return 6 * params + 12 * layers * hidden * seq


def matmul_peak_flops(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,bert,llama")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--fuse-compiler", default="inductor")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternate baseline/scheduled this many times; report medians (the "
                         "shared VM has slow phases lasting seconds)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    console = Console(width=120)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else None       # bf16 autocast on GPU, fp32 on CPU
    peak = matmul_peak_flops(device, dtype or torch.float32) if on_gpu else None
    rows = []
    for name in args.models.split(","):
        make, cfg = make_factory(name)
        g = torch.Generator().manual_seed(0)
        batches = []
        for _ in range(args.steps):
            ids = torch.randint(3, cfg.vocab_size, (args.batch_size, args.seq_len), generator=g)
            batches.append({"input_ids": ids, "labels": ids})
        full = {"attention": "sdpa", "fuse": True, "fuse_compiler": args.fuse_compiler,
                "tempo": True}
        steps = [progressive.Step("HF eager", {}), progressive.Step("Slapo scheduled", full)]
        rounds = [progressive.run(make, batches, steps=steps, train_steps=args.steps,
                                  device=device, autocast_dtype=dtype, log=lambda s: None)
                  for _ in range(args.rounds)]
        flops_token = train_flops_per_token(make(), cfg, args.seq_len)
        for i, r in enumerate(rounds[0]):
            row = {"model": name, **progressive.to_json([r])[0]}
            row["tokens_per_s_rounds"] = [rs[i].tokens_per_s for rs in rounds]
            row["tokens_per_s"] = statistics.median(row["tokens_per_s_rounds"])
            row["verified"] = all(rs[i].verified for rs in rounds)
            row["mfu"] = row["tokens_per_s"] * flops_token / peak if peak else None
            rows.append(row)
        base = rows[-len(steps)]["tokens_per_s"]
        for row in rows[-len(steps):]:
            row["speedup"] = row["tokens_per_s"] / base
    t = Table(title=f"single device ({platform.processor() or platform.machine()}, "
                    f"torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for c in ("model", "variant", "tokens/s", "speedup", "saved act. MiB", "memory", "MFU",
              "verified"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["model"], r["name"], f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x",
                  f"{r['saved_bytes'] / 2**20:.1f}", f"{r['memory_ratio']:.2f}x",
                  f"{r['mfu']:.1%}" if r["mfu"] is not None else "-",
                  "yes" if r["verified"] else "NO")
    console.print(t)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "peak_flops": peak,
                       "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
                       "machine": platform.machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
