"""CUDA microbenchmark: what Tempo costs and saves on one BERT-large layer (issue 14, item 4).

One HF `BertLayer` (h 1024, 16 heads, FFN 4096), bf16 autocast over fp32 weights, batch x seq
32 x 512 by default, forward + backward, with and without Tempo, eager and inside a
`torch.compile`'d layer. Per variant: median fwd+bwd time, peak memory above the layer's input
(`max_memory_allocated` after `reset_peak_memory_stats`), memory held between forward and backward
(the activations), and the overhead against the same mode without Tempo. Tempo's fused kernels
can be switched to the PyTorch reference (`--reference`) to see what the kernels buy.

    PYTHONPATH=. python benchmarks/tempo_gpu.py --out tempo_gpu.json
    PYTHONPATH=. python benchmarks/tempo_gpu.py --dropout 0.1 --attention eager

Prints a table, writes JSON (rows are appended as they finish). CUDA only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch


def _layer(attention: str, dropout: float):
    import transformers

    cfg = transformers.BertConfig(hidden_size=1024, num_attention_heads=16,
                                  intermediate_size=4096, hidden_dropout_prob=dropout,
                                  attention_probs_dropout_prob=dropout,
                                  attn_implementation=attention)
    return transformers.models.bert.modeling_bert.BertLayer(cfg).cuda().train()


def _step(layer, x, g):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(g)


def _measure(layer, x, g, iters: int) -> dict:
    for _ in range(3):  # warm-up (and compilation)
        _step(layer, x, g)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _step(layer, x, g)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    out.backward(g)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"ms": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
            "activations_mib": held / 2**20, "peak_mib": peak / 2**20}


def run(args) -> list[dict]:
    from slapo.op import apply_tempo_to_module

    torch.manual_seed(0)
    base = _layer(args.attention, args.dropout)
    x = torch.randn(args.batch, args.seq, 1024, device="cuda", requires_grad=True)
    g = torch.randn(args.batch, args.seq, 1024, device="cuda")
    rows = []
    modes = ["eager"] + ([] if args.no_compile else ["compiled"])
    for mode in modes:
        for tempo in (False, True):
            layer = apply_tempo_to_module(copy.deepcopy(base)) if tempo else copy.deepcopy(base)
            if mode == "compiled":
                torch._dynamo.reset()
                layer = torch.compile(layer)
            t0 = time.perf_counter()
            row = {"mode": mode, "tempo": tempo, **_measure(layer, x, g, args.iters)}
            row["wall_s"] = time.perf_counter() - t0
            ref = next((r for r in rows if r["mode"] == mode and not r["tempo"]), None)
            if ref is not None:
                row["overhead"] = row["ms"] / ref["ms"] - 1
                row["activations_saved_mib"] = ref["activations_mib"] - row["activations_mib"]
                row["peak_saved_mib"] = ref["peak_mib"] - row["peak_mib"]
            rows.append(row)
            _print_row(row)
            _write(args.out, args, rows)
            del layer
            torch.cuda.empty_cache()
    return rows


def _print_row(r: dict) -> None:
    extra = ""
    if "overhead" in r:
        extra = (f"  overhead {100 * r['overhead']:+.1f}%  activations -{r['activations_saved_mib']:.0f}"
                 f" MiB  peak -{r['peak_saved_mib']:.0f} MiB")
    print(f"{r['mode']:9s} tempo={'on ' if r['tempo'] else 'off'}  {r['ms']:8.2f} ms  "
          f"activations {r['activations_mib']:8.1f} MiB  peak {r['peak_mib']:8.1f} MiB{extra}",
          flush=True)


def _write(path: str | None, args, rows: list[dict]) -> None:
    if not path:
        return
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "batch": args.batch, "seq": args.seq, "dropout": args.dropout,
            "attention": args.attention, "reference_kernels": args.reference}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--reference", action="store_true", help="Tempo's PyTorch reference kernels")
    p.add_argument("--out", default=None, help="JSON output path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tempo_gpu.py needs CUDA", file=sys.stderr)
        return 2
    if args.reference:
        os.environ["SLAPO_TEMPO_TRITON"] = "0"
    print(f"BERT-large layer, {args.batch}x{args.seq}, bf16 autocast, dropout {args.dropout}, "
          f"attention {args.attention}, {torch.cuda.get_device_name()}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
