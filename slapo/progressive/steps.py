"""The progressions: which knobs each step adds (`Step`), and what a measured row holds
(`StepResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field


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


def default_steps(tp: int, tempo: bool = True, fuse_compiler: str = "inductor") -> list[Step]:
    """The CPU progression (fp32): what a schedule can change on a CPU. `tp`: the degree of the
    mesh's "tp" dimension (a TP step only when > 1)."""
    knobs: dict = {}
    steps = [Step("baseline (HF eager)", {})]

    def add(name: str, note: str = "", **k) -> None:
        knobs.update(k)
        steps.append(Step(name, dict(knobs), note))

    add("+ SDPA attention", attention="sdpa")
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
