"""What Tempo costs and saves on one BERT layer, eager and inside a compiled layer (issue 14/4).

One HF `BertLayer` (BERT-large by default: h 1024, 16 heads, FFN 4096), forward + backward, bf16
autocast over fp32 weights (`--precision fp32` for fp32), batch x seq 32 x 512 by default. Variants:

* eager: plain layer / `apply_tempo_to_module` (fused Triton kernels on CUDA);
* compiled (`torch.compile(layer)`, inductor): plain / Tempo on the "fused" path (the default:
  LayerNorm traced so inductor fuses it, GELU y by inductor and only its code byte and backward
  as custom ops) / Tempo on the "opaque" path (`SLAPO_TEMPO_COMPILED=opaque`: the earlier
  whole-op custom ops, measured at +32% on an H100) / "ln-only" (fused path, LayerNorms only:
  what the GELU's two custom ops cost).

Per variant: median fwd+bwd time, bytes saved for backward (`slapo.profile`'s recorder, by
storage; parameters and their autocast copies counted as the layer keeps them), on CUDA the
memory held between forward and backward and the peak above the layer's input, and for compiled
variants the number of generated kernels (inductor's Triton / C++ kernels, counted in its output
code). Overheads and savings are against the plain layer in the same mode.

    PYTHONPATH=. python benchmarks/tempo_gpu.py --out tempo_gpu.json          # the GPU call
    PYTHONPATH=. python benchmarks/tempo_gpu.py --dropout 0.1 --attention eager
    PYTHONPATH=. python benchmarks/tempo_gpu.py --device cpu --hidden 256 --batch 8 --seq 128

Prints a table, writes JSON (rows are appended as they finish).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import sys
import time

import torch

VARIANTS = [("eager", "off"), ("eager", "tempo"), ("compiled", "off"), ("compiled", "fused"),
            ("compiled", "ln-only"), ("compiled", "opaque")]


def _layer(args):
    import transformers

    cfg = transformers.BertConfig(hidden_size=args.hidden, num_attention_heads=args.heads,
                                  intermediate_size=4 * args.hidden,
                                  hidden_dropout_prob=args.dropout,
                                  attention_probs_dropout_prob=args.dropout,
                                  attn_implementation=args.attention)
    return transformers.models.bert.modeling_bert.BertLayer(cfg).to(args.device).train()


def _forward(layer, x, amp: bool):
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        out = layer(x * 1.0)  # x * 1.0: the first op's input is not the leaf (as in a stack)
    return out[0] if isinstance(out, tuple) else out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _kernels(layer, x, g, amp: bool) -> int:
    """Generated kernels of the compiled forward + backward (its first call compiles)."""
    from torch._inductor.utils import run_and_get_code

    _, code = run_and_get_code(lambda: _forward(layer, x, amp).backward(g))
    return len(re.findall(r"async_compile\.(?:triton|cpp_pybinding|cpp)\(", "\n".join(code)))


def _saved(layer, x, amp: bool) -> int:
    from slapo.profile.saved import SavedTensorRecorder, storage_keys

    rec = SavedTensorRecorder(exclude=storage_keys([layer, x]))
    with rec:
        out = _forward(layer, x, amp)
    total = rec.total_bytes  # counts live storages: read it while the output holds the graph
    del out
    return total


def _time(layer, x, g, amp: bool, iters: int) -> list[float]:
    for _ in range(2):
        _forward(layer, x, amp).backward(g)
    _sync(x.device.type)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _forward(layer, x, amp).backward(g)
        _sync(x.device.type)
        times.append(time.perf_counter() - t0)
    return times


def _cuda_memory(layer, x, g, amp: bool) -> dict:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = _forward(layer, x, amp)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    out.backward(g)
    del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"activations_mib": held / 2**20, "peak_mib": peak / 2**20}


def _variant(base, mode: str, tempo: str):
    from slapo.op import apply_tempo_to_module

    layer = copy.deepcopy(base)
    if tempo != "off":
        layer = apply_tempo_to_module(layer, gelu=tempo != "ln-only")
    if mode == "compiled":
        os.environ["SLAPO_TEMPO_COMPILED"] = "opaque" if tempo == "opaque" else "fused"
        torch._dynamo.reset()
        layer = torch.compile(layer)
    return layer


def measure(args, mode: str, tempo: str, base, x, g) -> dict:
    amp = args.precision == "bf16"
    layer = _variant(base, mode, tempo)
    t0 = time.perf_counter()
    row = {"mode": mode, "tempo": tempo}
    if mode == "compiled":
        row["kernels"] = _kernels(layer, x, g, amp)
    times = _time(layer, x, g, amp, args.iters)
    row.update(ms=1e3 * statistics.median(times), ms_min=1e3 * min(times))
    row["saved_mib"] = _saved(layer, x, amp) / 2**20
    if args.device == "cuda":
        row.update(_cuda_memory(layer, x, g, amp))
    row["wall_s"] = time.perf_counter() - t0
    return row


def _compare(row: dict, rows: list[dict]) -> None:
    ref = next((r for r in rows if r["mode"] == row["mode"] and r["tempo"] == "off"), None)
    if ref is None or row["tempo"] == "off":
        return
    row["overhead"] = row["ms"] / ref["ms"] - 1
    for key in ("saved_mib", "activations_mib", "peak_mib"):
        if key in row:
            row[key.replace("_mib", "_drop_mib")] = ref[key] - row[key]


def _selected(args) -> list[tuple[str, str]]:
    """VARIANTS in order, filtered by --variants ("mode:tempo,...") and --no-compile."""
    chosen = VARIANTS
    if args.variants:
        wanted = [tuple(v.split(":", 1)) for v in args.variants.split(",")]
        unknown = [":".join(v) for v in wanted if v not in VARIANTS]
        if unknown:
            raise SystemExit(f"tempo_gpu.py: unknown variants {unknown}; choose from "
                             f"{[':'.join(v) for v in VARIANTS]}")
        chosen = [v for v in VARIANTS if v in wanted]
    return [v for v in chosen if not (args.no_compile and v[0] == "compiled")]


def run(args) -> list[dict]:
    torch.manual_seed(0)
    base = _layer(args)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, requires_grad=True)
    g = torch.randn(args.batch, args.seq, args.hidden, device=args.device)
    rows: list[dict] = []
    for mode, tempo in _selected(args):
        row = measure(args, mode, tempo, base, x, g)
        _compare(row, rows)
        rows.append(row)
        _print_row(row)
        _write(args.out, args, rows)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    os.environ.pop("SLAPO_TEMPO_COMPILED", None)
    return rows


def _print_row(r: dict) -> None:
    text = f"{r['mode']:9s} {r['tempo']:6s} {r['ms']:9.2f} ms  saved {r['saved_mib']:8.2f} MiB"
    if "peak_mib" in r:
        text += f"  held {r['activations_mib']:8.1f}  peak {r['peak_mib']:8.1f} MiB"
    if "kernels" in r:
        text += f"  kernels {r['kernels']:3d}"
    if "overhead" in r:
        text += f"  overhead {100 * r['overhead']:+.1f}%  saved -{r['saved_drop_mib']:.2f} MiB"
        if "peak_drop_mib" in r:
            text += f"  peak -{r['peak_drop_mib']:.0f} MiB"
    print(text, flush=True)


def _write(path: str | None, args, rows: list[dict]) -> None:
    if not path:
        return
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = {"device": device, "torch": torch.__version__, **vars(args),
            "reference_kernels": args.reference}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--variants", default=None,
                   help="comma-separated mode:tempo pairs, e.g. compiled:off,compiled:fused")
    p.add_argument("--reference", action="store_true", help="Tempo's PyTorch reference kernels")
    p.add_argument("--out", default=None, help="JSON output path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tempo_gpu.py: no CUDA device (use --device cpu)", file=sys.stderr)
        return 2
    if args.reference:
        os.environ["SLAPO_TRITON"] = "0"
    print(f"BERT layer h{args.hidden}, {args.batch}x{args.seq}, {args.precision}, dropout "
          f"{args.dropout}, attention {args.attention}, {args.device}")
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
