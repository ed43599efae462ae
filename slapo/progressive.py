"""Progressive optimization: apply schedule steps one at a time and measure each.

This is Slapo's workflow in one function: start from the unmodified model, add one concern per
step (SDPA attention, fusion, Tempo layers, checkpointing, tensor parallelism), and for every
step report what it did to speed (tokens/s, and the ratio to the baseline *in this run*), to
memory (bytes saved for backward by one forward) and to correctness (`Verify` against the
baseline: outputs, every gradient, one optimizer step).

Used by `slapo train --progressive`; callable directly for any supported HF model.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from . import model_schedule
from .distributed import group as _g
from .errors import SlapoError
from .profile import saved_bytes
from .schedule import create_schedule
from .verify import Verify


@dataclass
class Step:
    """One row of the progression: a name and the cumulative `model_schedule.apply` knobs."""

    name: str
    knobs: dict
    note: str = ""


@dataclass
class StepResult:
    name: str
    knobs: dict
    tokens_per_s: float = 0.0
    speedup: float = 0.0
    saved_bytes: int = 0
    memory_ratio: float = 0.0
    verified: bool = False
    losses: list[float] = field(default_factory=list)
    note: str = ""


def default_steps(world_size: int, fuse_available: bool, tempo: bool = True,
                  fuse_compiler: str = "inductor") -> list[Step]:
    knobs: dict = {}
    steps = [Step("baseline (HF eager)", {})]

    def add(name: str, note: str = "", **k) -> None:
        knobs.update(k)
        steps.append(Step(name, dict(knobs), note))

    add("+ SDPA attention", attention="sdpa")
    if fuse_available:
        add("+ fused bias+GELU", fuse=True, fuse_compiler=fuse_compiler)
    if tempo:
        add("+ Tempo layers", tempo=True)
    add("+ checkpointing", ckpt_ratio=1.0)
    if world_size > 1:
        add(f"+ tensor parallel x{world_size}", tp=world_size)
    return steps


def _loss(out) -> torch.Tensor:
    return out.loss


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(model: nn.Module, batches: list[dict], warmup: int, lr: float,
           autocast_dtype: torch.dtype | None = None) -> tuple[float, list]:
    """Seconds per step (median after warm-up) and the losses of a few AdamW steps; with
    `autocast_dtype` (e.g. bf16 on GPU) the step runs under torch.autocast (fp32 master
    weights)."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    times, losses = [], []
    model.train()
    for i, batch in enumerate(batches):
        _g_barrier()
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None):
            loss = _loss(model(**batch))
        loss.backward()
        opt.step()
        _sync(device)
        _g_barrier()
        losses.append(loss.item())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if times else float("nan"), losses


def _g_barrier() -> None:
    if _g.is_initialized():
        import torch.distributed as dist

        dist.barrier()


def run(make_model: Callable[[], nn.Module], batches: Iterator[dict] | list[dict], *,
        steps: list[Step] | None = None, train_steps: int = 6, warmup: int = 2,
        lr: float = 1e-3, device: torch.device | str | None = None,
        autocast_dtype: torch.dtype | None = None,
        log: Callable[[str], None] = print) -> list[StepResult]:
    """Run every step on a fresh copy of the same model and return one result per step.

    `make_model()` must build the same weights on every call and every rank (seed it).
    `batches` yields dicts of keyword inputs with labels (HF models return `.loss`).
    `device`: where to run (default: the model's). Verification always runs in fp32; timing
    runs under `autocast_dtype` when given (bf16 on GPU).
    """
    batches = list(batches)
    if device is not None:
        batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in b.items()} for b in batches]
    if len(batches) < train_steps:
        raise SlapoError(f"need {train_steps} batches, got {len(batches)}")
    world = _g.world_size()
    from .primitives import get_primitive

    steps = steps or default_steps(world, get_primitive("fuse") is not None)
    example = batches[0]
    tokens = sum(v.numel() for k, v in example.items() if k == "input_ids")
    results: list[StepResult] = []
    base_model = make_model()
    if device is not None:
        base_model.to(device)
    if hasattr(base_model, "set_attn_implementation"):  # the baseline is HF *eager* attention
        base_model.set_attn_implementation("eager")
    if getattr(getattr(base_model, "config", None), "use_cache", False):
        base_model.config.use_cache = False  # training: no KV cache to fill
    unavailable: set[str] = set()  # knobs this model cannot take: dropped from later steps
    previous: dict = {}
    for step in steps:
        new_knobs = {k for k in step.knobs if k not in previous}
        previous = step.knobs
        knobs = {k: v for k, v in step.knobs.items() if k not in unavailable}
        model = copy.deepcopy(base_model)
        res = StepResult(step.name, knobs, note=step.note)
        try:
            sch = create_schedule(model)
            with Verify(sch, example_kwargs=example, loss_fn=_loss):
                if knobs:
                    model_schedule.apply(sch, **knobs)
            res.verified = True
        except SlapoError as e:  # a failed verification or an unavailable knob
            res.note = f"{type(e).__name__}: {e}"[:200]
            if "VerificationError" not in res.note:
                unavailable |= new_knobs
                log(f"[{step.name}] skipped: {res.note}")
                results.append(res)
                continue
        res.saved_bytes = saved_bytes(model, **example)
        sec, res.losses = _train(model, batches[:train_steps], warmup, lr, autocast_dtype)
        res.tokens_per_s = tokens / sec
        results.append(res)
        log(f"[{step.name}] {res.tokens_per_s:,.0f} tokens/s, saved activations "
            f"{res.saved_bytes / 2**20:.2f} MiB, verified={res.verified}")
    base = results[0]
    for r in results:
        if r.tokens_per_s and base.tokens_per_s:
            r.speedup = r.tokens_per_s / base.tokens_per_s
        if r.saved_bytes and base.saved_bytes:
            r.memory_ratio = r.saved_bytes / base.saved_bytes
    return results


def table(results: list[StepResult], title: str = "Progressive optimization"):
    """A rich Table of the results."""
    from rich.table import Table

    t = Table(title=title)
    for col, just in (("step", "left"), ("tokens/s", "right"), ("vs baseline", "right"),
                      ("saved activations", "right"), ("vs baseline", "right"),
                      ("verified", "center")):
        t.add_column(col, justify=just)
    for r in results:
        ok = "[green]yes[/green]" if r.verified else ("[red]NO[/red]" if r.tokens_per_s
                                                      else "skipped")
        t.add_row(r.name, f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-",
                  f"{r.speedup:.2f}x" if r.speedup else "-",
                  f"{r.saved_bytes / 2**20:.2f} MiB" if r.saved_bytes else "-",
                  f"{r.memory_ratio:.2f}x" if r.memory_ratio else "-", ok)
    return t


def to_json(results: list[StepResult]) -> list[dict]:
    return [asdict(r) for r in results]
