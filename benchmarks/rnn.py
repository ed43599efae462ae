"""Recurrent models: the unscheduled nn.LSTM / nn.GRU vs each `apply_rnn` variant, in one run.

    python benchmarks/rnn.py [--kinds lstm,gru] [--device cpu|cuda] [--out rnn.json]

The model is a word-level language model (PyTorch's word_language_model: embedding -> 2-layer
RNN -> linear). A training step is forward + next-token cross-entropy + backward + SGD step.
For each variant (`--variants`; default: every layout, the compiled cell, and time-chunk
checkpointing at two chunk sizes) it reports

* tokens/s: median over `--rounds` rounds, the variants alternating within each round (a shared
  VM has slow phases lasting seconds; alternating spreads them over all variants);
* saved MiB: the bytes one forward leaves saved for backward (`slapo.profile.saved_bytes`,
  parameters excluded): the activation memory the schedule changes;
* peak MiB (CUDA only): `slapo.profile.meter` over one step above what is allocated before it
  (on CPU the meter is the process RSS, which the allocator's reuse hides: shown as "-");
* verified: logits, final states and every gradient equal the unscheduled model's (fp32,
  rtol 1e-4; cuDNN's TF32 is switched off for the comparison).

Absolute numbers on a shared CPU VM are noise; read the ratios within one run.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from torch import nn  # noqa: E402

from slapo.model_schedule.rnn import apply_rnn  # noqa: E402
from slapo.profile import meter, saved_bytes  # noqa: E402

# name -> apply_rnn knobs; "unscheduled" is the model as written (fused=False)
VARIANTS = {
    "unscheduled": {"fused": False},
    "fused gates_major": {"layout": "gates_major"},
    "fused hidden_major": {"layout": "hidden_major"},
    "fused batch_minor": {"layout": "batch_minor"},
    "compiled cell": {"layout": "gates_major", "compile_cell": True},
    "ckpt chunk 8": {"layout": "gates_major", "ckpt_chunk": 8},
    "ckpt chunk 32": {"layout": "gates_major", "ckpt_chunk": 32},
}


class WordLM(nn.Module):
    """embedding -> RNN -> linear (PyTorch's word_language_model, without dropout)."""

    def __init__(self, kind: str, vocab: int, emb: int, hidden: int, layers: int):
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = getattr(nn, kind.upper())(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor):
        out, hidden = self.rnn(self.encoder(ids))
        return self.decoder(out), hidden


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits, _ = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def verified(model: nn.Module, base: nn.Module, ids: torch.Tensor) -> bool:
    """Outputs (logits, h_n[, c_n]) and every parameter gradient equal the baseline's."""
    pairs = []
    for m in (base, model):
        m.zero_grad(set_to_none=True)
        out = m(ids[:, :-1])
        F.cross_entropy(out[0].flatten(0, 1), ids[:, 1:].flatten()).backward()
        pairs.append(([t.detach() for t in _flat(out)], [p.grad for p in m.parameters()]))
    (out_b, g_b), (out_m, g_m) = pairs
    for m in (base, model):
        m.zero_grad(set_to_none=True)
    return all(torch.allclose(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
               for a, b in zip(out_m + g_m, out_b + g_b, strict=True))


def step_time(model: nn.Module, opt, ids: torch.Tensor, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    lm_loss(model, ids).backward()
    opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def peak_of_step(model: nn.Module, opt, ids: torch.Tensor, device: torch.device) -> int | None:
    """CUDA peak memory of one step above what is allocated before it (`slapo.profile.meter`)."""
    if device.type != "cuda":
        return None
    before = torch.cuda.memory_allocated(device)
    meter.reset_peak(device)
    step_time(model, opt, ids, device)
    return meter.peak_bytes(device) - before


def run_kind(kind: str, names: list[str], args, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    base = WordLM(kind, args.vocab, args.emb, args.hidden, args.layers).to(device)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
               .to(device) for _ in range(args.steps)]
    models = {n: apply_rnn(copy.deepcopy(base), **VARIANTS[n]).mod for n in names}
    opts = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    rows = {n: {"kind": kind, "variant": n, "knobs": VARIANTS[n], "times": []} for n in names}
    for n, m in models.items():   # verify first (on the untrained weights), then warm up
        rows[n]["verified"] = verified(m, base, batches[0])
        ids = batches[0][:, :-1]
        rows[n]["saved_bytes"] = saved_bytes(lambda x, m=m: m(x), ids, exclude=[m])
        for _ in range(args.warmup):
            step_time(m, opts[n], batches[0], device)
        rows[n]["peak_bytes"] = peak_of_step(m, opts[n], batches[0], device)
    for _ in range(args.rounds):
        for n, m in models.items():
            rows[n]["times"] += [step_time(m, opts[n], b, device) for b in batches]
    tokens = args.batch_size * args.seq_len
    out = list(rows.values())
    for r in out:
        r["tokens_per_s"] = tokens / statistics.median(r["times"])
    base_row = rows[names[0]]
    for r in out:
        r["speedup"] = r["tokens_per_s"] / base_row["tokens_per_s"]
        r["saved_ratio"] = r["saved_bytes"] / max(base_row["saved_bytes"], 1)
    return out


def print_table(rows: list[dict], device_name: str, console: Console) -> None:
    t = Table(title=f"word-level RNN LM training step ({device_name}, torch {torch.__version__}, "
                    f"{torch.get_num_threads()} threads)")
    for c in ("model", "variant", "tokens/s", "speedup", "saved MiB", "saved vs base",
              "peak MiB", "verified"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["kind"], r["variant"], f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}x",
                  f"{r['saved_bytes'] / 2**20:.2f}", f"{r['saved_ratio']:.2f}x",
                  f"{r['peak_bytes'] / 2**20:.1f}" if r["peak_bytes"] is not None else "-", "yes" if r["verified"] else "NO")
    console.print(t)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kinds", default="lstm,gru")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list of: " + ", ".join(VARIANTS) + " (the first is the base)")
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--emb", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", choices=("cpu", "cuda"),
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.allow_tf32 = False     # fp32 comparison against cuDNN's RNN
    torch.backends.cuda.matmul.allow_tf32 = False
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" \
        else f"cpu {platform.processor() or platform.machine()}"
    names = args.variants.split(",")
    rows = [r for kind in args.kinds.split(",") for r in run_kind(kind, names, args, device)]
    print_table(rows, device_name, Console(width=120))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "device": device_name,
                       "peak_kind": meter.peak_kind(device), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
