"""Progressive optimization: apply schedule steps one at a time and measure each.

This is Slapo's workflow in one function: start from the unmodified model, add one concern per
step (SDPA attention, fusion, Tempo layers, checkpointing, tensor parallelism; on GPU: compiled
blocks, kernels, a fused loss, selective checkpointing), and for every step report what it did
to speed (tokens/s, and the ratio to the baseline *in this run*), to memory (bytes saved for
backward by one forward) and to correctness (`Verify` against the baseline: outputs, every
gradient, one optimizer step).

**The trade, not only the cost.** A memory step (Tempo, checkpointing) is often slower at equal
batch: it recomputes what it did not save. What it buys is batch. So each step is also run at
the **largest batch that fits a fixed activation budget** — the baseline's saved-for-backward
bytes at the demo batch — and timed there:

* candidates are the demo batch times powers of two up to `budget_max_factor` (and halvings of
  it, for a step that needs more than the baseline); the search is capped so the demo stays short;
* the per-sample bytes measured at the demo batch predict the largest candidate; the bytes are
  then *measured* there (`slapo.profile.saved_bytes`, the same counter as the column before
  it), stepping down while a measurement exceeds the budget and up while one fits. A reported
  batch is a measured fit, and the next candidate was measured not to fit (or is past the cap);
* tokens/s at that batch is the fastest of a few AdamW steps (after one warm-up step on GPU,
  where a new batch shape recompiles compiled regions).

**One step loop.** Every variant trains through `slapo.build(sch, ...)`'s
`TrainModule.train_step` (AdamW; `mixed_precision="bf16"` on GPU is build's autocast, fp32
master weights), timed by `slapo.runtime.train_step.time_steps`: the step `slapo train` runs.
Peak memory per row is `slapo.profile.meter`'s (`peak_bytes`, JSON only).

**Parallel dimensions.** `run(..., mesh=)` takes the job's ("dp", "pp", "tp") mesh
(`slapo.runtime.init_mesh`). Every schedule is made on the mesh's "tp" group, and only the TP
step shards, over that group (`tp=` its size; no TP step when it is 1). Data-parallel replicas
(dp > 1) run the same thing, each on the whole demo batch: a row describes one model replica
(the job trains dp times its tokens/s), and DDP's gradient all-reduce, the same for every step,
is left out of the comparison. Pipelines (pp > 1) are refused. Without a mesh the schedules use
the default process group (one process: no TP step). Each row records the degree its weights
were actually sharded (`shard_ways`, from the shard specs) and the parameters one rank holds.

Under torch.distributed every rank takes the same decisions (the measured bytes are all-reduced
with MAX), since a TP forward is a collective.

Used by `slapo train --progressive`; callable directly for any supported HF model.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from . import model_schedule
from .distributed import group as _g
from .errors import SchedulingError, SlapoError, VerificationError
from .profile import meter, saved_bytes
from .runtime.build import build
from .runtime.train_step import TrainModule, time_steps
from .schedule import Schedule, create_schedule
from .sharding import shard_spec
from .verify import Verify

OVER = 2**62  # the "bytes" of a forward that ran out of device memory: fits no budget


@dataclass
class Step:
    """One row of the progression: a name and the cumulative `model_schedule.apply` knobs."""

    name: str
    knobs: dict
    note: str = ""


@dataclass
class StepResult:
    """One measured row. `budget_*`: the same step at the largest batch whose measured
    saved-for-backward bytes fit `budget_bytes` (the baseline's at the demo batch)."""

    name: str
    knobs: dict
    tokens_per_s: float = 0.0
    speedup: float = 0.0
    saved_bytes: int = 0
    memory_ratio: float = 0.0
    verified: bool = False
    losses: list[float] = field(default_factory=list)
    note: str = ""
    batch: int = 0
    budget_bytes: int = 0
    budget_batch: int = 0             # 0: not searched (skipped step, or search disabled)
    budget_saved_bytes: int = 0       # measured at budget_batch: <= budget_bytes
    budget_capped: bool = False       # the search stopped at its cap: more may fit
    budget_tokens_per_s: float = 0.0
    budget_speedup: float = 0.0       # vs the baseline's tokens/s at its own budget batch
    shard_ways: int = 1               # largest degree any weight is sharded (shard specs)
    parameters: int = 0               # parameter elements this rank holds
    peak_bytes: int = 0               # slapo.profile.meter peak over the demo-batch steps


def default_steps(tp: int, fuse_available: bool, tempo: bool = True,
                  fuse_compiler: str = "inductor") -> list[Step]:
    """The CPU progression (fp32): what a schedule can change on a CPU. `tp`: the degree of the
    mesh's "tp" dimension (a TP step only when > 1)."""
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
    if tp > 1:
        add(f"+ tensor parallel x{tp}", tp=tp)
    return steps


def gpu_steps(tp: int) -> list[Step]:
    """The GPU progression, run under bf16 autocast against HF's default (SDPA) attention.

    Why this baseline: on a GPU nobody trains with HF eager attention, so beating it would prove
    nothing. Knobs an older `model_schedule.apply` does not take are skipped by `run` with a note.
    """
    knobs: dict = {}
    steps = [Step("baseline (HF SDPA, bf16)", {})]

    def add(name: str, **k) -> None:
        knobs.update(k)
        steps.append(Step(name, dict(knobs)))

    # `kernels=True` is left out: inside compiled blocks its Triton ops are opaque to inductor,
    # and they have not been measured on a GPU yet (benchmarks/gpu_train.py slapo_gpu_kernels).
    add("+ compiled blocks", attention="sdpa", compile_blocks=True)
    add("+ fused linear+CE loss", fused_loss=True)
    add("+ selective checkpointing", ckpt_ratio=1.0, ckpt_policy="selective")
    if tp > 1:  # the fused loss needs an unsharded LM head
        add(f"+ tensor parallel x{tp}", tp=tp, vocab_parallel=False)
    return steps


def _loss(out) -> torch.Tensor:
    return out.loss


def _trainable(sch: Schedule, lr: float, mixed_precision: str | None) -> TrainModule:
    """The step `slapo train` runs: `slapo.build` with AdamW and build's mixed precision."""
    model, _ = build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": lr},
                     mixed_precision=mixed_precision)
    return model


def _train(model: TrainModule, batches: list[dict], warmup: int) -> tuple[float, list]:
    """Seconds per step and the losses of `train_step` on each batch (ranks aligned by a
    barrier around each step, so a TP step's time is its slowest rank's).

    The time is the *fastest* step after warm-up: other jobs on a shared machine only ever add
    time to a step, so the minimum is the least disturbed estimate of what the step costs (a
    median still moves with how long a neighbour's burst lasted)."""
    timed = time_steps(model, batches, barrier=True)
    return timed.fastest(warmup), timed.losses


def _agree_max(value: int, device: torch.device) -> int:
    """The largest `value` over all ranks, so every rank takes the same batch decision."""
    if not _g.is_initialized():
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _measure_bytes(model: TrainModule, batch: dict) -> int:
    """Saved-for-backward bytes of one forward, under the step's own autocast
    (`model.precision`), agreed over ranks. Under autocast the cached low-precision weight
    copies count too: they are held for backward like any activation."""
    device = _device(model)
    try:
        with model.precision.autocast():
            n = saved_bytes(model.model, **batch)
    except torch.cuda.OutOfMemoryError:  # a batch past the budget may not fit the device at all
        torch.cuda.empty_cache()
        n = OVER
    return _agree_max(n, device)


def _held(model: nn.Module) -> tuple[int, int]:
    """(largest shard degree of any weight, parameter elements on this rank): what a row
    reports so that a reader (and a test) sees how the step's weights were split."""
    ways, numel = 1, 0
    for p in model.parameters():
        spec = shard_spec(p)
        ways = max(ways, spec.world_size if spec is not None else 1)
        numel += p.numel()
    return ways, numel


# ---- the activation-budget search -------------------------------------------------------------
def batch_candidates(batch: int, max_factor: int) -> list[int]:
    """`batch` times 1, 2, 4, ... up to `max_factor`, and its halvings down to 1, ascending."""
    if batch < 1 or max_factor < 1:
        raise SlapoError(f"batch ({batch}) and max_factor ({max_factor}) must be >= 1")
    out = {batch}
    f = 2
    while f <= max_factor:
        out.add(batch * f)
        f *= 2
    b = batch // 2
    while b >= 1:
        out.add(b)
        b //= 2
    return sorted(out)


def largest_fitting(candidates: list[int], measure: Callable[[int], int], budget: int,
                    known: tuple[int, int]) -> tuple[int, int] | None:
    """(batch, measured bytes) of the largest candidate whose *measured* bytes fit `budget`.

    `known` is (batch, bytes) already measured (the demo batch): its per-sample bytes pick the
    first candidate to measure. The search then walks down while a measurement exceeds the
    budget and up while one fits, so the answer is a measured fit whose next candidate was
    measured *not* to fit (or is past the cap). A prediction alone is not trusted either way:
    fixed costs (autocast weight copies, position tensors) make bytes affine, not linear, in the
    batch. Usually two measurements. Returns None when not even the smallest candidate fits.
    """
    cache = {known[0]: known[1]}

    def m(b: int) -> int:
        if b not in cache:
            cache[b] = measure(b)
        return cache[b]

    per_sample = known[1] / known[0]
    fits = [i for i, b in enumerate(candidates) if per_sample * b <= budget]
    i, ceiling = (fits[-1] if fits else 0), len(candidates)
    while True:
        if m(candidates[i]) > budget:
            ceiling = i
            if i == 0:
                return None
            i -= 1
        elif i + 1 < ceiling:
            i += 1
        else:
            return candidates[i], m(candidates[i])


def tiled_batches(batches: list[dict]) -> Callable[[int], dict]:
    """A `make_batch(n)` that cycles through the rows of `batches` (used when the caller gives
    no source of fresh samples): every call returns the next n rows."""
    keys = [k for k, v in batches[0].items() if isinstance(v, torch.Tensor)]
    pool = {k: torch.cat([b[k] for b in batches]) for k in keys}
    total = next(iter(pool.values())).shape[0]
    pos = [0]

    def make(n: int) -> dict:
        idx = (torch.arange(n) + pos[0]) % total
        pos[0] = (pos[0] + n) % total
        return {k: v[idx.to(v.device)] for k, v in pool.items()}

    return make


class _BatchSource:
    """Batches of a given size, drawn once and reused by every step (same data, fair ratios)."""

    def __init__(self, make_batch: Callable[[int], dict], device: torch.device | None):
        self.make, self.device, self.cache = make_batch, device, {}

    def get(self, size: int, n: int) -> list[dict]:
        have = self.cache.setdefault(size, [])
        while len(have) < n:
            b = self.make(size)
            if self.device is not None:
                b = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                     for k, v in b.items()}
            have.append(b)
        return have[:n]


@dataclass
class _Budget:
    """What the budget search needs from `run`."""

    bytes: int
    max_factor: int
    timed_steps: int
    warmup: int
    source: _BatchSource
    tokens_per_sample: float


def _at_budget(model: TrainModule, res: StepResult, bud: _Budget) -> None:
    """Fill `res.budget_*`: the largest measured fit, and tokens/s there (reused at the demo
    batch, where the step was already timed). The same TrainModule (its optimizer state too)
    trains on: timing does not depend on the weights' values."""
    res.budget_bytes = bud.bytes
    cands = batch_candidates(res.batch, bud.max_factor)
    found = largest_fitting(
        cands, lambda b: _measure_bytes(model, bud.source.get(b, 1)[0]),
        bud.bytes, (res.batch, res.saved_bytes))
    if found is None:
        res.note = (res.note + "; " if res.note else "") + "batch 1 exceeds the budget"
        return
    res.budget_batch, res.budget_saved_bytes = found
    res.budget_capped = res.budget_batch == cands[-1]
    if res.budget_batch == res.batch:
        res.budget_tokens_per_s = res.tokens_per_s
        return
    batches = bud.source.get(res.budget_batch, bud.warmup + bud.timed_steps)
    sec, _ = _train(model, batches, bud.warmup)
    res.budget_tokens_per_s = bud.tokens_per_sample * res.budget_batch / sec


# ---- the progression --------------------------------------------------------------------------
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
        with Verify(sch, example_kwargs=example, loss_fn=_loss):
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


def _precision(mixed_precision: str | None, autocast_dtype: torch.dtype | None) -> str | None:
    """build's `mixed_precision`; `autocast_dtype` is the older spelling of the same choice."""
    if autocast_dtype is None:
        return mixed_precision
    if mixed_precision is not None or autocast_dtype not in _PRECISION:
        raise SlapoError(f"pass one of mixed_precision ('bf16'/'fp16') or autocast_dtype "
                         f"(torch.bfloat16/float16), got {mixed_precision!r} and "
                         f"{autocast_dtype!r}")
    return _PRECISION[autocast_dtype]


def _knobs_for(step: Step, previous: dict, accepted: set[str] | None,
               unavailable: set[str]) -> tuple[dict, set[str], set[str]]:
    """(the knobs to apply, the knobs new in this step, those the installed apply lacks)."""
    new = {k for k in step.knobs if k not in previous}
    missing = {k for k in new if accepted is not None and k not in accepted}
    knobs = {k: v for k, v in step.knobs.items() if k not in unavailable | missing}
    return knobs, new, missing


def _measure_step(trained: TrainModule, res: StepResult, batches: list[dict], warmup: int,
                  tokens: int, budget: _Budget | None) -> None:
    """Bytes at the demo batch, the timed steps (with the meter's peak), the budget search."""
    res.shard_ways, res.parameters = _held(trained)
    res.saved_bytes = _measure_bytes(trained, batches[0])
    device = _device(trained)
    meter.reset_peak(device)
    sec, res.losses = _train(trained, batches, warmup)
    res.peak_bytes = meter.peak_bytes(device)
    res.tokens_per_s = tokens / sec
    if budget is not None:
        budget.bytes = budget.bytes or res.saved_bytes  # the baseline's, at the demo batch
        _at_budget(trained, res, budget)


def run(make_model: Callable[[], nn.Module], batches: Iterator[dict] | list[dict], *,
        steps: list[Step] | None = None, train_steps: int = 6, warmup: int = 2,
        lr: float = 1e-3, device: torch.device | str | None = None,
        mixed_precision: str | None = None, autocast_dtype: torch.dtype | None = None,
        baseline_attention: str = "eager", budget_max_factor: int = 0, budget_steps: int = 2,
        make_batch: Callable[[int], dict] | None = None, mesh=None,
        log: Callable[[str], None] = print) -> list[StepResult]:
    """Run every step on a fresh copy of the same model and return one result per step.

    `make_model()` must build the same weights on every call and every rank (seed it).
    `batches` yields dicts of keyword inputs with labels (HF models return `.loss`).
    `device`: where to run (default: the model's). Verification always runs in fp32; training
    and byte counts run in `mixed_precision` ("bf16"/"fp16": `slapo.build`'s autocast with fp32
    master weights; `autocast_dtype=torch.bfloat16` is the older spelling).
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
    precision = _precision(mixed_precision, autocast_dtype)
    group = _tp_group(mesh)
    batches = list(batches)
    if device is not None:
        batches = [{k: v.to(device) if isinstance(v, torch.Tensor) else v
                    for k, v in b.items()} for b in batches]
    if len(batches) < train_steps:
        raise SlapoError(f"need {train_steps} batches, got {len(batches)}")
    from .primitives import get_primitive

    steps = steps or default_steps(_g.world_size(group), get_primitive("fuse") is not None)
    example = batches[0]
    batch_size = example["input_ids"].shape[0]
    tokens = example["input_ids"].numel()
    base_model = _baseline(make_model, device, baseline_attention)
    budget = None
    if budget_max_factor:
        source = _BatchSource(make_batch or tiled_batches(batches), device)
        # a new batch recompiles compiled regions on GPU: one untimed step there; on CPU the
        # first step only grows the allocator, which the fastest-of-steps timing already skips
        warm = 1 if example["input_ids"].device.type == "cuda" else 0
        budget = _Budget(0, budget_max_factor, budget_steps, warm, source, tokens / batch_size)
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
        _measure_step(_trainable(sch, lr, precision), res, batches[:train_steps], warmup,
                      tokens, budget)
        log(_describe(res))
    _ratios(results)
    return results


# ---- output -----------------------------------------------------------------------------------
def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n else "-"


def _x(v: float) -> str:
    return f"{v:.2f}x" if v else "-"


def _tps(v: float) -> str:
    return f"{v:,.0f}" if v else "-"


def _budget_batch(r: StepResult) -> str:
    if not r.budget_batch:
        return "-"
    cap = ", cap" if r.budget_capped and r.budget_batch > r.batch else ""
    return f"{r.budget_batch} ({r.budget_batch / r.batch:g}x{cap})"


def table(results: list[StepResult], title: str = "Progressive optimization"):
    """A rich Table: speed and memory at the demo batch, then the largest batch that fits the
    baseline's activation budget (its measured bytes) and the speed there."""
    from rich.table import Table

    t = Table(title=title)
    budget = any(r.budget_batch for r in results)
    cols = [("step", "left"), ("tokens/s", "right"), ("vs base", "right"),
            ("saved act.", "right"), ("vs base", "right")]
    if budget:
        cols += [("batch @ budget", "right"), ("saved @ budget", "right"),
                 ("tokens/s @ budget", "right"), ("vs base", "right")]
    for col, just in cols + [("verified", "center")]:
        t.add_column(col, justify=just)
    for r in results:
        ok = "[green]yes[/green]" if r.verified else ("[red]NO[/red]" if r.tokens_per_s
                                                      else "skipped")
        row = [r.name, _tps(r.tokens_per_s), _x(r.speedup), _mib(r.saved_bytes),
               _x(r.memory_ratio)]
        if budget:
            row += [_budget_batch(r), _mib(r.budget_saved_bytes), _tps(r.budget_tokens_per_s),
                    _x(r.budget_speedup)]
        t.add_row(*row, ok)
    return t


def summary(results: list[StepResult]) -> list[str]:
    """The trade in two sentences: the fastest step at the demo batch, and the fastest within
    the baseline's activation memory (with the batch that bought it). Ratios are this run's."""
    ran = [r for r in results[1:] if r.tokens_per_s]
    if not ran:
        return []
    fast = max(ran, key=lambda r: r.speedup)
    lines = [f"At the demo batch ({fast.batch}): fastest step '{fast.name}', {fast.speedup:.2f}x "
             f"the baseline's tokens/s, {fast.memory_ratio:.2f}x its saved activations."]
    fits = [r for r in ran if r.budget_speedup]
    if fits:
        best = max(fits, key=lambda r: r.budget_speedup)
        lines.append(f"Within the baseline's activation memory: '{best.name}' trains batch "
                     f"{best.budget_batch} ({best.budget_batch / best.batch:g}x) at "
                     f"{best.budget_speedup:.2f}x the baseline's tokens/s.")
    return lines


def to_json(results: list[StepResult]) -> list[dict]:
    return [asdict(r) for r in results]
