"""The one declaration of the schedule knobs of `model_schedule.apply`.

Every app reads its knobs from `ScheduleKnobs`: `apply` builds one from its keywords and
validates through it, `slapo train` derives its `--flags`, TOML keys and help text from the field
metadata (`slapo.train.config`), and `slapo tune` takes its knob names, candidate values and
baselines from it (`slapo.tune.model_spaces`). A knob added here is reachable everywhere; a
knob renamed here cannot leave a stale flag behind.

Each field carries, in `field(metadata=...)`:

- `help`: the one help text (CLI `--help`, docs, error messages);
- `kind`: "int", "float", "str" or "bool": what a flag or TOML value parses as;
- `choices`: the allowed values (str knobs), or `low`/`high`: the allowed range (numbers);
- `tune`: the candidates a tuning space offers by default; the first one is the baseline (the
  value a config that does not name the knob is measured with).

`validate()` holds every check that needs only the values; the checks that need the model
(heads divisible by tp, fusion and loss plans, a family's sequence plan, the schedule's group
size) stay in `apply`, which runs all of them before the first mutation.

**One meaning of `attention`.** `None` (the default) keeps the model's own attention
implementation (what HF picked, usually its SDPA path). `"eager"` means HF's *eager* math
attention, set with `model.set_attn_implementation("eager")`: the same in `slapo train
--attention eager`, a tuning trial with `attention="eager"` and the progressive demo's eager
baseline. `"sdpa"` and `"flash"` install Slapo's attention core (PyTorch SDPA; flash-attn on CUDA).
"""

from __future__ import annotations

from dataclasses import MISSING, Field, asdict, dataclass, field, fields
from typing import Any

from ..errors import SchedulingError

ATTENTION = ("eager", "sdpa", "flash")
CP_ATTENTION = ("allgather", "ring", "ulysses")  # `op.context_parallel.CP_ATTENTION`
CKPT_POLICIES = ("full", "selective")
KINDS = ("int", "float", "str", "bool")
# The knobs that are parallel degrees: their values are checked by `runtime.mesh.check_degree`,
# the placement's one check, so a degree has one rule and one message wherever it is given.
DEGREE_KNOBS = ("tp", "pp_stages")


class KnobError(SchedulingError):
    """A knob value is out of its domain; `knob` names the field (`--flag` in the CLI)."""

    def __init__(self, knob: str, problem: str, fix: str, path: str = ""):
        self.knob = knob
        super().__init__(path, problem, fix)


def _knob(default: Any, help: str, kind: str, *, choices: tuple | None = None,
          low: float | None = None, high: float | None = None, tune: tuple | None = None) -> Any:
    """A schema field: its default and the metadata every app derives its interface from."""
    assert kind in KINDS, kind
    meta = {"help": help, "kind": kind, "choices": choices, "low": low, "high": high,
            "tune": tune}
    return field(default=default, metadata=meta)


@dataclass
class ScheduleKnobs:
    """The knobs of `slapo.model_schedule.apply`, one field each (`model_schedule/knobs.py`)."""

    tp: int | None = _knob(
        None, "tensor-parallel degree: Megatron column/row-parallel layers over the mesh's "
        "'tp' dimension (None: the schedule's tensor-parallel group size)", "int", low=1)
    ckpt_ratio: float = _knob(
        0.0, "share of layers (the first round(ratio * L)) with activation checkpointing",
        "float", low=0.0, high=1.0, tune=(0.0, 0.5, 1.0))
    ckpt_policy: str = _knob(
        "full", "full (recompute the whole checkpointed layer) or selective (keep matmul and "
        "attention outputs, recompute the rest: torch's SAC) for the --ckpt-ratio layers",
        "str", choices=CKPT_POLICIES, tune=CKPT_POLICIES)
    offload_ratio: float = _knob(
        0.0, "share of layers (the round(ratio * L) after the checkpointed ones) whose saved "
        "activations of 1 MiB or more wait in pinned host memory from forward to backward "
        "(CUDA; backward prefetches one layer ahead; its GPU path not yet measured)", "float", low=0.0, high=1.0)
    attention: str | None = _knob(
        None, "attention: eager (HF's eager math attention, forced), sdpa (Slapo's SDPA core), "
        "flash (flash-attn on CUDA); not given: the model's own implementation (HF's default, "
        "usually its SDPA path)", "str", choices=ATTENTION, tune=("eager", "sdpa"))
    fuse: bool = _knob(
        False, "trace each MLP and compile its bias+activation (or gated activation) into one "
        "kernel", "bool", tune=(False, True))
    fuse_compiler: str = _knob(
        "inductor", "torch.compile backend of the --fuse regions (inductor, aot_eager, ...)",
        "str")
    tempo: bool = _knob(
        False, "Tempo's memory-saving GELU, LayerNorm and softmax-dropout-matmul layers",
        "bool", tune=(False, True))
    pp_stages: int = _knob(
        1, "pipeline stages: cuts at evenly spaced layer boundaries (1: no pipeline)", "int",
        low=1)
    sequence_parallel: bool = _knob(
        False, "Megatron sequence parallelism with tp > 1: norms, dropout and residuals on "
        "sequence shards (GPT-2, GPT-Neo, LLaMA, BERT, RoBERTa, OPT)", "bool",
        tune=(False, True))
    vocab_parallel: bool = _knob(
        True, "with tp > 1, shard the embedding and LM head along the vocabulary", "bool",
        tune=(True, False))
    compile_blocks: bool | str = _knob(
        False, "torch.compile every transformer layer or ResNet block (one graph shared by "
        "identical layers; turns the KV cache off)", "bool", tune=(False, True))
    fused_loss: bool = _knob(
        False, "LM head + cross-entropy in chunks, no logits (needs an unsharded head: "
        "vocab_parallel off under tp > 1)", "bool", tune=(False, True))
    kernels: bool = _knob(
        False, "Slapo's fused GPU kernels (RMSNorm, LayerNorm, SwiGLU, GELU); exact PyTorch "
        "fallbacks on CPU", "bool", tune=(False, True))

    cp_attention: str = _knob(
        "allgather", "on a mesh with cp > 1, how attention crosses the cp ranks: allgather "
        "(K/V all-gathered, Llama 3's choice for GQA), ring (K/V blocks passed rank to rank, "
        "merged by log-sum-exp; K/V memory 1/cp) or ulysses (all-to-all of sequence <-> "
        "heads; the heads must divide by cp)", "str", choices=CP_ATTENTION)

    def validate(self, path: str = "") -> ScheduleKnobs:
        """Reject out-of-domain values and contradicting knobs, naming the knob and the fix.
        Mutates nothing (`apply` calls it before touching the model); returns self."""
        for f in fields(self):
            _check_value(f, getattr(self, f.name), path)
        _check_combinations(self, path)
        return self

    def as_kwargs(self) -> dict[str, Any]:
        """The `model_schedule.apply` keyword arguments."""
        return asdict(self)

    @classmethod
    def from_given(cls, given: dict[str, Any]) -> ScheduleKnobs:
        """The knobs with the `given` values (unknown names rejected), defaults elsewhere."""
        unknown = sorted(set(given) - set(names()))
        if unknown:
            raise KnobError(unknown[0], f"unknown schedule knob(s) {', '.join(unknown)}.",
                            f"use one of {', '.join(names())}.")
        return cls(**given)


def knob_fields() -> tuple[Field, ...]:
    """The schema's fields, in declaration order."""
    return fields(ScheduleKnobs)


def names() -> tuple[str, ...]:
    return tuple(f.name for f in knob_fields())


def spec(name: str) -> dict[str, Any]:
    """The metadata of one knob (help, kind, choices, low, high, tune) plus its default."""
    for f in knob_fields():
        if f.name == name:
            return {**f.metadata, "default": None if f.default is MISSING else f.default}
    raise KeyError(f"no schedule knob {name!r}; knobs: {', '.join(names())}")


def tune_candidates(name: str) -> tuple:
    """The values a tuning space offers for `name` by default (the first is the baseline)."""
    cands = spec(name)["tune"]
    if cands is None:
        raise KeyError(f"schedule knob {name!r} has no tuning candidates")
    return cands


def baseline(name: str) -> Any:
    """The value a tuning config that does not name `name` is measured with: its first tuning
    candidate (e.g. attention "eager": the CPU space's trials run HF eager), else the default."""
    s = spec(name)
    return s["tune"][0] if s["tune"] else s["default"]


def parse_value(name: str, text: str) -> Any:
    """A knob value from command-line text, by the knob's kind (bool: true/false, on/off, 1/0)."""
    kind = spec(name)["kind"]
    if kind == "bool":
        low = text.strip().lower()
        if low in ("true", "on", "1", "yes"):
            return True
        if low in ("false", "off", "0", "no"):
            return False
        raise ValueError(f"{name}: {text!r} is not a bool (true/false)")
    if kind == "str" and text.strip().lower() == "none" and spec(name)["default"] is None:
        return None
    return {"int": int, "float": float, "str": str}[kind](text.strip())


# ---- checks -----------------------------------------------------------------------------------
def _check_value(f: Field, v: Any, path: str) -> None:
    """One knob's value against its kind, choices and range."""
    if v is None and f.default is None:
        return  # "not given": the knob's documented fallback
    if f.name == "compile_blocks":
        _check_compile_blocks(v, path)
        return
    if f.name in DEGREE_KNOBS:
        _check_degree(f.name, v, path)
        return
    meta = f.metadata
    if meta["kind"] == "bool":
        _need(isinstance(v, bool), f.name, f"{f.name} must be True or False, got {v!r}.",
              f"pass {f.name}=True or {f.name}=False.", path)
    elif meta["kind"] in ("int", "float"):
        _check_number(f, v, path)
    elif meta["choices"] is not None:
        _need(v in meta["choices"], f.name, f"unknown {f.name} {v!r}.",
              f"use one of {', '.join(meta['choices'])}.", path)
    elif f.name == "fuse_compiler":
        _need((isinstance(v, str) and v) or callable(v), f.name,
              f"fuse_compiler must be a torch.compile backend name, got {v!r}.",
              "pass e.g. fuse_compiler='inductor'.", path)


def _check_number(f: Field, v: Any, path: str) -> None:
    meta = f.metadata
    is_int = isinstance(v, int) and not isinstance(v, bool)
    ok = is_int or (meta["kind"] == "float" and isinstance(v, float))
    lo, hi = meta["low"], meta["high"]
    ok = ok and (lo is None or v >= lo) and (hi is None or v <= hi)
    if hi is not None:
        want, example = f"a number in [{lo:g}, {hi:g}]", f"{f.name}={(lo + hi) / 2:g}"
    else:
        want, example = f"a{' positive' if lo == 1 else ''} {meta['kind']}", f"{f.name}=1"
    _need(ok, f.name, f"{f.name} must be {want}, got {v!r}.", f"pass e.g. {example}.", path)


def _check_degree(name: str, v: Any, path: str) -> None:
    """`tp` and `pp_stages` are parallel degrees: checked by the placement's one check
    (`runtime.mesh.check_degree`), named as the knob."""
    from ..runtime.mesh import check_degree

    try:
        check_degree(name, v)
    except SchedulingError as e:
        raise KnobError(name, e.problem, e.fix or "", path) from e


def _check_compile_blocks(v: Any, path: str) -> None:
    _need(isinstance(v, (bool, str)) or callable(v), "compile_blocks",
          f"compile_blocks must be a bool or a backend name, got {v!r}.",
          "pass compile_blocks=True.", path)
    if isinstance(v, str):
        _check_backend("compile_blocks", v, path)


_KNOWN_GOOD = ("inductor", "aot_eager", "eager")  # registered by torch itself: no lookup


def _check_backend(knob: str, v: Any, path: str, extra: tuple[str, ...] = ()) -> None:
    """A backend *name* must be registered: `apply` would otherwise find out only when it
    fuses or compiles the first layer, after attention and TP have already changed the model.
    The registry lookup imports dynamo, so the names torch always registers skip it."""
    if not isinstance(v, str) or v in _KNOWN_GOOD or v in extra:
        return
    from ..primitives.fuse import available_backends

    known = available_backends()
    _need(v in known, knob, f"{knob}: unknown torch.compile backend {v!r}.",
          f"use one of {', '.join(known)}.", path)


def _check_combinations(k: ScheduleKnobs, path: str) -> None:
    """Knobs that contradict each other whatever the model."""
    if k.fuse:  # the backend is used only by fuse=True (a trial or config may carry it unused)
        _check_backend("fuse_compiler", k.fuse_compiler, path, extra=("eager",))
    if k.compile_blocks and k.fuse:
        raise KnobError("fuse", "fuse=True compiles regions inside the blocks that "
                        "compile_blocks=True compiles whole (inductor fuses the same ops).",
                        "pass fuse=False with compile_blocks=True.", path)
    if k.fused_loss and k.vocab_parallel and (k.tp or 1) > 1:
        raise KnobError("fused_loss", "fused_loss needs an unsharded LM head, and "
                        "vocab_parallel=True shards it under tp > 1.",
                        "pass vocab_parallel=False with fused_loss=True.", path)
    if k.ckpt_ratio + k.offload_ratio > 1.0 + 1e-9:
        raise KnobError("offload_ratio", f"ckpt_ratio={k.ckpt_ratio} and offload_ratio="
                        f"{k.offload_ratio} ask for more than every layer (a layer is "
                        "checkpointed or offloaded, not both).", "pass ratios that sum to at "
                        "most 1.", path)
    if k.sequence_parallel and k.pp_stages > 1:
        raise KnobError("sequence_parallel", "sequence_parallel with pp_stages > 1 is not "
                        "supported (stage boundaries would carry sequence shards).",
                        "use one of sequence_parallel or pipeline stages.", path)


def _need(ok: Any, knob: str, problem: str, fix: str, path: str) -> None:
    if not ok:
        raise KnobError(knob, problem, fix, path)

