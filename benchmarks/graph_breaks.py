"""Graph breaks of the compiled schedules: every family x knob set, one training step each.

Why: `compile_blocks` compiles each transformer layer as one graph. Each graph break inside a
layer is eager Python on every step, and a checkpointed region dynamo cannot compile runs the
whole layer eagerly (0 graphs), silently slower. Which torch features break a graph changes
between torch releases, so the count is measured on the torch that trains (the GPU image has
torch 2.11; the tests run torch 2.13 on CPU, tp=2 included).

For each of `slapo train`'s small models (`slapo.train.models`: GPT-2, LLaMA, OPT, GPT-Neo,
BERT, RoBERTa, ALBERT, T5) and each knob set, it applies `model_schedule.apply(compile_blocks=
backend, **knobs)`, runs one forward and backward on random tokens (bf16 autocast on CUDA),
and reports dynamo's graphs and graph breaks (each break's reason, shortened). A knob set a
family refuses is reported as refused. Prints a table and writes JSON (`--out`).

    PYTHONPATH=. python benchmarks/graph_breaks.py --out runs/graph_breaks.json
    PYTHONPATH=. python benchmarks/graph_breaks.py --models gpt2,t5 --backend eager   # CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import warnings
from pathlib import Path

import torch

KNOB_SETS: dict[str, dict] = {
    "plain": {},
    "ckpt": {"ckpt_ratio": 1.0},
    "sac": {"ckpt_ratio": 1.0, "ckpt_policy": "selective"},
    "kernels": {"kernels": True},
    "fused_loss": {"fused_loss": True},
    "tempo": {"tempo": True},
    "gpu": {"attention": "sdpa", "ckpt_ratio": 1.0, "ckpt_policy": "selective",
            "fused_loss": True, "kernels": True},
}


def batch_for(task: str, vocab: int, batch: int, seq: int, device) -> dict:
    """Random tokens with the labels each task's loss reads."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, seq), generator=gen)
    if task == "seq2seq":
        return {"input_ids": ids.to(device), "labels": ids[:, : seq // 2].contiguous().to(device)}
    labels = ids.clone()
    if task == "masked":
        labels[torch.rand(batch, seq, generator=gen) > 0.15] = -100
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


def count(name: str, knobs: dict, backend: str, device: str, seq: int) -> dict:
    """One family x knob set: graphs and breaks of one training step."""
    from torch._dynamo.utils import counters

    from slapo import model_schedule
    from slapo.errors import SchedulingError
    from slapo.train.models import ModelSize, build_model

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model, spec = build_model(name, ModelSize())
    model.to(device).train()
    batch = batch_for(spec.task, model.config.vocab_size, 2, seq, device)
    autocast = torch.autocast("cuda", torch.bfloat16) if device == "cuda" else \
        torch.autocast("cpu", enabled=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. tempo inside compiled blocks: known, documented
        try:
            model_schedule.apply(model, compile_blocks=backend, **knobs)
        except SchedulingError as e:
            return {"status": "refused", "reason": str(e).split(". Fix")[0][:120]}
        with autocast:
            loss = model(**batch).loss
        loss.backward()
    reasons = [r.split("\n")[0][:100] for r in counters["graph_break"]]
    return {"status": "ok", "graphs": counters["stats"]["unique_graphs"],
            "breaks": sum(counters["graph_break"].values()), "reasons": reasons}


def run(models: list[str], knob_sets: list[str], backend: str, seq: int) -> list[dict]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in models:
        for knob_set in knob_sets:
            row = {"model": name, "knobs": knob_set, **count(name, KNOB_SETS[knob_set], backend,
                                                              device, seq)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    torch._dynamo.reset()
    return rows


def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="dynamo graphs / breaks per training step (compile_blocks)")
    for col in ("model", "knobs", "graphs", "breaks", "first reason"):
        table.add_column(col)
    for r in rows:
        if r["status"] != "ok":
            table.add_row(r["model"], r["knobs"], "", "", f"refused: {r['reason']}")
            continue
        table.add_row(r["model"], r["knobs"], str(r["graphs"]), str(r["breaks"]),
                      (r["reasons"] or [""])[0])
    Console(width=160).print(table)


def parse_args(argv=None) -> argparse.Namespace:
    from slapo.train.models import MODELS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated: %(default)s")
    p.add_argument("--knobs", default=",".join(KNOB_SETS), help="comma-separated knob sets: "
                   "%(default)s")
    p.add_argument("--backend", default=None, help="torch.compile backend (default: inductor "
                   "on CUDA, aot_eager on CPU)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sample (default: 64)")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.knobs = [k for k in args.knobs.split(",") if k]
    unknown = [m for m in args.models if m not in MODELS] + \
        [k for k in args.knobs if k not in KNOB_SETS]
    if unknown:
        p.error(f"unknown model or knob set: {', '.join(unknown)} (models: {', '.join(MODELS)}; "
                f"knob sets: {', '.join(KNOB_SETS)})")
    if args.backend is None:
        args.backend = "inductor" if torch.cuda.is_available() else "aot_eager"
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = run(args.models, args.knobs, args.backend, args.seq)
    print_table(rows)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        env = {"torch": torch.__version__, "python": platform.python_version(),
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "backend": args.backend}
        args.out.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
