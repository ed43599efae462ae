"""Measured trials of a model schedule: build, ``model_schedule.apply``, train a few steps.

A trial is :func:`train_trial` run by :class:`~slapo.tune.runner.CallableEvaluator` in a fresh
process, so a crash, a hang or running out of memory costs one trial, not the search. It reports
``throughput`` (tokens/s, median over the measured steps after warm-up) and
``peak_memory_bytes``: the process's peak resident set (``VmHWM``) since the trial started.
``/proc/self/clear_refs`` resets that peak when the trial begins, so the memory of the parent
or of earlier trials in the forkserver does not leak into the number.

On CPU the memory cap is enforced twice:

* post hoc, a reported peak above the cap marks the trial ``oom`` (exact, same metric);
* a hard guard: ``RLIMIT_AS`` = the trial's address space at start + cap + 1 GiB slack. It stops
  a runaway trial before it takes the machine down. It is relative because the address space
  of a process that imported torch is already several GB of mappings it never touches, so an
  absolute ``RLIMIT_AS`` = cap would kill every trial.
"""

from __future__ import annotations

import functools
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from .runner import CallableEvaluator, TrialResult, _check_peak
from .space import Config
from .spaces import schedule_knobs

_GUARD_SLACK = 1 << 30
# Imported once by the forkserver, so a trial does not spend seconds importing model code.
_PRELOAD = [__name__, "slapo.model_schedule", "slapo.train.models",
            "transformers.models.gpt2.modeling_gpt2"]


@dataclass(frozen=True)
class TrialSettings:
    """Everything a trial needs besides its config (fixed for one tuning run).

    The defaults are GPT-2 small's width (768, 12 heads) cut to 2 layers at seq 128, so a
    72-point exhaustive baseline takes minutes, not hours, on a 2-core CPU.
    """

    model: str = "gpt2"
    hidden_size: int = 768
    num_layers: int = 2
    num_heads: int = 12
    seq_len: int = 128
    steps: int = 3
    warmup: int = 1
    threads: int = 1
    fuse_compiler: str = "aot_eager"
    mem_cap_bytes: int | None = None
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def reset_peak_rss() -> bool:
    """Make VmHWM restart from the current RSS (Linux ≥ 4.0); False where that is unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set of this process (VmHWM; ru_maxrss where /proc is missing)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def rss_bytes() -> int:
    """Current resident set of this process (0 where /proc is missing)."""
    return (_status_kib("VmRSS") or 0) * 1024


def _guard_address_space(mem_cap_bytes: int | None) -> None:
    """Hard stop for a runaway trial, relative to what is already mapped (see module doc)."""
    vm = _status_kib("VmSize")
    if mem_cap_bytes and vm is not None:
        limit = vm * 1024 + int(mem_cap_bytes) + _GUARD_SLACK
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def build_scheduled_model(settings: TrialSettings, config: Config) -> Any:
    """A seeded model of ``settings`` with the config's schedule knobs applied (train mode)."""
    import torch

    from .. import model_schedule
    from ..train.models import ModelSize, build_model

    torch.manual_seed(settings.seed)
    size = ModelSize(hidden=settings.hidden_size, layers=settings.num_layers,
                     heads=settings.num_heads, max_positions=max(settings.seq_len, 16))
    model, spec = build_model(settings.model, size)
    if spec.task != "causal":
        raise ValueError(f"tuning trains causal LMs on random tokens; {settings.model!r} is "
                         f"{spec.task}.")
    if hasattr(model, "set_attn_implementation"):  # "eager" means HF eager; "sdpa" is Slapo's core
        model.set_attn_implementation("eager")
    model_schedule.apply(model, tp=1, fuse_compiler=settings.fuse_compiler, **schedule_knobs(config))
    return model.train()


def _train_steps(model: Any, batch: dict, n: int) -> tuple[list[float], float]:
    """Seconds of each of ``n`` AdamW steps and the last loss."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, loss = [], float("nan")
    for _ in range(n):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = model(**batch, use_cache=False)  # a checkpointed layer has no KV cache
        out.loss.backward()
        opt.step()
        loss = float(out.loss.detach())
        times.append(time.perf_counter() - t0)
    return times, loss


def train_trial(settings: TrialSettings, config: Config) -> dict[str, Any]:
    """One measured trial: tokens/s and peak RSS of a few training steps on random tokens.

    Random tokens are enough: step time and memory do not depend on the token values, and the
    trial must not read the corpus from every process.
    """
    import torch

    reset_peak_rss()
    _guard_address_space(settings.mem_cap_bytes)
    torch.set_num_threads(settings.threads)
    t0 = time.perf_counter()
    model = build_scheduled_model(settings, config)
    bs, seq = int(config["batch_size"]), settings.seq_len
    gen = torch.Generator().manual_seed(settings.seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (bs, seq), generator=gen)
    build_s = time.perf_counter() - t0
    times, loss = _train_steps(model, {"input_ids": ids, "labels": ids},
                               settings.warmup + settings.steps)
    measured = times[settings.warmup:] or times
    step = statistics.median(measured)
    if not loss == loss:  # NaN: a schedule that breaks training is not a fast schedule
        raise FloatingPointError(f"loss is NaN for config {config!r}")
    return {
        "throughput": bs * seq / step,
        "step_time_s": step,
        "step_times_s": times,
        "peak_memory_bytes": peak_rss_bytes(),
        "build_s": build_s,
        "loss": loss,
    }


class TrialEvaluator:
    """``evaluate(config)`` for the searches: :func:`train_trial` in its own process.

    ``CallableEvaluator`` gets no ``mem_cap_bytes`` (that would be an absolute ``RLIMIT_AS``,
    see the module doc); the cap is checked here against the reported peak and guarded in the
    trial itself.
    """

    def __init__(self, settings: TrialSettings, timeout_s: float,
                 start_method: str | None = None):
        self.settings = settings
        self.inner = CallableEvaluator(functools.partial(train_trial, settings), timeout_s,
                                       start_method=start_method, preload=_PRELOAD)

    def __call__(self, config: Config) -> TrialResult:
        res = self.inner(config)
        return _check_peak(res, "peak_memory_bytes", self.settings.mem_cap_bytes)


def parse_bytes(text: str | int | float | None) -> int | None:
    """``"3G"``, ``"512M"``, ``"1.5GiB"``, ``"2e9"`` → bytes (binary units); None/""/0 → None."""
    if text is None or text == "" or text == 0:
        return None
    if isinstance(text, (int, float)):
        return int(text)
    s = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    num = s[:-1] if s[-1:] in "KMGT" else s
    try:
        value = float(num) * mult
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; use e.g. 3G, 512M or 2e9.") from None
    if value <= 0:
        raise ValueError(f"memory cap must be positive, got {text!r}.")
    return int(value)



# ------------------------------------------------------------------------------------------------
# GPU trials: the product's own step, `slapo.build(...).train_step`
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUTrialSettings:
    """A GPU-space trial: the model (a ``spaces.GPU_MODELS`` entry), device and step counts."""

    model: str = "llama-1b"
    device: str = "cuda"
    steps: int = 5
    warmup: int = 3
    mem_cap_bytes: int | None = None
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gpu_train_trial(settings: GPUTrialSettings, config: Config, spec: Any = None) -> dict:
    """Build the HF model on the device, ``model_schedule.apply(**knobs)``, ``slapo.build``
    with AdamW (fused on CUDA) and the config's ``mixed_precision``, then time
    ``train_step``: the same path as ``benchmarks/gpu_train.py``'s slapo variants. Peak memory
    is ``torch.cuda.max_memory_allocated`` (peak RSS on CPU). ``spec`` overrides the model
    (tests pass a tiny one)."""
    import torch
    import transformers

    from .. import build, model_schedule
    from .spaces import GPU_MODELS, build_knobs

    spec = spec or GPU_MODELS[settings.model]
    dev = torch.device(settings.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    torch.manual_seed(settings.seed)
    cfg = getattr(transformers, spec.config_class)(**spec.kwargs)
    with dev:
        model = getattr(transformers, spec.model_class)(cfg).train()
    sch = model_schedule.apply(model, **schedule_knobs(config))
    trained, _ = build(sch, optimizer=torch.optim.AdamW,
                       optimizer_kwargs=dict(lr=1e-4, fused=cuda), **build_knobs(config))
    batch = _gpu_batch(cfg, int(config["batch_size"]), spec.seq, dev, settings.seed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, loss = [], float("nan")
    for _ in range(settings.warmup + settings.steps):
        t0 = time.perf_counter()
        loss = trained.train_step(batch)
        sync()
        times.append(time.perf_counter() - t0)
    if not loss == loss:
        raise FloatingPointError(f"loss is NaN for config {config!r}")
    step = statistics.median(times[settings.warmup:] or times)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else peak_rss_bytes()
    return {"throughput": int(config["batch_size"]) * spec.seq / step, "step_time_s": step,
            "peak_memory_bytes": peak, "loss": loss}


def _gpu_batch(cfg: Any, batch: int, seq: int, dev: Any, seed: int) -> dict:
    """Random ids, as benchmarks/gpu_train.py: causal LMs label every token, masked LMs 15%."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    labels = ids.clone()
    if cfg.model_type in ("bert", "roberta"):
        labels[torch.rand((batch, seq), generator=g) >= 0.15] = -100
    return {"input_ids": ids.to(dev), "labels": labels.to(dev)}


class GPUTrialEvaluator:
    """``evaluate(config)``: :func:`gpu_train_trial` in a fresh process (a CUDA OOM or a crash
    costs one trial; no allocator or compiled-graph state leaks into the next)."""

    def __init__(self, settings: GPUTrialSettings, timeout_s: float):
        self.settings = settings
        self.inner = CallableEvaluator(functools.partial(gpu_train_trial, settings), timeout_s,
                                       start_method="spawn")

    def __call__(self, config: Config) -> TrialResult:
        return _check_peak(self.inner(config), "peak_memory_bytes", self.settings.mem_cap_bytes)
