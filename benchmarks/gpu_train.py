"""Training throughput on one GPU: Slapo schedules against what a user would run instead.

    python benchmarks/gpu_train.py --deadline-s 540 --out $OUT/gpu     # the table, one device call
    python benchmarks/gpu_train.py --models llama-1b --variants hf_liger,slapo_gpu_sac \
        --cap-gib 24 --cap-batches 2,4,8                               # what fits a 24 GiB card
    python benchmarks/gpu_train.py --tiny --variants hf_sdpa,slapo_gpu  # CPU smoke run

Every (model, variant) runs in its own process (Liger patches HF classes globally; compiled
graphs and allocator state must not leak between variants), one after the other, in this one
invocation, so the ratios compare like with like. Each appends one JSON line to
`<out>/results.jsonl` as soon as it finishes (a killed run keeps the rows done), and the table is
printed at the end.

Setup shared by every variant (the issue-14 protocol): bf16 autocast over fp32 master weights,
`torch.optim.AdamW(fused=True)`, random token ids (causal LMs: labels = inputs; BERT masked LM:
15% of positions carry a label, the rest -100, as in BERT pre-training), `warmup` untimed steps
then `steps` timed steps between synchronisations, `loss.item()` every step as a training loop
logs it. Peak memory is `torch.cuda.max_memory_allocated()` over warm-up and timed steps.
MFU = model FLOPs per token (6 x non-embedding params + 6 x hidden x vocab + 12 x layers x hidden
x seq) x tokens/s over the datasheet bf16 peak (989 TFLOP/s for H100 SXM); `mfu_measured` uses a
8192^3 bf16 matmul measured in the same process instead. "compile_s" is the first step's time
minus a steady step (compilation, autotuning, allocator warm-up).

Variants:
- hf_eager / hf_sdpa: the HF model as loaded, eager attention / its default (SDPA);
- hf_compile: `torch.compile(model)` (whole model, default mode);
- hf_liger: Liger-Kernel's HF patches (LLaMA: RMSNorm, RoPE, SwiGLU, fused linear-CE), when
  `liger_kernel` imports;
- slapo_ready: the ready schedule as of the first measurement (`attention="sdpa", fuse=True`);
- slapo_gpu: `attention="sdpa", compile_blocks=True, fused_loss=True` through `slapo.build`
  with `mixed_precision="bf16"`;
- slapo_gpu_kernels: slapo_gpu + `kernels=True` (Slapo's Triton kernels);
- slapo_gpu_sac: slapo_gpu + selective activation checkpointing of every layer;
- slapo_gpu_ckpt: slapo_gpu + full activation checkpointing of every layer.

`--cap-gib C` limits each process to C GiB (`torch.cuda.set_per_process_memory_fraction`) and
tries batch sizes upward from `--cap-batches` until one does not fit: the row reports the
largest batch that fits and its tokens/s ("what fits a 24 GiB card").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODELS = {
    # name: (HF config class, model class, config kwargs, batch, seq)
    "gpt2-medium": ("GPT2Config", "GPT2LMHeadModel",
                    dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024),
                    16, 1024),
    "llama-1b": ("LlamaConfig", "LlamaForCausalLM",
                 dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=8192, vocab_size=32000,
                      max_position_embeddings=2048, tie_word_embeddings=False), 8, 2048),
    "bert-large": ("BertConfig", "BertForMaskedLM",
                   dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                        intermediate_size=4096, vocab_size=30522, max_position_embeddings=512),
                   32, 512),
    # tiny twins for a CPU smoke run of this script (--tiny): same code paths, small shapes
    "tiny-gpt2": ("GPT2Config", "GPT2LMHeadModel",
                  dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64), 2, 64),
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                        max_position_embeddings=64), 2, 64),
    "tiny-bert": ("BertConfig", "BertForMaskedLM",
                  dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=64), 2, 64),
}

SLAPO_KNOBS = {
    "slapo_ready": dict(attention="sdpa", fuse=True),
    "slapo_gpu": dict(attention="sdpa", compile_blocks=True, fused_loss=True),
    "slapo_gpu_kernels": dict(attention="sdpa", compile_blocks=True, fused_loss=True,
                              kernels=True),
    "slapo_gpu_sac": dict(attention="sdpa", compile_blocks=True, fused_loss=True,
                          ckpt_ratio=1.0, ckpt_policy="selective"),
    "slapo_gpu_ckpt": dict(attention="sdpa", compile_blocks=True, fused_loss=True,
                           ckpt_ratio=1.0),
}
HF_VARIANTS = ("hf_eager", "hf_sdpa", "hf_compile", "hf_liger")
# The default run, headline first (hf_eager OOMs at these batches, slapo_ready is the first
# measurement's schedule, kernels are unmeasured: ask for them with --variants).
VARIANTS = ("slapo_gpu", "hf_sdpa", "hf_compile", "hf_liger", "slapo_gpu_sac")
ALL_VARIANTS = HF_VARIANTS + tuple(SLAPO_KNOBS)
DATASHEET_TFLOPS = 989.0


# ------------------------------------------------------------------------------------------------
# one variant, in a child process
# ------------------------------------------------------------------------------------------------

def model_flops_per_token(cfg, seq: int) -> float:
    h = cfg.hidden_size
    layers = cfg.num_hidden_layers
    return 6 * _non_embedding_params(cfg) + 6 * h * cfg.vocab_size + 12 * layers * h * seq


def _non_embedding_params(cfg) -> int:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    ffn = getattr(cfg, "intermediate_size", None) or 4 * h
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    attn = h * h * 2 + 2 * h * (h // heads) * kv
    mlp = (3 if cfg.model_type == "llama" else 2) * h * ffn
    return layers * (attn + mlp)


def make_model(name: str, variant: str, device):
    import torch
    import transformers

    cfg_cls, model_cls, kw, _, _ = MODELS[name]
    cfg = getattr(transformers, cfg_cls)(**kw)
    if variant == "hf_eager":
        cfg._attn_implementation = "eager"
    if variant == "hf_liger":
        _apply_liger(cfg.model_type)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, model_cls)(cfg)
    model.train()
    return model, cfg


def _apply_liger(model_type: str) -> None:
    import liger_kernel.transformers as lk  # noqa: F401  (ImportError: variant skipped)

    fn = getattr(lk, f"apply_liger_kernel_to_{model_type}", None)
    if fn is None:
        raise RuntimeError(f"Liger-Kernel has no kernels for {model_type}")
    fn()


def make_batch(name: str, cfg, batch: int, seq: int, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    if cfg.model_type == "bert":  # masked LM: 15% of positions predicted
        keep = torch.rand((batch, seq), generator=g) < 0.15
        labels[~keep] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def hf_step_fn(model, variant: str, lr: float = 1e-4):
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    run = torch.compile(model) if variant == "hf_compile" else model

    def step(batch) -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = run(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def slapo_step_fn(model, variant: str, lr: float = 1e-4):
    import inspect

    import torch

    import slapo
    from slapo import model_schedule

    knobs = SLAPO_KNOBS[variant]
    sch = model_schedule.apply(model, **knobs)
    kwargs = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=lr, fused=True))
    native = "mixed_precision" in inspect.signature(slapo.build).parameters
    if native:
        kwargs["mixed_precision"] = "bf16"
    trained, _ = slapo.build(sch, **kwargs)

    def step(batch) -> float:
        if native:
            return trained.train_step(batch)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return trained.train_step(batch)

    return step


def matmul_tflops(n: int = 8192) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * 10 / (time.perf_counter() - t) / 1e12


def _profile(step, data, path: str) -> None:
    """Two steps under torch.profiler: the kernels by total CUDA time, to a text file."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step(data)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
    Path(path).write_text(table)
    print(table, file=sys.stderr)


def measure(name: str, variant: str, batch: int, seq: int, steps: int, warmup: int,
            profile_to: str | None = None) -> dict:
    """Build, warm up and time one variant at one batch size (in this process)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = make_model(name, variant, device)
    step = hf_step_fn(model, variant) if variant in HF_VARIANTS else slapo_step_fn(model, variant)
    data = make_batch(name, cfg, batch, seq, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(warmup + steps):
        t = time.perf_counter()
        losses.append(step(data))
        sync()
        times.append(time.perf_counter() - t)
    timed = sum(times[warmup:])
    if profile_to and device == "cuda":
        _profile(step, data, profile_to)
    tps = batch * seq * steps / timed
    flops = model_flops_per_token(cfg, seq)
    row = dict(model=name, variant=variant, batch=batch, seq=seq, tokens_per_s=tps,
               step_ms=1000 * timed / steps, compile_s=times[0] - min(times[warmup:]),
               loss_first=losses[0], loss_last=losses[-1],
               mfu=flops * tps / (DATASHEET_TFLOPS * 1e12))
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def child(args) -> None:
    """Run one (model, variant) and print one JSON line per batch size tried."""
    import torch

    if args.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))
    _, _, _, batch, seq = MODELS[args.models]
    batches = [int(b) for b in args.cap_batches.split(",")] if args.cap_gib else [batch]
    peak = matmul_tflops() if torch.cuda.is_available() and not args.tiny else None
    for b in batches:
        try:
            prof = (str(Path(args.out) / f"profile.{args.models}.{args.variants}.txt")
                    if args.profile else None)
            row = measure(args.models, args.variants, b, seq, args.steps, args.warmup, prof)
        except torch.OutOfMemoryError:
            print(json.dumps(dict(model=args.models, variant=args.variants, batch=b, seq=seq,
                                  status="OOM")), flush=True)
            break
        row["status"] = "ok"
        row["cap_gib"] = args.cap_gib
        if peak:
            row["matmul_tflops"] = peak
            row["mfu_measured"] = row["mfu"] * DATASHEET_TFLOPS / peak
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


# ------------------------------------------------------------------------------------------------
# the parent: one child per (model, variant), then the table
# ------------------------------------------------------------------------------------------------

def run_all(args) -> list[dict]:
    """One child per (variant, model), variant-major: the headline variants of every model come
    first, so a run cut short by `--deadline-s` still has a comparable table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "results.jsonl"
    rows = []
    start = time.perf_counter()
    for variant in args.variants.split(","):
        for name in args.models.split(","):
            left = args.deadline_s - (time.perf_counter() - start) if args.deadline_s else None
            if left is not None and left < 30:
                got = [dict(model=name, variant=variant, status="skipped: --deadline-s")]
            else:
                timeout = args.timeout if left is None else min(args.timeout, int(left))
                got = _run_child(args, name, variant, out, timeout)
            for r in got:
                r["wall_s"] = time.perf_counter() - start
                rows.append(r)
                with jsonl.open("a") as f:
                    f.write(json.dumps(r) + "\n")
                print(_line(r), flush=True)
    return rows


def _run_child(args, name: str, variant: str, out: Path, timeout: int) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", "--models", name, "--variants", variant,
           "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--cap-gib", str(args.cap_gib), "--cap-batches", args.cap_batches, "--out", str(out)]
    if args.profile:
        cmd.append("--profile")
    if args.tiny:
        cmd.append("--tiny")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # keep the batch sizes that finished
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        got = [json.loads(ln) for ln in text.splitlines() if ln.startswith("{")]
        return got + [dict(model=name, variant=variant, status=f"timeout {timeout}s")]
    got = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if not got:
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        (out / f"{name}.{variant}.stderr.txt").write_text(proc.stderr[-20000:])
        got = [dict(model=name, variant=variant, status=f"failed: {err[:200]}")]
    return got


def _line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['model']:12s} {r['variant']:18s} b={r.get('batch', '-')!s:4s} {r['status']}"
    return (f"{r['model']:12s} {r['variant']:18s} b={r['batch']:<4d} "
            f"{r['tokens_per_s'] / 1e3:8.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
            f"peak {r.get('peak_gib', 0):5.1f} GiB  compile {r['compile_s']:5.1f}s  "
            f"loss {r['loss_first']:.4f}->{r['loss_last']:.4f}")


def print_table(rows: list[dict]) -> None:
    """Per model: each variant's best row, and its ratio to the best baseline of this run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="training throughput, one process per variant (bf16 autocast)")
    for col in ("model", "variant", "batch", "tokens/s", "vs best HF", "MFU", "peak GiB",
                "compile s", "status"):
        table.add_column(col)
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        ok = [r for r in mine if r.get("status") == "ok"]
        best_hf = max((r["tokens_per_s"] for r in ok if r["variant"] in HF_VARIANTS), default=0)
        for r in mine:
            if r.get("status") != "ok":
                table.add_row(name, r["variant"], str(r.get("batch", "")), "", "", "", "", "",
                              r["status"])
                continue
            ratio = f"{r['tokens_per_s'] / best_hf:.2f}x" if best_hf else ""
            table.add_row(name, r["variant"], str(r["batch"]), f"{r['tokens_per_s']:,.0f}",
                          ratio, f"{100 * r['mfu']:.1f}%", f"{r.get('peak_gib', 0):.1f}",
                          f"{r['compile_s']:.1f}", "ok")
    Console(width=140).print(table)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama-1b,gpt2-medium,bert-large")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated, from {', '.join(ALL_VARIANTS)}")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--cap-gib", type=float, default=0.0)
    p.add_argument("--cap-batches", default="8,16,32,64")
    p.add_argument("--timeout", type=int, default=240, help="seconds per variant")
    p.add_argument("--deadline-s", type=int, default=0,
                   help="stop starting variants after this many seconds (0: no limit); fits "
                        "the whole table into one device call")
    p.add_argument("--out", default="runs/gpu_train")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run (tiny configs)")
    p.add_argument("--profile", action="store_true",
                   help="also write each variant's top CUDA kernels (torch.profiler)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in ALL_VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(ALL_VARIANTS)}")
    if args.child:
        return child(args)
    if args.tiny:
        args.models = ",".join(f"tiny-{m.split('-')[0]}" for m in args.models.split(","))
    rows = run_all(args)
    print_table(rows)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
