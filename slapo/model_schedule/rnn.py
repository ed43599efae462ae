"""Ready schedule for recurrent models: every `nn.LSTM` / `nn.GRU` becomes EcoRNN's fused twin.

    sch = apply_rnn(model, layout="hidden_major", ckpt_chunk=16)
    model = slapo.build(sch)  # or sch.mod

Not a HF family (recurrent models have no `config.model_type`): call it directly. Each RNN is
swapped by the `replace` primitive (so `sch.applied()` records one `replace(FusedLSTM(...))` per
module) for `slapo.op.rnn.FusedLSTM` / `FusedGRU` built by `from_module`, which keeps the *same*
Parameter objects and names: the state_dict, an optimizer built before the swap and tied weights
all stay valid. What the knobs do (fusion, layout, compiled cell, checkpointing over time
chunks) is documented in `slapo/op/rnn.py` and docs/rnn.md.

Decisions:
* Only exact `nn.LSTM` / `nn.GRU` instances are replaced; a subclass (whose forward may differ)
  is refused with an error naming it, since silently skipping it would leave the user thinking
  it was scheduled. `nn.RNN` (tanh/relu) is left alone.
* `fused=False` is the unscheduled baseline (a schedule with nothing applied, for benchmarks and
  the tuner); the other knobs need the fused module, so combining them with it is an error.
* Every value and every module is checked before the first `replace`, so an error leaves the
  model and the schedule unchanged.
"""

from __future__ import annotations

from torch import nn

from ..errors import SchedulingError
from ..op.rnn import FUSED, LAYOUTS, check_knobs
from ..schedule import Schedule, create_schedule

__all__ = ["LAYOUTS", "apply_rnn", "rnn_paths"]


def rnn_paths(model: nn.Module) -> list[str]:
    """Paths of the `nn.LSTM` / `nn.GRU` modules `apply_rnn` would replace, in model order."""
    return [name for name, m in model.named_modules() if type(m) in FUSED]


def _check_fused_off(layout: str, compile_cell: bool, ckpt_chunk: int | None) -> None:
    asked = [k for k, v, d in (("layout", layout, "gates_major"),
                               ("compile_cell", compile_cell, False),
                               ("ckpt_chunk", ckpt_chunk, None)) if v != d]
    if asked:
        raise SchedulingError("", f"{', '.join(asked)} need the fused RNN, but fused=False.",
                              "pass fused=True, or drop " + ", ".join(asked) + ".")


def _check_modules(model: nn.Module) -> list[str]:
    """The paths to replace; raises for modules the fused RNN cannot stand in for."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.LSTM, nn.GRU)) and type(m) not in FUSED:
            raise SchedulingError(name, f"{type(m).__name__} subclasses "
                                  f"{'nn.LSTM' if isinstance(m, nn.LSTM) else 'nn.GRU'}; its "
                                  "forward may differ, so it is not replaced automatically.",
                                  "replace it yourself (sch[path].replace(FusedLSTM.from_module"
                                  "(m))) if its forward is nn.LSTM's, or use the base class.")
        if type(m) is nn.LSTM and m.proj_size:
            raise SchedulingError(name, f"nn.LSTM with proj_size={m.proj_size} is not supported "
                                  "by the fused LSTM.", "use proj_size=0 or leave this model "
                                  "unscheduled.")
    paths = rnn_paths(model)
    if not paths:
        raise SchedulingError("", "the model has no nn.LSTM or nn.GRU to schedule (an RNN "
                              "already fused by apply_rnn is not scheduled twice).",
                              "pass a model containing nn.LSTM / nn.GRU modules.")
    return paths


def apply_rnn(model_or_sch: nn.Module | Schedule, *, fused: bool = True,
              layout: str = "gates_major", compile_cell: bool = False,
              ckpt_chunk: int | None = None) -> Schedule:
    """Replace every `nn.LSTM` / `nn.GRU` of the model by its fused twin; returns the schedule.

    `layout`: one of `LAYOUTS` ("gates_major", "hidden_major", "batch_minor"; EcoRNN's GEMM
    layout knob); `compile_cell`: run each time step through `torch.compile`; `ckpt_chunk`:
    recompute the recurrence in chunks of this many time steps in backward (None: keep every
    step's activations). `fused=False` returns the schedule untouched (the baseline).
    """
    if not isinstance(model_or_sch, (nn.Module, Schedule)):
        raise SchedulingError("", f"apply_rnn expects an nn.Module or a Schedule, got "
                              f"{type(model_or_sch).__name__}.", "pass the model.")
    if not isinstance(fused, bool):
        raise SchedulingError("", f"fused must be True or False, got {fused!r}.", "pass a bool.")
    check_knobs(layout, compile_cell, ckpt_chunk)
    sch = model_or_sch if isinstance(model_or_sch, Schedule) else create_schedule(model_or_sch)
    if not fused:
        _check_fused_off(layout, compile_cell, ckpt_chunk)
        return sch
    paths = _check_modules(sch.mod)
    for path in paths:
        node = sch[path]
        node.replace(FUSED[type(node.mod)].from_module(
            node.mod, layout=layout, compile_cell=compile_cell, ckpt_chunk=ckpt_chunk))
    return sch
