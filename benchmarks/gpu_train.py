"""Training throughput on one GPU: Slapo schedules against what a user would run instead.

    python benchmarks/gpu_train.py --deadline-s 300 --out $OUT/gpu     # time-boxed (gpu_session.sh)
    python benchmarks/gpu_train.py --models llama-1b --variants hf_liger,slapo_gpu_sac \
        --cap-gib 24 --cap-batches 2,4,8                               # what fits a 24 GiB card
    python benchmarks/gpu_train.py --tiny --variants hf_sdpa,slapo_gpu  # CPU smoke run

Every (model, variant) runs in its own process (Liger patches HF classes globally; compiled
graphs and allocator state must not leak between variants), one after the other, in this one
invocation, so the ratios compare like with like. Each appends one JSON line to
`<out>/results.jsonl` as soon as it finishes (a killed run keeps the rows done), and the table is
printed at the end. Every row of one invocation carries the same `run_id`.

Setup shared by every variant (the issue-14 protocol): bf16 autocast over fp32 master weights,
`torch.optim.AdamW(fused=True)`, random token ids (causal LMs: labels = inputs; BERT masked LM:
15% of positions carry a label, the rest -100, as in BERT pre-training), `warmup` untimed steps
then `steps` timed steps between synchronisations, `loss.item()` every step as a training loop
logs it (`loss_last` is the loss after all warm-up and timed steps on the one batch: the
dropout check compares it). Peak memory is `torch.cuda.max_memory_allocated()` over warm-up
and timed steps. MFU = model FLOPs per token (6 x non-embedding params + 6 x hidden x vocab +
12 x layers x hidden x seq) x tokens/s over the datasheet bf16 peak (989 TFLOP/s for H100 SXM);
`mfu_measured` uses a 8192^3 bf16 matmul measured in the same process instead. "compile_s" is
the first step's time minus a steady step (compilation, autotuning, allocator warm-up).
"graphs/breaks" counts dynamo's compiled graphs and graph breaks over all steps: a compiled
variant should show its few graphs and no break (each break is eager Python on every step).

Variants:
- hf_eager / hf_sdpa: the HF model as loaded, eager attention / its default (SDPA);
- hf_sdpa_nocudnn: hf_sdpa with cuDNN's SDPA backend off: on torch < 2.12 cuDNN may train a
  dropout probability that is not a multiple of 1/16 (0.1) as a rounded one (pytorch#174245),
  so this is HF training with the dropout its config says (Slapo's SDPA core avoids cuDNN
  there by itself: `slapo.op.attention.cudnn_would_round_dropout`);
- hf_compile: `torch.compile(model)` (whole model, default mode);
- hf_liger: Liger-Kernel's HF patches (LLaMA: RMSNorm, RoPE, SwiGLU, fused linear-CE), when
  `liger_kernel` imports and has kernels for the family (checked before a process is started:
  GPT-2 and BERT have none, their rows say so at no cost);
- slapo_ready: the ready schedule as of the first measurement (`attention="sdpa", fuse=True`);
- slapo_gpu: `attention="sdpa", compile_blocks=True, fused_loss=True` through `slapo.build`
  with `mixed_precision="bf16"`;
- slapo_gpu_kernels: slapo_gpu + `kernels=True` (Slapo's Triton kernels);
- slapo_gpu_sac: slapo_gpu + selective activation checkpointing of every layer;
- slapo_gpu_ckpt: slapo_gpu + full activation checkpointing of every layer;
- slapo_gpu_nocudnn: slapo_gpu with cuDNN's SDPA backend off
  (`torch.backends.cuda.enable_cudnn_sdp(False)`; `--no-cudnn-sdp` turns it off for every
  variant of a run);
- slapo_tuned: the best schedule `slapo tune` finds, measured like every other variant (below);
- slapo_fp8, slapo_offload, slapo_optim_offload (issue 36): the GPU schedule with FP8 GEMMs
  (`precision="fp8"`, `Float8Config(min_dim=1024)`), with half the layers selectively
  checkpointed and half offloaded, with the optimizer on the host (`benchmarks/gpu_train_rows.py`
  says what each changes and reports). A row that cannot run here (fp8 without torchao or on a
  GPU below compute capability 8.9) is `skipped: <why>`, not a crash; the table's
  "vs slapo_gpu" column is their ratio to this run's bf16 Slapo row.

Models: the three of the table, and `llama3-8b-8l`: LLaMA-3-8B's shapes (hidden 4096, SwiGLU
14336, 32/8 heads, vocab 128256, rope theta 5e5) with 8 layers, 4 x 2048, about 2.8B
parameters (45 GiB of fp32 weights, gradients and AdamW; the FP8 target of issue 36).
`--tiny` maps every model to its tiny twin (`tiny-llama3` for it).

slapo_tuned, in its own process: the GPU space of `slapo tune --space gpu` (bf16, SDPA;
uncapped: compile_blocks x fused_loss x kernels at the table's batch; under `--cap-gib`:
compiled layers with the fused loss x ckpt_ratio 0/0.5/1 x ckpt_policy x the `--cap-batches`;
`--tune-knob NAME=V1,V2` changes a knob's candidates) is ranked by the GPU cost
model (`slapo.tune.best.predict_configs`, `--tune-workers` processes; started in the
background when the run starts, `--tune-predict-ahead`, so the predictions are ready when the
row's turn comes), the rows of this run whose knobs are a config of the space (e.g. slapo_gpu)
enter the trial database as measured, and `slapo.tune.best.tune_best` (the tuner's guided
search, `driver.tune`) measures at most `--tune-trials` new configs, `--tune-steps` steps each,
each trial in its own process, none started after `--tune-budget-s` (also cut to what the
deadline leaves). Under `--cap-gib` configs predicted above the cap are never tried and a trial
peaking above it counts as OOM. The winner is then measured in the same process (its CUDA
context is fresh: the trials ran in other processes) by the same `measure` as every other
variant; a winner that is one of this run's rows (a seeded config) is that row, marked
`measured_by`, since it was measured by exactly this protocol. The row adds `tuned_knobs`,
`predicted_tokens_per_s` / `predicted_step_ms` / `predicted_peak_gib` (the cost model at
`--tune-efficiency`), `tune_s` (predictions waited for + search) and `tune` (every trial,
predicted vs measured). Its `compile_s` is warm: the trials compiled the same graphs.

Budget (one H100/H200, from the per-process wall times of
`benchmarks/results/gpu_train_h100.jsonl`; each includes ~12 s of process start, imports, model
build and matmul peak): hf_sdpa 14-18 s per model; hf_compile 60 (LLaMA) + 71..111 (GPT-2) +
97 s (BERT); hf_liger 22 s (LLaMA only; GPT-2/BERT rows need no process); slapo_gpu 29 + 25..39
+ 30 s; slapo_tuned ~12 s + 12-25 s per trial. The whole default list is ~450-540 s, more
than one 8-minute run holds with anything else: `benchmarks/gpu_session.sh` splits the work
into time-boxed invocations, most important first (its header has the plan), using `--skip
MODEL:VARIANT` (a row left to a later invocation) and `--deadline-s` (no variant started with
less than `--min-child-s` left, 60 s for hf_compile and slapo_tuned; a row the deadline
reaches is `skipped: --deadline-s`, a child past it is killed and its row says `timeout`).

`--cap-gib C` limits each process to C GiB (`torch.cuda.set_per_process_memory_fraction`) and
tries batch sizes upward from `--cap-batches` until one does not fit: the row reports the
largest batch that fits and its tokens/s ("what fits a 24 GiB card"). slapo_tuned searches
those batches instead and measures the one it picked.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# slapo_tuned's trials fork from a server that imported torch: `torch.cuda.is_available()` in an
# import must not initialise the CUDA driver there (NVML answers it without that).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: slapo
# the helper module beside this file (also when the file is loaded by path, as the tests do)
sys.path.append(str(Path(__file__).resolve().parent))
import gpu_train_rows as rows  # noqa: E402

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
    # LLaMA-3-8B's layer shapes (hidden 4096, SwiGLU 14336, 32 query / 8 KV heads, vocab
    # 128256, rope theta 5e5) with 8 of its 32 layers (issue 36: the GEMMs where FP8 pays)
    "llama3-8b-8l": ("LlamaConfig", "LlamaForCausalLM",
                     dict(hidden_size=4096, num_hidden_layers=8, num_attention_heads=32,
                          num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                          max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                          tie_word_embeddings=False), 4, 2048),
    # tiny twins for a CPU smoke run of this script (--tiny): same code paths, small shapes
    "tiny-gpt2": ("GPT2Config", "GPT2LMHeadModel",
                  dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512, n_positions=64), 2, 64),
    "tiny-llama": ("LlamaConfig", "LlamaForCausalLM",
                   dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, vocab_size=512,
                        max_position_embeddings=64), 2, 64),
    "tiny-llama3": ("LlamaConfig", "LlamaForCausalLM",
                    dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=1, intermediate_size=224, vocab_size=1024,
                         max_position_embeddings=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=False), 2, 64),
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
    "slapo_gpu_nocudnn": dict(attention="sdpa", compile_blocks=True, fused_loss=True),
}
SLAPO_KNOBS.update(rows.KNOBS)  # slapo_fp8, slapo_offload, slapo_optim_offload (issue 36)
NOCUDNN_VARIANTS = ("slapo_gpu_nocudnn", "hf_sdpa_nocudnn")
TUNED = "slapo_tuned"
HF_VARIANTS = ("hf_eager", "hf_sdpa", "hf_sdpa_nocudnn", "hf_compile", "hf_liger")
# The default run, headline first, slapo_tuned last (it seeds from slapo_gpu's rows; see the
# budget in the module docstring). hf_eager OOMs at these batches, slapo_ready is the first
# measurement's schedule, the others are checks: ask for them with --variants.
VARIANTS = ("slapo_gpu", "hf_sdpa", "hf_compile", "hf_liger", TUNED)
ALL_VARIANTS = HF_VARIANTS + tuple(SLAPO_KNOBS) + (TUNED,)
DATASHEET_TFLOPS = 989.0
# Dropout probabilities of each family's config (`--dropout P` sets them all).
DROPOUT_KEYS = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
                "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
                "llama": ("attention_dropout",)}
# slapo_tuned's space: knob -> candidates (`--tune-knob` replaces an entry). Uncapped, the
# speed knobs at the table's batch (8 configs); under a cap, the memory knobs x the cap batches
# (5 x 4 = 20 configs: each prediction is a fake step of 10-60 s of CPU, and kernels barely
# move memory).
TUNE_SPACE = {"compile_blocks": (False, True), "fused_loss": (False, True),
              "kernels": (False, True), "ckpt_ratio": (0.0,), "ckpt_policy": ("full",)}
TUNE_SPACE_CAPPED = {"compile_blocks": (True,), "fused_loss": (True,), "kernels": (False,),
                     "ckpt_ratio": (0.0, 0.5, 1.0), "ckpt_policy": ("full", "selective")}
# Rows slapo_tuned may take as measured configs (same knobs, same protocol).
# Not the issue-36 rows: another precision, offload knobs the space lacks, another optimizer.
SEED_VARIANTS = tuple(v for v in SLAPO_KNOBS if v not in NOCUDNN_VARIANTS + tuple(rows.KNOBS))
# A child started with less time left than this would be killed before its row: skipped.
MIN_LEFT_S = {"hf_compile": 60.0, TUNED: 60.0}


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


def spec_of(name: str, dropout: float | None = None):
    """`slapo.tune.model_spaces.GPUModelSpec` of a benchmark model (the tuner's trials and
    cost model build exactly this), its dropout set when `dropout` is given."""
    from slapo.tune.model_spaces import GPUModelSpec

    cfg_cls, model_cls, kw, batch, seq = MODELS[name]
    kw = dict(kw)
    if dropout is not None:
        family = {"GPT2Config": "gpt2", "LlamaConfig": "llama", "BertConfig": "bert"}[cfg_cls]
        kw.update(dict.fromkeys(DROPOUT_KEYS[family], float(dropout)))
    return GPUModelSpec(name, cfg_cls, model_cls, kw, batch, seq)


def make_model(name: str, variant: str, device, dropout: float | None = None):
    import torch
    import transformers

    spec = spec_of(name, dropout)
    cfg = getattr(transformers, spec.config_class)(**spec.kwargs)
    if variant == "hf_eager":
        cfg._attn_implementation = "eager"
    if variant == "hf_liger":
        _apply_liger(cfg.model_type)
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, spec.model_class)(cfg)
    model.train()
    return model, cfg


def _apply_liger(model_type: str) -> None:
    import liger_kernel.transformers as lk  # noqa: F401  (ImportError: variant skipped)

    fn = getattr(lk, f"apply_liger_kernel_to_{model_type}", None)
    if fn is None:
        raise RuntimeError(f"Liger-Kernel has no kernels for {model_type}")
    fn()


def liger_problem(name: str) -> str | None:
    """Why hf_liger cannot run for `name` (not installed, no kernels for the family), or None:
    checked in the parent so that a row that cannot run costs no process (~10 s each)."""
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return "No module named 'liger_kernel'"
    model_type = spec_of(name).model_type
    try:
        import liger_kernel.transformers as lk
    except Exception as e:  # noqa: BLE001 - reported as the row's failure
        return f"{type(e).__name__}: {e}"
    if getattr(lk, f"apply_liger_kernel_to_{model_type}", None) is None:
        return f"RuntimeError: Liger-Kernel has no kernels for {model_type}"
    return None


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


def slapo_step_fn(model, variant: str, lr: float = 1e-4, knobs: dict | None = None,
                  opts: dict | None = None):
    """The variant's knobs (or `knobs`: slapo_tuned's winner) through `model_schedule.apply`
    and `slapo.build(mixed_precision="bf16")`; `opts`: `--knob` overrides and the issue-36
    rows' build arguments (`gpu_train_rows`)."""
    import inspect

    import torch

    import slapo
    from slapo import model_schedule

    opts = opts or {}
    if knobs is None:
        knobs = {**SLAPO_KNOBS[variant], **opts.get("knob", {})}
    sch = model_schedule.apply(model, **knobs)
    rows.prepare(model, variant)
    kwargs = dict(optimizer=torch.optim.AdamW, optimizer_kwargs=dict(lr=lr, fused=True))
    extra = rows.build_kwargs(variant, opts.get("fp8_min_dim", rows.FP8_MIN_DIM))
    native = "mixed_precision" in inspect.signature(slapo.build).parameters
    if native and "precision" not in extra:
        kwargs["mixed_precision"] = "bf16"
    trained, _ = slapo.build(sch, **kwargs, **extra)

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
            profile_to: str | None = None, knobs: dict | None = None,
            dropout: float | None = None, opts: dict | None = None) -> dict:
    """Build, warm up and time one variant at one batch size (in this process). `knobs`
    replaces a Slapo variant's knob set (slapo_tuned's winner); `opts` as `slapo_step_fn`."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, cfg = make_model(name, variant, device, dropout)
    step = hf_step_fn(model, variant) if variant in HF_VARIANTS else \
        slapo_step_fn(model, variant, knobs=knobs, opts=opts)
    data = make_batch(name, cfg, batch, seq, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    from torch._dynamo.utils import counters  # graph breaks: each costs step time on a GPU

    counters.clear()
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
               mfu=flops * tps / (DATASHEET_TFLOPS * 1e12),
               graph_breaks=sum(counters["graph_break"].values()),
               graphs=counters["stats"]["unique_graphs"])
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if variant in rows.KNOBS:
        row.update(rows.report(model, variant, (opts or {}).get("fp8_min_dim", 0)))
    return row


# ------------------------------------------------------------------------------------------------
# slapo_tuned: the tuner's search, then the winner measured like every variant
# ------------------------------------------------------------------------------------------------

def tune_candidates(args) -> dict:
    """slapo_tuned's knob candidates: the uncapped or capped default, `--tune-knob` applied."""
    space = dict(TUNE_SPACE_CAPPED if args.cap_gib else TUNE_SPACE)
    space.update(dict(args.tune_knob))
    return space


def tune_search(name: str, args):
    """The GPU space of `name` for slapo_tuned (`slapo.tune.best.gpu_search_setup`, narrowed
    to `tune_candidates`), with its trial evaluator."""
    from slapo.tune.best import gpu_search_setup, restrict
    from slapo.tune.model_spaces import GPUSpaceArgs

    spec = spec_of(name, args.dropout)
    cands = tune_candidates(args)
    batches = _cap_batches(args) if args.cap_gib else (spec.batch,)
    extra = tuple((k, tuple(v)) for k, v in cands.items() if k not in _SPACE_OWN)
    space_args = GPUSpaceArgs(batch_sizes=batches, mixed_precision=("bf16",),
                              attention=tuple(cands.get("attention", ("sdpa",))),
                              ckpt_ratios=tuple(cands["ckpt_ratio"]),
                              ckpt_policies=tuple(cands["ckpt_policy"]), extra=extra)
    device = "cuda" if _cuda() else "cpu"
    found = gpu_search_setup(spec, space_args, device=device, steps=args.tune_steps, warmup=1,
                             mem_cap_bytes=_cap_bytes(args), trial_timeout=args.timeout,
                             efficiency=args.tune_efficiency,
                             start_method=args.tune_start_method,
                             prune=False)
    restrict(found.space, {k: v for k, v in cands.items() if k in _RESTRICTED})
    return spec, found


_SPACE_OWN = ("attention", "compile_blocks", "fused_loss", "kernels", "ckpt_ratio", "ckpt_policy")
_RESTRICTED = ("compile_blocks", "fused_loss", "kernels")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _cap_bytes(args) -> int | None:
    return int(args.cap_gib * 2**30) if args.cap_gib else None


def _cap_batches(args) -> tuple[int, ...]:
    return tuple(int(b) for b in args.cap_batches.split(","))


def predictions_path(out: Path, name: str, args) -> Path:
    """One file per (model, invocation): the background predictor and the tuned child of one
    run share it; another run (other dropout, knobs or code) never reads it."""
    cap = f".cap{args.cap_gib:g}" if args.cap_gib else ""
    return Path(out) / f"predictions.{name}{cap}.{args.run_id}.jsonl"


def load_predictions(path: Path) -> dict[str, dict]:
    """{config_key: prediction} of a predictions file (a line cut by a killed writer is
    skipped)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["key"]] = rec["prediction"]
    return out


def predict_missing(name: str, args, configs: list[dict], nice: int = 0) -> dict[str, dict]:
    """Every config's prediction: those in the model's predictions file, the rest computed
    (`--tune-workers` processes) and appended to it."""
    from slapo.tune.best import predict_configs
    from slapo.tune.space import config_key

    path = predictions_path(Path(args.out), name, args)
    have = load_predictions(path)
    todo = [c for c in configs if config_key(c) not in have]

    def append(config: dict, pred: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps({"key": config_key(config), "prediction": pred}) + "\n")

    have.update(predict_configs(spec_of(name, args.dropout), todo, efficiency=args.tune_efficiency,
                                workers=args.tune_workers, nice=nice, on_result=append))
    return have


def seed_rows(name: str, args) -> list[tuple[dict, dict]]:
    """(config, metrics) of this run's rows of `name` whose variant is a knob set of the space,
    measured under the same cap, seq, dropout and cuDNN setting (slapo_tuned's seeds)."""
    path = Path(args.out) / "results.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []
    out = []
    for r in rows:
        if (r.get("run_id") != args.run_id or r.get("model") != name or r.get("status") != "ok"
                or r.get("variant") not in SEED_VARIANTS
                or (r.get("cap_gib") or 0) != (args.cap_gib or 0)):
            continue
        config = {"mixed_precision": "bf16", **SLAPO_KNOBS[r["variant"]],
                  "batch_size": int(r["batch"])}
        metrics = {"throughput": r["tokens_per_s"], "step_time_s": r["step_ms"] / 1e3,
                   "source": r["variant"]}
        if r.get("peak_gib") is not None:
            metrics["peak_memory_bytes"] = r["peak_gib"] * 2**30
        out.append((config, metrics))
    return out


def run_tuning(name: str, args):
    """The search of slapo_tuned (no CUDA in this process: predictions are fake steps, trials
    run in their own processes), bounded by `--tune-budget-s` from its start (the predictions
    it waits for included). Returns (`BestSchedule`, seconds spent, `_calibration`)."""
    from slapo.tune.best import seed_database, tune_best
    from slapo.tune.database import Database

    t0 = time.perf_counter()
    _, found = tune_search(name, args)
    configs = found.space.configs()
    if not configs:
        raise ValueError("slapo_tuned: the space is empty (check --tune-knob)")
    predictions = predict_missing(name, args, configs)
    cap = f".cap{args.cap_gib:g}" if args.cap_gib else ""
    db = Database(Path(args.out) / f"tune.{name}{cap}.{args.run_id}.db")
    seeds = seed_rows(name, args)
    entered = seed_database(db, found.space, seeds)
    budget = max(0.0, args.tune_budget_s - (time.perf_counter() - t0))
    best = tune_best(found.space, predictions, found.evaluate, db, mem_cap=_cap_bytes(args),
                     max_trials=args.tune_trials, budget_s=budget,
                     min_trial_s=5.0 if args.tiny else 25.0)
    return best, time.perf_counter() - t0, _calibration(db, entered, predictions)


def _calibration(db, entered: list[dict], predictions: dict) -> dict:
    """measured / predicted step time of the first seeded row (slapo_gpu in the default run):
    the factor that calibrates the cost model's time on this device, as
    `GPUCostModel.calibrate` would. Empty when nothing was seeded."""
    from slapo.tune.space import config_key

    for config in entered:
        rec, pred = db.get(config), predictions.get(config_key(config), {})
        if rec is not None and rec.metrics.get("step_time_s") and pred.get("step_time_s"):
            return {"seeded_configs": len(entered), "calibrated_on": rec.metrics.get("source"),
                    "time_ratio": rec.metrics["step_time_s"] / pred["step_time_s"]}
    return {"seeded_configs": len(entered)}


def tuned_row(name: str, seq: int, args, best, tune_s: float, cal: dict) -> dict:
    """slapo_tuned's row: the winner of `run_tuning` measured by `measure` (or, if the
    winner is one of this run's rows, that row), with the search's record. With a seeded row,
    `predicted_step_ms_calibrated` is the prediction times that row's measured/predicted
    ratio (the cost model calibrated on this device, in this run)."""
    from slapo.tune.model_spaces import schedule_knobs
    from slapo.tune.space import config_key

    info = dict(tune_s=tune_s, tune=best.to_json(), tune_trials=best.report.new_trials,
                seeded_configs=cal["seeded_configs"])
    if best.config is None:
        return dict(model=name, variant=TUNED, seq=seq, status="failed: no trial succeeded "
                    f"({best.report.stopped_because})", **info)
    knobs = {k: v for k, v in schedule_knobs(best.config).items()
             if k in best.config or v != _default(k)}
    batch = int(best.config["batch_size"])
    if best.seeded:
        row = _seed_row(name, args, best.measured.get("source"), batch)
    else:
        row = _measure_tuned(name, batch, seq, args, knobs)
    p = best.predicted
    row.update(variant=TUNED, tuned_knobs=knobs, tuned_config_key=config_key(best.config),
               predicted_tokens_per_s=p.get("throughput"),
               predicted_step_ms=1e3 * p["step_time_s"] if "step_time_s" in p else None,
               predicted_peak_gib=p["memory"] / 2**30 if "memory" in p else None, **info)
    if "time_ratio" in cal and row["predicted_step_ms"] is not None:
        row.update(predicted_step_ms_calibrated=row["predicted_step_ms"] * cal["time_ratio"],
                   calibrated_on=cal["calibrated_on"])
    return row


def _measure_tuned(name: str, batch: int, seq: int, args, knobs: dict) -> dict:
    """The winner by `measure`; out of memory (under `--cap-gib`) is the row's status, as for
    the other variants' batch sizes."""
    import torch

    prof = str(Path(args.out) / f"profile.{name}.{TUNED}.txt") if args.profile else None
    try:
        return measure(name, TUNED, batch, seq, args.steps, args.warmup, prof, knobs=knobs,
                       dropout=args.dropout)
    except torch.OutOfMemoryError:
        return dict(model=name, variant=TUNED, batch=batch, seq=seq, status="OOM")


def _default(knob: str):
    from slapo.tune.model_spaces import apply_knobs

    return apply_knobs().get(knob)


def _seed_row(name: str, args, variant: str | None, batch: int) -> dict:
    """The latest row of this run for (name, variant, batch): what a seeded winner reports."""
    path = Path(args.out) / "results.jsonl"
    rows = [json.loads(ln) for ln in path.read_text().splitlines()]
    mine = [r for r in rows if r.get("run_id") == args.run_id and r.get("model") == name
            and r.get("variant") == variant and r.get("batch") == batch
            and r.get("status") == "ok"]
    row = {k: v for k, v in mine[-1].items() if k not in ("wall_s", "child_s")}
    row["measured_by"] = variant
    return row


# ------------------------------------------------------------------------------------------------
# the child process of one (model, variant)
# ------------------------------------------------------------------------------------------------

def _cap_process(args) -> None:
    import torch

    if args.cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total))


def _sdp_setting(args) -> bool:
    """Turn cuDNN's SDPA off for a nocudnn variant or `--no-cudnn-sdp`; returns whether it is
    on (torch without the switch: on)."""
    import torch

    off = args.variants in NOCUDNN_VARIANTS or args.no_cudnn_sdp
    if off and hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)
    return not off


def _stamp(row: dict, args, cudnn: bool, peak: float | None) -> dict:
    row.setdefault("status", "ok")
    row.update(cap_gib=args.cap_gib, dropout=args.dropout, cudnn_sdp=cudnn, run_id=args.run_id)
    if peak and row.get("tokens_per_s"):
        row["matmul_tflops"] = peak
        row["mfu_measured"] = row["mfu"] * DATASHEET_TFLOPS / peak
    return row


def child(args) -> None:
    """Run one (model, variant) and print one JSON line per batch size tried."""
    import torch

    _, _, _, batch, seq = MODELS[args.models]
    cudnn = _sdp_setting(args)
    if args.variants == TUNED:  # the search first: this process's CUDA context stays fresh
        best, tune_s, cal = run_tuning(args.models, args)
        _cap_process(args)
        peak = matmul_tflops() if torch.cuda.is_available() and not args.tiny else None
        row = tuned_row(args.models, seq, args, best, tune_s, cal)
        print(json.dumps(_stamp(row, args, cudnn, peak)), flush=True)
        return
    from slapo.errors import SchedulingError

    _cap_process(args)
    batches = list(_cap_batches(args)) if args.cap_gib else [batch]
    peak = matmul_tflops() if torch.cuda.is_available() and not args.tiny else None
    opts = dict(knob=dict(args.knob), fp8_min_dim=args.fp8_min_dim)
    for b in batches:
        try:
            prof = (str(Path(args.out) / f"profile.{args.models}.{args.variants}.txt")
                    if args.profile else None)
            row = measure(args.models, args.variants, b, seq, args.steps, args.warmup, prof,
                          dropout=args.dropout, opts=opts)
        except SchedulingError as e:  # fp8 refused here (torchao, the GPU): a clear row
            if args.variants not in rows.FP8:
                raise
            print(json.dumps(_stamp(dict(model=args.models, variant=args.variants, batch=b,
                                         seq=seq, status=f"skipped: {e}"[:300]),
                                    args, cudnn, None)), flush=True)
            break
        except torch.OutOfMemoryError:
            print(json.dumps(_stamp(dict(model=args.models, variant=args.variants, batch=b,
                                         seq=seq, status="OOM"), args, cudnn, None)),
                  flush=True)
            break
        print(json.dumps(_stamp(row, args, cudnn, peak)), flush=True)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def predict_child(args) -> None:
    """The background predictor (`--tune-predict-ahead`): slapo_tuned's predictions of every
    model, appended to their files, at lowered priority beside the measured variants."""
    import warnings

    warnings.simplefilter("ignore")
    os.nice(10)
    for name in args.models.split(","):
        _, found = tune_search(name, args)
        predict_missing(name, args, found.space.configs(), nice=10)


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
    predictor = _start_predictor(args, out)
    try:
        for variant in args.variants.split(","):
            for name in args.models.split(","):
                left = args.deadline_s - (time.perf_counter() - start) if args.deadline_s else None
                got = _run_one(args, name, variant, out, left)
                for r in got:
                    r.setdefault("run_id", args.run_id)
                    r["wall_s"] = time.perf_counter() - start
                    rows.append(r)
                    with jsonl.open("a") as f:
                        f.write(json.dumps(r) + "\n")
                    print(_line(r), flush=True)
    finally:
        _stop(predictor)
    return rows


def _run_one(args, name: str, variant: str, out: Path, left: float | None) -> list[dict]:
    """The rows of one (model, variant): a child process, or a row that needs none (deadline
    reached, Liger without kernels for the family)."""
    if f"{name}:{variant}" in args.skip.split(","):
        return [dict(model=name, variant=variant, status="skipped: --skip")]
    if left is not None and left < max(args.min_child_s, MIN_LEFT_S.get(variant, 0.0)):
        return [dict(model=name, variant=variant, status="skipped: --deadline-s")]
    if variant == "hf_liger":
        why = liger_problem(name)
        if why:
            return [dict(model=name, variant=variant, status=f"failed: {why}")]
    why = rows.problem(variant)
    if why:
        return [dict(model=name, variant=variant, status=f"skipped: {why}")]
    timeout = args.timeout if left is None else min(args.timeout, int(left))
    t0 = time.perf_counter()
    got = _run_child(args, name, variant, out, timeout, left)
    for r in got:
        r["child_s"] = time.perf_counter() - t0
    return got


def _start_predictor(args, out: Path):
    """Start the background predictor when slapo_tuned is to run (`--tune-predict-ahead`)."""
    if TUNED not in args.variants.split(",") or not args.tune_predict_ahead:
        return None
    cmd = [sys.executable, __file__, "--predict-child", *_shared_flags(args, args.models, TUNED)]
    log = (out / "predict.log").open("a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc) -> None:
    """End the background predictor and its workers (its own process group)."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _shared_flags(args, models: str, variant: str) -> list[str]:
    """The options a child needs, as flags."""
    cmd = ["--models", models, "--variants", variant, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--cap-gib", str(args.cap_gib),
           "--cap-batches", args.cap_batches, "--out", str(args.out), "--run-id", args.run_id,
           "--timeout", str(args.timeout), "--tune-trials", str(args.tune_trials),
           "--tune-steps", str(args.tune_steps), "--tune-workers", str(args.tune_workers),
           "--tune-efficiency", str(args.tune_efficiency),
           "--tune-start-method", args.tune_start_method]
    for k, vals in args.tune_knob:
        cmd += ["--tune-knob", f"{k}={','.join(str(v).lower() for v in vals)}"]
    for k, v in args.knob:
        cmd += ["--knob", f"{k}={str(v).lower()}"]
    cmd += ["--fp8-min-dim", str(args.fp8_min_dim)]
    if args.dropout is not None:
        cmd += ["--dropout", str(args.dropout)]
    for flag in ("profile", "tiny", "no_cudnn_sdp"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return cmd


def _run_child(args, name: str, variant: str, out: Path, timeout: int,
               left: float | None) -> list[dict]:
    cmd = [sys.executable, __file__, "--child", *_shared_flags(args, name, variant)]
    if variant == TUNED:  # trials stop in time for the final measurement
        budget = args.tune_budget_s if left is None else min(args.tune_budget_s, left - 60)
        cmd += ["--tune-budget-s", str(max(budget, 0.0))]
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
    line = (f"{r['model']:12s} {r['variant']:18s} b={r['batch']:<4d} "
            f"{r['tokens_per_s'] / 1e3:8.1f}k tok/s  MFU {100 * r['mfu']:5.1f}%  "
            f"peak {r.get('peak_gib') or 0:5.1f} GiB  compile {r['compile_s']:5.1f}s  "
            f"loss {r['loss_first']:.4f}->{r['loss_last']:.4f}")
    if "fp8_gemms" in r:
        line += f"  fp8 GEMMs {r['fp8_gemms']}{' (emulated)' if r['fp8_emulated'] else ''}"
    if "offloaded_layers" in r:
        line += (f"  offload {r['offloaded_layers']} layers {r['offload_tensors']} tensors "
                 f"{r['offload_gib']:.2f} GiB")
    if r.get("optimizer_offload"):
        line += "  optimizer on host"
    if r["variant"] == TUNED:
        line += f"\n{'':12s} {'':18s} {_tuned_summary(r)}"
    return line


def _tuned_summary(r: dict) -> str:
    """Chosen knobs, predicted vs measured, and the search's cost, in one line."""
    knobs = " ".join(f"{k}={v}" for k, v in sorted(r.get("tuned_knobs", {}).items()))
    pred = r.get("predicted_tokens_per_s")
    pred_s = f"predicted {pred / 1e3:.1f}k tok/s" if pred else "no prediction"
    if r.get("predicted_peak_gib") is not None:
        pred_s += f", {r['predicted_peak_gib']:.1f} GiB"
    if r.get("predicted_step_ms_calibrated") is not None:
        pred_s += (f", {r['predicted_step_ms_calibrated']:.1f} ms calibrated on "
                   f"{r['calibrated_on']} vs {r['step_ms']:.1f} ms measured")
    by = f", measured by {r['measured_by']}" if r.get("measured_by") else ""
    return (f"tuned: {knobs}; {pred_s}; {r.get('tune_trials', 0)} new trials, "
            f"{r.get('seeded_configs', 0)} seeded, {r.get('tune_s', 0):.0f} s{by}")


def print_table(rows: list[dict]) -> None:
    """Per model: each variant's rows, and their ratio to the best baseline of this run."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="training throughput, one process per variant (bf16 autocast)")
    for col in ("model", "variant", "batch", "tokens/s", "vs best HF", "vs slapo_gpu", "MFU",
                "peak GiB", "compile s", "graphs/breaks", "loss", "status"):
        table.add_column(col)
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == name]
        ok = [r for r in mine if r.get("status") == "ok"]
        best_hf = max((r["tokens_per_s"] for r in ok if r["variant"] in HF_VARIANTS), default=0)
        gpu = {r["batch"]: r["tokens_per_s"] for r in ok if r["variant"] == "slapo_gpu"}
        for r in mine:
            if r.get("status") != "ok":
                table.add_row(name, r["variant"], str(r.get("batch", "")), "", "", "", "", "",
                              "", "", "", r["status"])
                continue
            ratio = f"{r['tokens_per_s'] / best_hf:.2f}x" if best_hf else ""
            vs_gpu = (f"{r['tokens_per_s'] / gpu[r['batch']]:.2f}x"
                      if r["batch"] in gpu and r["variant"] != "slapo_gpu" else "")
            table.add_row(name, r["variant"], str(r["batch"]), f"{r['tokens_per_s']:,.0f}",
                          ratio, vs_gpu, f"{100 * r['mfu']:.1f}%", f"{r.get('peak_gib') or 0:.1f}",
                          f"{r['compile_s']:.1f}",
                          f"{r.get('graphs', '-')}/{r.get('graph_breaks', '-')}",
                          f"{r['loss_last']:.4f}", "ok")
    Console(width=170).print(table)
    for r in rows:
        if r.get("variant") == TUNED and r.get("status") == "ok":
            print(f"{r['model']}: {_tuned_summary(r)}")


def _knob_option(text: str) -> tuple[str, tuple]:
    from slapo.tune.model_spaces import parse_knob_option

    try:
        return parse_knob_option(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _one_knob(text: str) -> tuple[str, object]:
    name, vals = _knob_option(text)
    if len(vals) != 1:
        raise argparse.ArgumentTypeError(f"--knob {text!r}: one value (NAME=VALUE)")
    return name, vals[0]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--models", default="llama-1b,gpt2-medium,bert-large")
    a("--variants", default=",".join(VARIANTS),
      help=f"comma-separated, from {', '.join(ALL_VARIANTS)}")
    a("--steps", type=int, default=10)
    a("--warmup", type=int, default=4)
    a("--cap-gib", type=float, default=0.0)
    a("--cap-batches", default="8,16,32,64")
    a("--timeout", type=int, default=240, help="seconds per variant")
    a("--deadline-s", type=int, default=0,
      help="stop starting variants after this many seconds (0: no limit); fits "
      "the whole table into one device call")
    a("--out", default="runs/gpu_train")
    a("--tiny", action="store_true", help="CPU smoke run (tiny configs)")
    a("--profile", action="store_true",
      help="also write each variant's top CUDA kernels (torch.profiler)")
    a("--dropout", type=float, default=None,
      help="set every dropout probability of the models' configs (default: HF's, 0.1 in "
      "GPT-2 and BERT); e.g. 0 for the GPT-2 loss check")
    a("--no-cudnn-sdp", action="store_true",
      help="turn cuDNN's SDPA backend off in every variant (torch.backends.cuda)")
    a("--tune-trials", type=int, default=2, help="slapo_tuned: new measured trials at most")
    a("--tune-budget-s", type=float, default=45.0,
      help="slapo_tuned: seconds of search per model (predictions waited for included)")
    a("--tune-steps", type=int, default=3, help="slapo_tuned: timed steps per trial")
    a("--tune-workers", type=int, default=None,
      help="slapo_tuned: prediction processes (default: half the cores, at most 8; 1 with "
      "--tiny)")
    a("--tune-knob", action="append", type=_knob_option, default=[], metavar="NAME=V1,V2",
      help="slapo_tuned: candidates of a knob (e.g. compile_blocks=true, ckpt_ratio=0,1)")
    a("--tune-efficiency", type=float, default=1.0,
      help="slapo_tuned: the cost model's efficiency (docs/tune.md)")
    a("--tune-start-method", choices=("forkserver", "spawn"), default="forkserver",
      help="slapo_tuned: how trial processes start (forkserver: no imports per trial; spawn: "
      "the CLI's, ~10 s more per trial)")
    a("--tune-predict-ahead", action=argparse.BooleanOptionalAction, default=True,
      help="slapo_tuned: predict in the background from the start of the run")
    a("--knob", action="append", type=_one_knob, default=[], metavar="NAME=VALUE",
      help="replace a schedule knob of every Slapo row but slapo_tuned (e.g. offload_ratio=0.25, "
      "compile_blocks=false)")
    a("--fp8-min-dim", type=int, default=None,
      help=f"slapo_fp8: Float8Config.min_dim (default {rows.FP8_MIN_DIM}; "
      f"{rows.TINY_FP8_MIN_DIM} with --tiny)")
    a("--skip", default="", metavar="MODEL:VARIANT,...",
      help="rows not to run in this invocation (a 'skipped: --skip' row each; e.g. "
      "bert-large:hf_compile)")
    a("--min-child-s", type=float, default=30.0,
      help="with --deadline-s: start no variant with less time left (hf_compile and "
      "slapo_tuned: at least 60 s)")
    a("--table-from", metavar="JSONL", default=None,
      help="only print the table of the rows in JSONL (gpu_session.sh's results.N.jsonl)")
    a("--child", action="store_true", help=argparse.SUPPRESS)
    a("--predict-child", action="store_true", help=argparse.SUPPRESS)
    a("--run-id", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    _check(p, args)
    return args


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors (exit 2) before anything runs or is written."""
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in ALL_VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(ALL_VARIANTS)}")
    names = [m if args.child or args.predict_child or not args.tiny
             else f"tiny-{m.split('-')[0]}" for m in args.models.split(",")]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"unknown model(s) {', '.join(bad)}; choose from "
                f"{', '.join(m for m in MODELS if not m.startswith('tiny-'))}")
    if args.dropout is not None and not 0.0 <= args.dropout < 1.0:
        p.error(f"--dropout must be in [0, 1), got {args.dropout}")
    for name in ("tune_trials", "tune_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tune_budget_s < 0 or not args.tune_efficiency > 0:
        p.error("--tune-budget-s must be >= 0 and --tune-efficiency > 0")
    try:
        _cap_batches(args)
    except ValueError:
        p.error(f"--cap-batches must be comma-separated integers, got {args.cap_batches!r}")
    if args.fp8_min_dim is None:
        args.fp8_min_dim = rows.TINY_FP8_MIN_DIM if args.tiny else rows.FP8_MIN_DIM
    if args.fp8_min_dim < 16:
        p.error(f"--fp8-min-dim must be >= 16, got {args.fp8_min_dim}")
    bad = [s for s in args.skip.split(",") if s and s.partition(":")[2] not in ALL_VARIANTS]
    if bad:
        p.error(f"--skip takes MODEL:VARIANT pairs, got {', '.join(bad)}")
    if args.tune_workers is None:
        args.tune_workers = 1 if args.tiny else max(1, min(8, (os.cpu_count() or 2) // 2))


def table_from(path: str) -> None:
    """The table of rows gathered from several invocations (`gpu_session.sh`'s results.N.jsonl:
    one device call), ratios per model, cap and dropout setting."""
    got = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    table = []
    for r in got:
        if "model" not in r:
            continue
        tag = (f" cap {r['cap_gib']:g}" if r.get("cap_gib") else "") + \
            (f" p={r['dropout']:g}" if r.get("dropout") is not None else "")
        table.append({**r, "model": r["model"] + tag})
    print_table(table)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.table_from:
        return table_from(args.table_from)
    if args.child:
        return child(args)
    if args.predict_child:
        return predict_child(args)
    if args.tiny:
        args.models = ",".join(f"tiny-{m.split('-')[0]}" for m in args.models.split(","))
        args.skip = ",".join(f"tiny-{s.split('-')[0]}:{s.partition(':')[2]}"
                             for s in args.skip.split(",") if s)
    args.run_id = args.run_id or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    rows = run_all(args)
    print_table(rows)
    (Path(args.out) / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
