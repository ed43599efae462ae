"""The `SLAPO_FAULT` test hook: kill, fail or stop a rank at a named point of a run.

`SLAPO_FAULT` is a **test hook**, read by the seam (`slapo.faultpoints.requested`): `ACTION:POINT=STEP:rank=R` with
ACTION `kill` (SIGKILL this process), `raise` (an `InjectedFault`), `sigint` (Ctrl-C at that
point: SIGINT to torchrun's agent, which forwards it to every worker, or to this process
without a launcher; then wait here until it arrives) or `sigterm` (the same with SIGTERM, as a
job scheduler stops a job), and POINT `step` (training
step STEP, after its backward, before the optimizer update), `save` (the checkpoint of step STEP,
after the tensors and RNG files are written, before the completion marker), `pp` (the first
pipeline-stage forward of training step STEP) or `pp_backward` (the first pipeline-stage
backward of training step STEP, raised inside the guarded backward, as a failing autograd
Function would be). Steps are counted as the run counts them (1-based, continued across
`--resume`). Example: `SLAPO_FAULT=kill:save=3:rank=1`.

Production code holds no part of this: it marks its points through the no-op seam
`slapo.faultpoints`, which `install` routes here when a fault is planned.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Any

from .. import faultpoints
from ..faultpoints import ENV
from .stop_signals import launched_by_torchrun

ACTIONS = ("kill", "raise", "sigint", "sigterm")
POINTS = ("step", "save", "pp", "pp_backward")
SIGNAL_WAIT_S = 60.0  # the `sigint` test action waits this long for its signal to come back

__all__ = ["ENV", "Fault", "InjectedFault", "install", "note_step", "parse", "planned", "point"]


class InjectedFault(RuntimeError):
    """Raised by `SLAPO_FAULT=raise:...`: an error that exists only because a test asked."""


@dataclass(frozen=True)
class Fault:
    """One planned fault: `action` at `point` of training step `step`, on global rank `rank`."""

    action: str
    point: str
    step: int
    rank: int

    def fires(self, point: str, step: int, rank: int) -> bool:
        return (point, step, rank) == (self.point, self.step, self.rank)


def parse(spec: str) -> Fault:
    """`kill:step=3:rank=1` -> Fault("kill", "step", 3, 1); a clear error for anything else."""
    usage = (f"{ENV} must look like ACTION:POINT=STEP:rank=R with ACTION in {ACTIONS} and "
             f"POINT in {POINTS} (e.g. kill:save=3:rank=1), got {spec!r}")
    parts = spec.strip().split(":")
    if len(parts) != 3 or parts[0] not in ACTIONS:
        raise ValueError(usage)
    fields = dict(p.split("=", 1) for p in parts[1:] if "=" in p)
    points = [p for p in POINTS if p in fields]
    if len(fields) != 2 or len(points) != 1 or "rank" not in fields:
        raise ValueError(usage)
    try:
        step, rank = int(fields[points[0]]), int(fields["rank"])
    except ValueError:
        raise ValueError(usage) from None
    if step < 1 or rank < 0:
        raise ValueError(usage)
    return Fault(parts[0], points[0], step, rank)


def planned(environ: dict[str, str] | None = None) -> Fault | None:
    """The fault `SLAPO_FAULT` asks for, or None (the variable is read by the seam:
    `faultpoints.requested`)."""
    spec = faultpoints.requested(environ)
    return parse(spec) if spec else None


_PLAN: dict[str, Any] = {"fault": None, "rank": 0, "done": 0}  # done: completed steps


def note_step(done: int) -> None:
    """The run's completed steps (set on resume, so STEP counts as the run does)."""
    _PLAN["done"] = done


def point(name: str, step: int | None = None) -> None:
    """Fire the planned fault if it is for `name` at `step` (default: the step in progress) on
    this rank. Costs one dict lookup when no fault is planned."""
    fault = _PLAN["fault"]
    if fault is None:
        return
    step = _PLAN["done"] + 1 if step is None else step
    if fault.fires(name, step, _PLAN["rank"]):
        _PLAN["fault"] = None  # once
        _fire(fault)


def _fire(fault: Fault) -> None:
    where = f"{fault.point} of step {fault.step} on rank {fault.rank}"
    if fault.action in ("sigint", "sigterm"):
        _signal_here(signal.SIGINT if fault.action == "sigint" else signal.SIGTERM, where)
    if fault.action == "kill":
        print(f"{ENV}: killing rank {fault.rank} (SIGKILL) at the {where}", file=sys.stderr,
              flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"{ENV}: raising on rank {fault.rank} at the {where}", file=sys.stderr, flush=True)
    raise InjectedFault(f"{ENV}: injected failure at the {where}")


def install(rank: int, environ: dict[str, str] | None = None) -> Fault | None:
    """Arm the fault `SLAPO_FAULT` plans (if any) for this rank: optimizer hooks count steps and
    fire `step`; a global forward pre-hook fires `pp` in pipeline stage modules (marked by
    `slapo.runtime.pipeline_guards.make_stages`); the seam's marked points
    (`slapo.faultpoints.reach`) fire `pp_backward` (inside a guarded stage backward) and `save`
    (inside `run_state.save`)."""
    fault = planned(environ)
    _PLAN.update(fault=fault, rank=rank, done=0)
    if fault is None or fault.rank != rank or _PLAN.get("hooked"):
        return fault
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    register_optimizer_step_pre_hook(lambda *a: point("step"))
    register_optimizer_step_post_hook(lambda *a: note_step(_PLAN["done"] + 1))
    register_module_forward_pre_hook(
        lambda m, a: point("pp") if getattr(m, "slapo_pipeline_stage", None) is not None
        else None)
    faultpoints.enable(_SeamHook())
    _PLAN["hooked"] = True
    return fault


class _SeamHook:
    """The production paths' marked points (`faultpoints.reach`), routed to `point`."""

    def reach(self, name: str, step: int | None) -> None:
        point(name, step)

    def steps_done(self, done: int) -> None:
        note_step(done)


def _signal_here(signum: signal.Signals, where: str) -> None:
    """Ctrl-C (SIGINT) or a scheduler's SIGTERM at this point: the signal to the launcher
    (torchrun's agent forwards it to every worker, as it does for a Ctrl-C in the terminal) or,
    without one, to this process; then wait for it here, so it lands at exactly this point."""
    target = os.getppid() if launched_by_torchrun() else os.getpid()
    who = f"the launcher (pid {target})" if target != os.getpid() else "this process"
    print(f"{ENV}: sending {signum.name} to {who} at the {where}", file=sys.stderr, flush=True)
    os.kill(target, signum)
    deadline = time.monotonic() + SIGNAL_WAIT_S
    while time.monotonic() < deadline:
        time.sleep(0.05)
    raise InjectedFault(f"{ENV}: the {signum.name} sent at the {where} did not arrive within "
                        f"{SIGNAL_WAIT_S:.0f} s")
