"""Measured trials of a model schedule: the step `slapo train` runs, timed in a fresh process.

A trial is `train_trial` run by `CallableEvaluator` in a fresh
process, so a crash, a hang or running out of memory costs one trial, not the search. The trial
trains through the `Trainer` that `slapo.build` makes (`build_trainer`) with slapo train's model, optimizer and gradient
clipping (what is tuned is what `slapo train` runs; `tests/test_tune_trial_step.py` checks
that both give the same losses), and reports `throughput` (tokens/s, median over the measured
steps after warm-up) and `peak_memory_bytes`: `slapo.profile.meter`'s peak since the trial
started (on CPU the process's `VmHWM`, restarted when the trial begins, so the memory of the
parent or of earlier trials in the forkserver does not leak into the number).

On CPU the memory cap is enforced twice:

* post hoc, a reported peak above the cap marks the trial `oom` (exact, same metric);
* a hard guard: `RLIMIT_AS` = the trial's address space at start + cap + 1 GiB slack. It stops
  a runaway trial before it takes the machine down. It is relative because the address space
  of a process that imported torch is already several GB of mappings it never touches, so an
  absolute `RLIMIT_AS` = cap would kill every trial.
"""

from __future__ import annotations

import functools
import os
import resource
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from ..profile import meter
from .model_spaces import build_knobs, schedule_knobs
from .runner import CallableEvaluator, TrialResult, _check_peak
from .space import Config

_GUARD_SLACK = 1 << 30
# Imported once by the forkserver, so a trial does not spend seconds importing model code.
_PRELOAD = [__name__, "slapo.model_schedule", "slapo.train", "slapo.train.models",
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

    def train_config(self) -> Any:
        """The `slapo train` configuration this trial stands for (model size, seed, optimizer
        hyperparameters): the one source of the trial's model and step settings."""
        from ..train import TrainConfig

        return TrainConfig(model=self.model, hidden_size=self.hidden_size,
                           num_layers=self.num_layers, num_heads=self.num_heads,
                           seq_len=self.seq_len, seed=self.seed)


def _address_space_bytes() -> int | None:
    """Virtual size of this process (/proc/self/statm, in pages); None where /proc is missing."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _guard_address_space(mem_cap_bytes: int | None) -> None:
    """Hard stop for a runaway trial, relative to what is already mapped (see module doc)."""
    vm = _address_space_bytes()
    if mem_cap_bytes and vm is not None:
        limit = vm + int(mem_cap_bytes) + _GUARD_SLACK
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def build_scheduled(settings: TrialSettings, config: Config) -> Any:
    """A seeded model of `settings` (slapo train's model for that size) with the config's
    schedule knobs applied; returns the schedule (the model is `.mod`, in train mode)."""
    import torch

    from .. import model_schedule
    from ..train.models import build_model

    torch.manual_seed(settings.seed)
    model, spec = build_model(settings.model, settings.train_config().size())
    if spec.task != "causal":
        raise ValueError(f"tuning trains causal LMs on random tokens; {settings.model!r} is "
                         f"{spec.task}.")
    knobs = schedule_knobs(config)
    if knobs.get("attention") == "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")  # "eager" is HF eager, as in slapo train
    model.config.use_cache = False  # training: no KV cache (a checkpointed layer has none)
    sch = model_schedule.apply(model, tp=1, fuse_compiler=settings.fuse_compiler, **knobs)
    model.train()
    return sch


def build_scheduled_model(settings: TrialSettings, config: Config) -> Any:
    """The model of `build_scheduled` (for the cost model, which measures it)."""
    return build_scheduled(settings, config).mod


def trial_trainer(sch: Any, settings: TrialSettings, config: Config) -> Any:
    """The schedule's `Trainer`, built as `slapo train` builds it for one process: AdamW with
    its lr, weight decay and betas, its gradient clipping, the config's mixed precision."""
    import torch

    from ..runtime.build import build_trainer

    cfg = settings.train_config()
    return build_trainer(sch, optimizer=torch.optim.AdamW, seed=settings.seed,
                         optimizer_kwargs=cfg.optimizer_kwargs(),
                         grad_clip=cfg.grad_clip, **build_knobs(config))


def trial_batch(settings: TrialSettings, batch_size: int, vocab_size: int) -> dict:
    """Random tokens (seeded): step time and memory do not depend on the token values, and a
    trial must not read the corpus from every process."""
    import torch

    gen = torch.Generator().manual_seed(settings.seed + 1)
    ids = torch.randint(0, vocab_size, (batch_size, settings.seq_len), generator=gen)
    return {"input_ids": ids, "labels": ids}


def train_trial(settings: TrialSettings, config: Config,
                batches: list[dict] | None = None) -> dict[str, Any]:
    """One measured trial: tokens/s and peak memory of a few `train_step` calls.

    `batches`: the global batches of the steps, cycled (default: one batch of random tokens,
    `trial_batch`); tests pass slapo train's own to compare the losses.
    """
    import torch

    from ..runtime.step_timing import time_steps

    meter.reset_peak("cpu")
    _guard_address_space(settings.mem_cap_bytes)
    torch.set_num_threads(settings.threads)
    t0 = time.perf_counter()
    trainer = trial_trainer(build_scheduled(settings, config), settings, config)
    bs, seq = int(config["batch_size"]), settings.seq_len
    batches = batches or [trial_batch(settings, bs, trainer.model.config.vocab_size)]
    build_s = time.perf_counter() - t0
    n = settings.warmup + settings.steps
    timed = time_steps(trainer, [batches[i % len(batches)] for i in range(n)])
    step = statistics.median(timed.seconds[settings.warmup:] or timed.seconds)
    loss = timed.losses[-1]
    if not loss == loss:  # NaN: a schedule that breaks training is not a fast schedule
        raise FloatingPointError(f"loss is NaN for config {config!r}")
    return {
        "throughput": bs * seq / step,
        "step_time_s": step,
        "step_times_s": timed.seconds,
        "peak_memory_bytes": meter.peak_bytes("cpu"),
        "build_s": build_s,
        "loss": loss,
        "losses": timed.losses,
    }


class TrialEvaluator:
    """`evaluate(config)` for the searches: `train_trial` in its own process.

    `CallableEvaluator` gets no `mem_cap_bytes` (that would be an absolute `RLIMIT_AS`,
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
    """`"3G"`, `"512M"`, `"1.5GiB"`, `"2e9"` → bytes (binary units); None/""/0 → None."""
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
# GPU trials: the product's own step, `build_trainer(...).train_step`
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPUTrialSettings:
    """A GPU-space trial: the model (a `model_spaces.GPU_MODELS` entry), device and step counts."""

    model: str = "llama-1b"
    device: str = "cuda"
    steps: int = 5
    warmup: int = 3
    mem_cap_bytes: int | None = None
    seed: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def gpu_train_trial(settings: GPUTrialSettings, config: Config, spec: Any = None) -> dict:
    """Build the HF model on the device, `model_schedule.apply(**knobs)`, `slapo.build`
    with AdamW (fused on CUDA) and the config's `mixed_precision`, then time
    `train_step`: the same path as `benchmarks/gpu_train.py`'s slapo variants. Peak memory
    is `slapo.profile.meter`'s (`torch.cuda.max_memory_allocated`; peak RSS on CPU).
    `spec` overrides the model (tests pass a tiny one)."""
    import torch
    import transformers

    from .. import model_schedule
    from ..runtime.build import build_trainer
    from ..runtime.step_timing import time_steps
    from .model_spaces import GPU_MODELS

    spec = spec or GPU_MODELS[settings.model]
    dev = torch.device(settings.device)
    meter.reset_peak(dev)
    torch.manual_seed(settings.seed)
    cfg = getattr(transformers, spec.config_class)(**spec.kwargs)
    with dev:
        model = getattr(transformers, spec.model_class)(cfg).train()
    sch = model_schedule.apply(model, **schedule_knobs(config))
    trainer = build_trainer(sch, optimizer=torch.optim.AdamW,
                            optimizer_kwargs=dict(lr=1e-4, fused=dev.type == "cuda"),
                            **build_knobs(config))
    batch = _gpu_batch(cfg, int(config["batch_size"]), spec.seq, dev, settings.seed)
    timed = time_steps(trainer, [batch] * (settings.warmup + settings.steps))
    loss = timed.losses[-1]
    if not loss == loss:
        raise FloatingPointError(f"loss is NaN for config {config!r}")
    step = statistics.median(timed.seconds[settings.warmup:] or timed.seconds)
    return {"throughput": int(config["batch_size"]) * spec.seq / step, "step_time_s": step,
            "peak_memory_bytes": meter.peak_bytes(dev), "loss": loss}


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
    """`evaluate(config)`: `gpu_train_trial` in a fresh process (a CUDA OOM or a crash
    costs one trial; no allocator or compiled-graph state leaks into the next)."""

    def __init__(self, settings: GPUTrialSettings, timeout_s: float,
                 start_method: str = "spawn", spec: Any = None, preload: tuple = ()):
        """`start_method="forkserver"` with `preload` (modules the server imports once, none
        of which initialises CUDA) starts each trial without re-importing torch; `spec`
        overrides `settings.model`'s `GPU_MODELS` entry (e.g. a tiny model)."""
        self.settings = settings
        self.inner = CallableEvaluator(functools.partial(gpu_train_trial, settings, spec=spec),
                                       timeout_s, start_method=start_method, preload=preload)

    def __call__(self, config: Config) -> TrialResult:
        return _check_peak(self.inner(config), "peak_memory_bytes", self.settings.mem_cap_bytes)
