"""Memory of one transformer layer: baseline vs Tempo vs activation checkpointing.

    python benchmarks/memory.py --out memory.json            # CPU: bytes and ratios
    python benchmarks/memory.py --seq 128 512 --batch 2      # the defaults

For a BERT-Large layer (h=1024, 16 heads, 4096 FFN) and a GPT-2 medium block (h=1024, 16 heads),
fp32, training mode (dropout 0.1, eager attention), it reports per variant:
* saved activations (bytes autograd keeps for backward, layer input excluded; checkpointing
  keeps only the input, so it shows ~0),
* live tensor bytes after forward and the peak over forward + backward (steady state: gradient
  buffers already exist, as in training), both from `slapo.profile.LiveTensorBytes`,
* the step time (median of 3 fwd+bwd; informative only: CPU, and noisy on a shared machine).
On CUDA it also finds, per variant, the largest batch whose fwd+bwd of a stack of layers stays
under `--cap-gib` (fp16 autocast) and the throughput at that batch.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from slapo.op import apply_tempo_to_module  # noqa: E402
from slapo.profile import memory_breakdown  # noqa: E402


class Checkpointed(nn.Module):
    """Non-reentrant activation checkpoint of a whole layer."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor, **kw) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False, **kw)


def bert_large_layer() -> nn.Module:
    from transformers import BertConfig
    from transformers.models.bert.modeling_bert import BertLayer

    cfg = BertConfig(
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=4096,
        attn_implementation="eager",
    )
    return BertLayer(cfg)


def gpt2_medium_block() -> nn.Module:
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    cfg = GPT2Config(n_embd=1024, n_head=16, attn_implementation="eager")
    return GPT2Block(cfg, layer_idx=0)


class Causal(nn.Module):
    """Calls a GPT-2 block with the additive causal mask the model would build for eager."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        mask = torch.full((s, s), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
        out = self.block(x, attention_mask=mask[None, None])
        return out[0] if isinstance(out, tuple) else out


MODELS: dict[str, Callable[[], nn.Module]] = {
    "bert-large-layer": bert_large_layer,
    "gpt2-medium-block": lambda: Causal(gpt2_medium_block()),
}


def variants(base: nn.Module) -> dict[str, nn.Module]:
    return {
        "baseline": base,
        "tempo": apply_tempo_to_module(copy.deepcopy(base)),
        "checkpoint": Checkpointed(copy.deepcopy(base)),
    }


def loss_fn(out) -> torch.Tensor:
    """Sum of the output: saves nothing itself, so only the layer's own activations count."""
    out = out[0] if isinstance(out, tuple) else out
    return out.float().sum()


def measure_cpu(name: str, seq: int, batch: int) -> list[dict]:
    torch.manual_seed(0)
    rows = []
    for vname, model in variants(MODELS[name]()).items():
        model.train()
        x = torch.randn(batch, seq, 1024)
        loss_fn(model(x)).backward()  # gradient buffers exist, as in steady-state training
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            loss_fn(model(x)).backward()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times)[1]  # median of 3
        r = memory_breakdown(model, (x,), loss_fn=loss_fn, exclude=[x])
        rows.append(
            dict(
                model=name,
                seq=seq,
                batch=batch,
                variant=vname,
                saved_activations=r.activations,
                live_after_forward=r.live_after_forward,
                peak_live=r.peak_live,
                step_s=step_s,
            )
        )
    base = rows[0]
    for row in rows:
        for key in ("saved_activations", "live_after_forward", "peak_live"):
            row[key + "_ratio"] = row[key] / base[key] if base[key] else None
    return rows


def measure_cuda(name: str, seq: int, layers: int, cap_gib: float) -> list[dict]:
    """Largest batch under `cap_gib` for a stack of `layers` layers (fp16 autocast) + throughput."""
    rows = []
    dev = torch.device("cuda")
    for vname in ("baseline", "tempo", "checkpoint"):
        torch.manual_seed(0)
        stack = nn.Sequential(*[variants(MODELS[name]())[vname] for _ in range(layers)]).to(dev)
        stack.train()
        best, best_peak = 0, 0
        batch = 1
        while batch <= 4096:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                x = torch.randn(batch, seq, 1024, device=dev)
                with torch.autocast("cuda", dtype=torch.float16):
                    loss_fn(stack(x)).backward()
                peak = torch.cuda.max_memory_allocated()
            except torch.OutOfMemoryError:
                break
            finally:
                stack.zero_grad(set_to_none=True)
            if peak > cap_gib * 2**30:
                break
            best, best_peak = batch, peak
            batch *= 2
        tput = None
        if best:
            x = torch.randn(best, seq, 1024, device=dev)
            for _ in range(2):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss_fn(stack(x)).backward()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            iters = 5
            for _ in range(iters):
                with torch.autocast("cuda", dtype=torch.float16):
                    loss_fn(stack(x)).backward()
            torch.cuda.synchronize()
            tput = iters * best * seq / (time.perf_counter() - t0)
        rows.append(
            dict(
                model=name,
                seq=seq,
                variant=vname,
                layers=layers,
                cap_gib=cap_gib,
                max_batch=best,
                peak_bytes=best_peak,
                tokens_per_s=tput,
            )
        )
        del stack
    return rows


def print_table(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = [
        "model",
        "seq",
        "variant",
        "saved act MiB",
        "ratio",
        "live@fwd MiB",
        "peak MiB",
        "ratio ",
        "step s",
    ]
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "variant") else "right")
    for r in rows:
        t.add_row(
            r["model"],
            str(r["seq"]),
            r["variant"],
            f"{r['saved_activations'] / 2**20:.1f}",
            f"{r['saved_activations_ratio']:.3f}",
            f"{r['live_after_forward'] / 2**20:.1f}",
            f"{r['peak_live'] / 2**20:.1f}",
            f"{r['peak_live_ratio']:.3f}",
            f"{r['step_s']:.2f}",
        )
    Console().print(t)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--out", type=str, default=None, help="write all results as JSON here")
    ap.add_argument("--cap-gib", type=float, default=16.0, help="CUDA memory cap")
    ap.add_argument("--layers", type=int, default=4, help="CUDA: layers in the stack")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

    result = dict(
        machine=dict(
            platform=platform.platform(),
            processor=platform.processor(),
            torch=torch.__version__,
            threads=torch.get_num_threads(),
        ),
        cpu=[],
        cuda=[],
    )
    for name in args.models:
        for seq in args.seq:
            result["cpu"].extend(measure_cpu(name, seq, args.batch))
    print_table(result["cpu"], f"One layer, b={args.batch}, fp32, dropout 0.1 (CPU tensors)")
    if torch.cuda.is_available():
        result["machine"]["gpu"] = torch.cuda.get_device_name()
        for name in args.models:
            for seq in args.seq:
                result["cuda"].extend(measure_cuda(name, seq, args.layers, args.cap_gib))
        for r in result["cuda"]:
            print(r)
    else:
        print("No CUDA device: skipped the largest-batch / throughput part.")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
