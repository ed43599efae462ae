"""`slapo train --progressive`: the README demo (the CLI front of the library `slapo.progressive`).

Builds the chosen model (same seed on every rank), draws real batches from the shipped corpus,
and runs `slapo.progressive.run`, every step verified against the baseline (outputs, all
gradients, one optimizer step) and measured in this run:

* on CPU (fp32): baseline HF eager, + SDPA attention, + fused MLP activation, + Tempo layers,
  + checkpointing, and + tensor parallelism when launched with `--tp N` (N > 1);
* on CUDA (bf16 autocast, fp32 master weights): baseline HF SDPA, + compiled blocks, + GPU
  kernels, + fused linear+CE loss, + selective checkpointing (+ TP): `progressive.gpu_steps`.

Each step is measured twice: at the demo batch (tokens/s, saved-for-backward bytes), and at the
largest batch (powers of two, up to 16x) whose *measured* saved bytes fit the baseline's at the
demo batch, with tokens/s there. That shows the trade a memory step makes: slower at equal batch,
but a larger batch fits the same activation memory.

Parallel dimensions come from `train.setup.setup`'s mesh (`--tp`; the rest of the processes are
data-parallel replicas): the TP step shards over the mesh's "tp" dimension only, `--tp` ways,
and each dp replica runs the same progression on the whole demo batch (rows are per model
replica; see `slapo.progressive`). `--pp-stages` > 1 is refused: the demo runs whole models.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import progressive
from ..data import CorpusLoader
from .models import build_model, get_model_spec

BUDGET_MAX_FACTOR = 16  # largest batch tried: 16x the demo batch (keeps the CPU demo < 90 s)
BUDGET_TIMED_STEPS = 2  # timed AdamW steps at the budget batch (after one warm-up on GPU)
CPU_NOTE = ("CPU VM, shared cores: absolute tokens/s swing between runs, so compare ratios within "
            "one run (each the fastest of its timed steps).\nSaved-activation bytes are exact. "
            "Budget = the baseline's saved activations at the demo batch; every batch @ budget "
            "was measured to fit.")


def _plan(tp: int, device: torch.device, fuse_compiler: str) -> dict[str, Any]:
    """Steps and measurement settings for the device (`tp`: the mesh's tp degree): the GPU
    schedule in bf16 (build's `precision`) on CUDA."""
    if device.type == "cuda":
        return dict(steps=progressive.gpu_steps(tp), precision="bf16",
                    baseline_attention="sdpa")
    return dict(steps=progressive.default_steps(tp, fuse_compiler=fuse_compiler))


def tp_degree(mesh: Any) -> int:
    """The size of the mesh's "tp" dimension (1 without a mesh: one process)."""
    return 1 if mesh is None else mesh.size(mesh.mesh_dim_names.index("tp"))


def _check(cfg: Any) -> None:
    if (cfg.pp_stages or 1) > 1:
        raise ValueError(f"--progressive compares whole-model schedules; drop --pp-stages "
                         f"{cfg.pp_stages} (use --tp for a tensor-parallel step)")


def run_progressive(cfg: Any, log: Callable[..., None] = print) -> list[dict]:
    """Run the demo as configured; print the table on rank 0; return the rows (every rank)."""
    from .setup import setup, teardown

    _check(cfg)
    env = setup(cfg)
    try:
        spec = get_model_spec(cfg.model)
        data = CorpusLoader(spec.task, cfg.seq_len, seed=cfg.seed)
        steps = max(cfg.steps, 3)
        batches = [data.next_batch(cfg.batch_size) for _ in range(steps)]
        fresh = CorpusLoader(spec.task, cfg.seq_len, seed=cfg.seed + 1)  # budget batches

        def make():
            torch.manual_seed(cfg.seed)
            return build_model(cfg.model, cfg.size())[0]

        say = log if env.is_main else (lambda *_: None)
        tp = tp_degree(env.mesh)
        plan = _plan(tp, env.device, cfg.fuse_compiler or "inductor")
        precision = "bf16 autocast" if plan.get("precision") else "fp32"
        say(f"Progressive optimization of {cfg.model} ({cfg.hidden_size} hidden, "
            f"{cfg.num_layers} layers) on the shipped corpus: batch {cfg.batch_size} x "
            f"{cfg.seq_len} tokens, {steps} AdamW steps per variant, {env.world} process(es) "
            f"(tp={tp}, {env.world // tp} replica(s)), {env.device.type} {precision}")
        results = progressive.run(make, batches, train_steps=steps, warmup=min(2, steps - 1),
                                  lr=cfg.peak_lr(), device=env.device, log=say,
                                  budget_max_factor=BUDGET_MAX_FACTOR,
                                  budget_steps=BUDGET_TIMED_STEPS,
                                  make_batch=fresh.next_batch, mesh=env.mesh, **plan)
        rows = progressive.to_json(results)
        if env.is_main:
            _report(results, rows, cfg, env, say)
        return rows
    finally:
        teardown(env)


def _report(results, rows: list[dict], cfg: Any, env: Any, say) -> None:
    """Print the table and the verdict; write progressive.json under `cfg.out`."""
    from rich.console import Console

    Console(width=150).print(progressive.table(results, title=(
        f"Progressive optimization: {cfg.model}, {env.world} process(es), {env.device.type}, "
        f"ratios within this run")))
    for line in progressive.summary(results):
        say(line)
    if env.device.type == "cpu":
        say(CPU_NOTE)
    ok = all(r["verified"] for r in rows if r["tokens_per_s"])
    say("every step verified against the baseline (outputs, gradients, one optimizer step)"
        if ok else "SOME STEPS FAILED VERIFICATION")
    if cfg.out:
        out = Path(cfg.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "progressive.json").write_text(json.dumps(rows, indent=2))
        say(f"wrote {out / 'progressive.json'}")
