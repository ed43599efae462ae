"""Eager vs fused step time of one GPT-2 block (CPU, or GPU when available), in one run.

The fused variant is slapo's schedule on the block's MLP: trace with c_fc/c_proj as leaves,
decompose c_fc (bias add into the graph), find the bias+GELU pattern and fuse it with
`torch.compile(backend=...)`. A training step is forward + backward of the block on random
hidden states. Prints a table and writes JSON.

    python benchmarks/fusion.py --backend inductor --json fusion.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.activations import NewGELUActivation  # noqa: E402

import slapo  # noqa: E402


def bias_gelu(x, b):
    return NewGELUActivation()(x + b)


def build(args, device):
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=args.hidden, n_layer=1, n_head=args.heads, vocab_size=128,
                     n_positions=args.seq, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    block = GPT2LMHeadModel(cfg).transformer.h[0].to(device)
    fused = copy.deepcopy(block)
    sch = slapo.create_schedule(fused)
    mlp = sch["mlp"]
    mlp.trace(leaves=["c_fc", "c_proj"], flatten=True)
    mlp["c_fc"].decompose()
    mlp.fuse(mlp.find(bias_gelu)[0], compiler=args.backend, name="bias_gelu")
    return block, fused


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def step_times(block, x, steps: int, warmup: int, device) -> list[float]:
    def step():
        _first(block(x)).float().pow(2).mean().backward()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="inductor")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default="fusion.json")
    args = p.parse_args()
    device = torch.device(args.device)
    block, fused = build(args, device)
    x = torch.randn(args.batch, args.seq, args.hidden, device=device, requires_grad=True)
    with torch.no_grad():
        diff = _first(block(x)) - _first(fused(x))
    t_compile = time.perf_counter()
    step_times(fused, x, 1, 0, device)  # first call compiles
    t_compile = time.perf_counter() - t_compile
    eager = step_times(block, x, args.steps, args.warmup, device)
    fast = step_times(fused, x, args.steps, args.warmup, device)
    e, f = statistics.median(eager), statistics.median(fast)
    result = {"device": str(device), "backend": args.backend, "shape": [args.batch, args.seq,
                                                                        args.hidden],
              "eager_ms": e * 1e3, "fused_ms": f * 1e3, "speedup": e / f,
              "first_call_s": t_compile, "max_abs_diff": diff.abs().max().item(),
              "torch": torch.__version__, "threads": torch.get_num_threads()}
    print(f"{'variant':<10}{'median step (ms)':>18}")
    print(f"{'eager':<10}{e * 1e3:>18.2f}")
    print(f"{'fused':<10}{f * 1e3:>18.2f}   ({args.backend}, first call {t_compile:.1f} s)")
    print(f"speedup eager/fused = {e / f:.3f}x on {device}; max |diff| = {result['max_abs_diff']:.2e}")
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
