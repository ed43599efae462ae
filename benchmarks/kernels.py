"""Microbenchmark of the fused kernels (`slapo.op.kernels`) on one CUDA GPU, bf16.

For each kernel, at the shapes of LLaMA-1.1B (8 x 2048 tokens, hidden 2048, ffn 8192, 32/8
heads of 64) and GPT-2 medium (16 x 1024 tokens, hidden 1024, ffn 4096), it times forward and
forward+backward of three variants in one process:

* `slapo`: the Triton kernels (`backend="triton"`);
* `eager`: the PyTorch reference (what HF runs);
* `compiled`: `torch.compile` of the same reference (inductor's generated kernels).

It also reports the bytes each variant saves for backward and the largest difference between
the Triton and eager outputs and input gradients (a GPU check of the kernels' roundings). Prints
a table and writes JSON (`--json`). CUDA only.

    PYTHONPATH=. python benchmarks/kernels.py --json kernels_h100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slapo.op import kernels as K
from slapo.profile import saved_bytes

BF16, F32 = torch.bfloat16, torch.float32


@dataclass
class Case:
    """One kernel at one shape: `make()` returns (inputs requiring grad, constants)."""

    name: str
    shape: str
    make: Callable[[], tuple[list[torch.Tensor], list]]
    triton: Callable[..., torch.Tensor | tuple]
    reference: Callable[..., torch.Tensor | tuple]


def _rand(*shape, dtype=BF16, scale=1.0, shift=0.0, grad=True):
    t = (shift + scale * torch.randn(*shape, device="cuda", dtype=F32)).to(dtype)
    return t.requires_grad_(grad)


def _rope_inputs(bsz, seq, hq, hk, dim, cos_dtype):
    q = _rand(bsz, seq, hq, dim, grad=False).transpose(1, 2).requires_grad_()
    k = _rand(bsz, seq, hk, dim, grad=False).transpose(1, 2).requires_grad_()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, device="cuda", dtype=F32) / dim))
    pos = torch.arange(seq, device="cuda", dtype=F32)[None].expand(bsz, seq)
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    return [q, k], [emb.cos().to(cos_dtype), emb.sin().to(cos_dtype)]


def cases(tokens_llama: int, tokens_gpt2: int) -> list[Case]:
    tl, tg = tokens_llama, tokens_gpt2
    out = []
    for xdt, label in ((BF16, "bf16"), (F32, "fp32 residual")):
        out.append(Case(
            "rms_norm", f"LLaMA [{tl}, 2048] {label}",
            lambda xdt=xdt: ([_rand(tl, 2048, dtype=xdt), _rand(2048, dtype=xdt, scale=0.1,
                                                                shift=1.0)], [1e-5]),
            lambda x, w, eps: K.rms_norm(x, w, eps, backend="triton"),
            K.rms_norm_reference))
    for xdt, label in ((BF16, "bf16"), (F32, "fp32 residual")):
        out.append(Case(
            "layer_norm", f"GPT-2 [{tg}, 1024] {label}",
            lambda xdt=xdt: ([_rand(tg, 1024, dtype=xdt), _rand(1024, dtype=xdt, shift=1.0),
                              _rand(1024, dtype=xdt, scale=0.1)], [1e-5]),
            lambda x, w, b, eps: K.layer_norm(x, w, b, eps, backend="triton"),
            lambda x, w, b, eps: F.layer_norm(x, (x.shape[-1],), w, b, eps)))
    out.append(Case(
        "swiglu", f"LLaMA [{tl}, 8192] bf16",
        lambda: ([_rand(tl, 8192, scale=2.0), _rand(tl, 8192)], []),
        lambda g, u: K.swiglu(g, u, backend="triton"), K.swiglu_reference))
    out.append(Case(
        "gelu_tanh", f"GPT-2 [{tg}, 4096] bf16",
        lambda: ([_rand(tg, 4096, scale=2.0)], []),
        lambda x: K.bias_gelu_dropout(x, None, "tanh", backend="triton"),
        lambda x: F.gelu(x, approximate="tanh")))
    out.append(Case(
        "bias_gelu_erf", f"BERT-large [{tg}, 4096] bf16",
        lambda: ([_rand(tg, 4096, scale=2.0), _rand(4096, scale=0.1)], []),
        lambda x, b: K.bias_gelu_dropout(x, b, "none", backend="triton"),
        lambda x, b: F.gelu(x + b)))
    out.append(Case(
        "bias_gelu_dropout0.1", f"GPT-2 [{tg}, 4096] bf16",
        lambda: ([_rand(tg, 4096, scale=2.0), _rand(4096, scale=0.1)], []),
        lambda x, b: K.bias_gelu_dropout(x, b, "tanh", p=0.1, backend="triton"),
        lambda x, b: F.dropout(F.gelu(x + b, approximate="tanh"), 0.1)))
    out.append(Case(
        "rope", f"LLaMA q[{tl // 2048}, 32, 2048, 64] k[.., 8, ..] bf16",
        lambda: _rope_inputs(tl // 2048, 2048, 32, 8, 64, BF16),
        lambda q, k, c, s: K.apply_rotary_pos_emb(q, k, c, s, backend="triton"),
        K.rope_reference))
    return out


def _outputs(y) -> tuple[torch.Tensor, ...]:
    return y if isinstance(y, tuple) else (y,)


def time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    """Median CUDA-event time of `fn` in ms."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(fn, inputs, consts, warmup, reps) -> dict:
    cots = [torch.randn_like(o) for o in _outputs(fn(*inputs, *consts))]

    def fwd():
        with torch.no_grad():
            fn(*inputs, *consts)

    def fwd_bwd():
        for t in inputs:
            t.grad = None
        torch.autograd.backward(_outputs(fn(*inputs, *consts)), cots)

    row = {"fwd_ms": time_ms(fwd, warmup, reps), "fwd_bwd_ms": time_ms(fwd_bwd, warmup, reps)}
    try:
        row["saved_bytes"] = saved_bytes(lambda: fn(*inputs, *consts))
    except Exception as e:  # e.g. saved-tensor hooks inside a compiled graph
        row["saved_bytes_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def max_diff(case: Case, inputs, consts) -> dict:
    """Largest |triton - eager| over outputs and input gradients (dropout excluded: masks differ)."""
    if "dropout" in case.name:
        return {}
    res = {}
    for label, fn in (("triton", case.triton), ("eager", case.reference)):
        outs = _outputs(fn(*inputs, *consts))
        gen = torch.Generator(device="cuda").manual_seed(0)
        cots = [torch.randn(o.shape, device="cuda", generator=gen).to(o.dtype) for o in outs]
        grads = torch.autograd.grad(outs, inputs, cots)
        res[label] = [t.detach().float() for t in (*outs, *grads)]
    return {"max_abs_diff": max((a - b).abs().max().item()
                                for a, b in zip(res["triton"], res["eager"])),
            "max_abs_value": max(b.abs().max().item() for b in res["eager"])}


def run_case(case: Case, warmup: int, reps: int, compile_ref: bool) -> dict:
    torch.manual_seed(0)
    inputs, consts = case.make()
    row = {"kernel": case.name, "shape": case.shape, **max_diff(case, inputs, consts)}
    variants = [("slapo", case.triton), ("eager", case.reference)]
    if compile_ref:
        variants.append(("compiled", torch.compile(case.reference, dynamic=False)))
    for label, fn in variants:
        try:
            row[label] = measure(fn, inputs, consts, warmup, reps)
        except Exception as e:  # a failing variant is reported, not fatal
            row[label] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return row


def _fmt(row: dict, variant: str, key: str) -> str:
    v = row.get(variant, {})
    return f"{v[key]:.3f}" if key in v else "err"


def print_table(rows: list[dict]) -> None:
    head = (f"{'kernel':<22}{'shape':<42}{'slapo f+b':>10}{'eager f+b':>10}{'comp f+b':>10}"
            f"{'vs eager':>9}{'vs comp':>9}{'saved MiB s/e':>16}{'max diff':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, e, c = (r.get(v, {}).get("fwd_bwd_ms") for v in ("slapo", "eager", "compiled"))
        vs_e = f"{e / s:.2f}x" if s and e else "-"
        vs_c = f"{c / s:.2f}x" if s and c else "-"
        mib = "/".join(f"{r.get(v, {}).get('saved_bytes', 0) / 2**20:.0f}"
                       for v in ("slapo", "eager"))
        diff = f"{r['max_abs_diff']:.2g}" if "max_abs_diff" in r else "-"
        print(f"{r['kernel']:<22}{r['shape']:<42}{_fmt(r, 'slapo', 'fwd_bwd_ms'):>10}"
              f"{_fmt(r, 'eager', 'fwd_bwd_ms'):>10}{_fmt(r, 'compiled', 'fwd_bwd_ms'):>10}"
              f"{vs_e:>9}{vs_c:>9}{mib:>16}{diff:>10}")
    print("times in ms (median); 'vs' = speed-up of slapo's Triton kernels (>1 is faster)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens-llama", type=int, default=8 * 2048)
    ap.add_argument("--tokens-gpt2", type=int, default=16 * 1024)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile baselines")
    ap.add_argument("--only", default="", help="comma-separated kernel names")
    ap.add_argument("--json", default="", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/kernels.py needs a CUDA GPU (the Triton kernels run on CUDA only).")
        return 1
    import triton

    only = {s for s in args.only.split(",") if s}
    rows = [run_case(c, args.warmup, args.reps, not args.no_compile)
            for c in cases(args.tokens_llama, args.tokens_gpt2) if not only or c.name in only]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version(),
            "command": " ".join(sys.argv)}
    print(json.dumps(meta))
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
