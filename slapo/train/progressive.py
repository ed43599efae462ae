"""`slapo train --progressive`: the README demo.

Builds the chosen model (same seed on every rank), draws real batches from the shipped corpus,
and runs `slapo.progressive.run`: baseline HF eager, + SDPA attention, + fused MLP activation,
+ Tempo layers, + checkpointing, and + tensor parallelism when launched with several processes.
Every step is verified against the baseline (outputs, all gradients, one optimizer step) and
measured (tokens/s relative to the baseline in this run, bytes saved for backward).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import progressive
from ..data import CorpusLoader
from .models import build_model, get_model_spec


def run_progressive(cfg: Any, log=print) -> list[dict]:
    from .loop import setup, teardown

    env = setup(cfg)
    try:
        spec = get_model_spec(cfg.model)
        data = CorpusLoader(spec.task, cfg.seq_len, seed=cfg.seed)
        steps = max(cfg.steps, 3)
        batches = [data.next_batch(cfg.batch_size) for _ in range(steps)]

        def make():
            torch.manual_seed(cfg.seed)
            return build_model(cfg.model, cfg.size())[0]

        say = log if env.is_main else (lambda *_: None)
        say(f"Progressive optimization of {cfg.model} ({cfg.hidden_size} hidden, "
            f"{cfg.num_layers} layers) on the shipped corpus: batch {cfg.batch_size} x "
            f"{cfg.seq_len} tokens, {steps} AdamW steps per variant, {env.world} process(es)")
        from ..primitives import get_primitive

        plan = progressive.default_steps(env.world, get_primitive("fuse") is not None,
                                         fuse_compiler=cfg.fuse_compiler or "inductor")
        results = progressive.run(make, batches, steps=plan, train_steps=steps,
                                  warmup=min(2, steps - 1), lr=cfg.lr, device=env.device,
                                  log=say)
        rows = progressive.to_json(results)
        if env.is_main:
            from rich.console import Console

            Console(width=110).print(progressive.table(results, title=(
                f"Progressive optimization: {cfg.model}, {env.world} process(es), CPU/GPU "
                f"ratios within this run")))
            ok = all(r["verified"] for r in rows if r["tokens_per_s"])
            say("every step verified against the baseline (outputs, gradients, one optimizer "
                "step)" if ok else "SOME STEPS FAILED VERIFICATION")
            if cfg.out:
                out = Path(cfg.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / "progressive.json").write_text(json.dumps(rows, indent=2))
                say(f"wrote {out / 'progressive.json'}")
        return rows
    finally:
        teardown(env)
