"""`run`: every step on a fresh copy of the baseline, scheduled under `Verify` on the mesh's tp
group, then measured (`measure.py`); the ratios to the baseline of this run."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

from .. import model_schedule
from ..distributed import group as _g
from ..errors import SchedulingError, SlapoError, VerificationError
from ..runtime.precision import precision_arg
from ..schedule import Schedule, create_schedule
from ..verify import Verify
from .budget import BatchSource, Budget, tiled_batches
from .measure import hf_loss, measure_step, trainer
from .steps import Step, StepResult, default_steps


def _accepted_knobs() -> set[str] | None:
    """Keyword names the installed `model_schedule.apply` takes (None: it takes any)."""
    params = inspect.signature(model_schedule.apply).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params}


def _baseline(make_model: Callable[[], nn.Module], device, attention: str) -> nn.Module:
    model = make_model()
    if device is not None:
        model.to(device)
    if hasattr(model, "set_attn_implementation"):  # the baseline's attention, stated
        model.set_attn_implementation(attention)
    if getattr(getattr(model, "config", None), "use_cache", False):
        model.config.use_cache = False  # training: no KV cache to fill
    return model


def _schedule(model: nn.Module, knobs: dict, example: dict, res: StepResult,
              group) -> tuple[Schedule | None, str | None]:
    """Apply the knobs under `Verify` on the TP `group`; returns (the schedule, an error note or
    None when verified). The schedule is None when the knobs could not be applied."""
    sch = create_schedule(model, group=group)
    try:
        with Verify(sch, example_kwargs=example, loss_fn=hf_loss):
            if knobs:  # tp=1 unless the step says otherwise: apply's default is the group size
                model_schedule.apply(sch, **{"tp": 1, **knobs})
        res.verified = True
        return sch, None
    except VerificationError as e:  # applied, but not equivalent: measured, reported as NO
        return sch, f"{type(e).__name__}: {e}"[:200]
    except SlapoError as e:  # an unavailable knob
        return None, f"{type(e).__name__}: {e}"[:200]


def _ratios(results: list[StepResult]) -> None:
    base = results[0]
    for r in results:
        if r.tokens_per_s and base.tokens_per_s:
            r.speedup = r.tokens_per_s / base.tokens_per_s
        if r.saved_bytes and base.saved_bytes:
            r.memory_ratio = r.saved_bytes / base.saved_bytes
        if r.budget_tokens_per_s and base.budget_tokens_per_s:
            r.budget_speedup = r.budget_tokens_per_s / base.budget_tokens_per_s


def _describe(res: StepResult) -> str:
    s = (f"[{res.name}] {res.tokens_per_s:,.0f} tokens/s, saved activations "
         f"{res.saved_bytes / 2**20:.2f} MiB, verified={res.verified}")
    if res.budget_batch:
        s += (f"; at the budget: batch {res.budget_batch} ({res.budget_saved_bytes / 2**20:.2f}"
              f" MiB measured), {res.budget_tokens_per_s:,.0f} tokens/s")
    return s


_PRECISION = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _tp_group(mesh):
    """The group TP steps shard over: the mesh's "tp" dimension (the default group without a
    mesh). Refuses a pipeline mesh before anything is built: the demo runs whole models."""
    if mesh is None:
        return _g.default_group()
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        raise SchedulingError("", f"progressive.run needs a mesh with a 'tp' dimension, got "
                              f"{names}.", "create it with slapo.init_mesh(dp=..., tp=...).")
    if "pp" in names and mesh.size(names.index("pp")) > 1:
        raise SchedulingError("", "progressive.run compares whole-model schedules; the mesh "
                              f"has pp={mesh.size(names.index('pp'))}.",
                              "use a mesh with pp=1 (drop --pp-stages).")
    return mesh.get_group("tp")


def _precision(precision: str, mixed_precision: str | None,
               autocast_dtype: torch.dtype | None) -> str:
    """build's `precision`; `mixed_precision` and `autocast_dtype` are earlier spellings of the
    same choice (`build` checks the name)."""
    if autocast_dtype is None:
        return precision_arg(precision, mixed_precision)
    if mixed_precision is not None or precision != "fp32" or autocast_dtype not in _PRECISION:
        raise SlapoError(f"pass one of precision ('bf16'/'fp16') or autocast_dtype "
                         f"(torch.bfloat16/float16), got {mixed_precision or precision!r} and "
                         f"{autocast_dtype!r}")
    return _PRECISION[autocast_dtype]


def _knobs_for(step: Step, previous: dict, accepted: set[str] | None,
               unavailable: set[str]) -> tuple[dict, set[str], set[str]]:
    """(the knobs to apply, the knobs new in this step, those the installed apply lacks)."""
    new = {k for k in step.knobs if k not in previous}
    missing = {k for k in new if accepted is not None and k not in accepted}
    knobs = {k: v for k, v in step.knobs.items() if k not in unavailable | missing}
    return knobs, new, missing


def run(make_model: Callable[[], nn.Module], batches: Iterator[dict] | list[dict], *,
        steps: list[Step] | None = None, train_steps: int = 6, warmup: int = 2,
        lr: float = 1e-3, device: torch.device | str | None = None,
        precision: str = "fp32", mixed_precision: str | None = None,
        autocast_dtype: torch.dtype | None = None,
        baseline_attention: str = "eager", budget_max_factor: int = 0, budget_steps: int = 2,
        make_batch: Callable[[int], dict] | None = None, mesh=None,
        log: Callable[[str], None] = print) -> list[StepResult]:
    """Run every step on a fresh copy of the same model and return one result per step.

    `make_model()` must build the same weights on every call and every rank (seed it).
    `batches` yields dicts of keyword inputs with labels (HF models return `.loss`).
    `device`: where to run (default: the model's). Verification always runs in fp32; training
    and byte counts run in `precision` ("bf16"/"fp16": `slapo.build`'s autocast with fp32
    master weights; `mixed_precision="bf16"` and `autocast_dtype=torch.bfloat16` are the older
    spellings).
    `baseline_attention`: the HF attention of the baseline ("eager"; "sdpa" on GPU).
    `mesh`: the job's ("dp", "pp", "tp") DeviceMesh (module docstring): schedules live on its
    "tp" group, the default steps add a TP step of that degree, dp replicas each run the whole
    batch. A step runs unsharded (`tp=1`) unless its knobs set `tp`: `apply`'s own default (the
    group size) would shard every step and credit TP's savings to the others.
    Budget search (module docstring): `budget_max_factor` caps the batch at that many times the
    demo batch (0, the default: no search, so benchmarks calling `run` keep their run time; the
    demo passes 16); `budget_steps` timed steps at the found batch (+ one warm-up on GPU);
    `make_batch(n)` draws n fresh samples (same on every rank; default: cycles `batches`).
    """
    if budget_max_factor < 0 or budget_steps < 1:
        raise SlapoError(f"budget_max_factor must be >= 0 (got {budget_max_factor}) and "
                         f"budget_steps >= 1 (got {budget_steps})")
    precision = _precision(precision, mixed_precision, autocast_dtype)
    group = _tp_group(mesh)
    batches = list(batches)
    if device is not None:
        batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in b.items()} for b in batches]
    if len(batches) < train_steps:
        raise SlapoError(f"need {train_steps} batches, got {len(batches)}")
    steps = steps or default_steps(_g.world_size(group))
    example = batches[0]
    batch_size = example["input_ids"].shape[0]
    tokens = example["input_ids"].numel()
    base_model = _baseline(make_model, device, baseline_attention)
    budget = None
    if budget_max_factor:
        source = BatchSource(make_batch or tiled_batches(batches), device)
        # a new batch recompiles compiled regions on GPU: one untimed step there; on CPU the
        # first step only grows the allocator, which the fastest-of-steps timing already skips
        warm = 1 if example["input_ids"].device.type == "cuda" else 0
        budget = Budget(0, budget_max_factor, budget_steps, warm, source, tokens / batch_size)
    accepted = _accepted_knobs()
    results: list[StepResult] = []
    unavailable: set[str] = set()  # knobs this model cannot take: dropped from later steps
    previous: dict = {}
    for step in steps:
        knobs, new_knobs, missing = _knobs_for(step, previous, accepted, unavailable)
        previous = step.knobs
        res = StepResult(step.name, knobs, note=step.note, batch=batch_size)
        results.append(res)
        if missing:
            unavailable |= missing
            res.note = f"model_schedule.apply here does not take {', '.join(sorted(missing))}"
            log(f"[{step.name}] skipped: {res.note}")
            continue
        sch, err = _schedule(copy.deepcopy(base_model), knobs, example, res, group)
        res.note = err or res.note
        if sch is None:
            unavailable |= new_knobs
            log(f"[{step.name}] skipped: {err}")
            continue
        measure_step(trainer(sch, lr, precision), res, batches[:train_steps], warmup,
                      tokens, budget)
        log(_describe(res))
    _ratios(results)
    return results
