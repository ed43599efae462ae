"""`Verify`'s checks of pipeline cuts: every parameter in exactly one stage, and the stages run
one after the other computing the model's forward and gradients.

Why apart from `core.py`: these checks build the stages (`runtime.partition`) and feed them the
way the pipeline runtime does (`runtime.pipeline_inputs`), a concern of their own; `Verify`
mixes them in and runs them from `check()`.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from ..distributed.rng import get_rng_tracker
from ..errors import SchedulingError, VerificationError

_EPS = 1e-6  # relative roundoff floor (fp32 eps ~1.2e-7, times accumulation depth)


def _eps(dtype: torch.dtype) -> float:
    """The roundoff floor of outputs in `dtype`: `_EPS`, scaled down for float64 (whose eps is
    2e-9 of float32's), so a stage that computes a step in float32 where the float64 model's
    forward does not (or the reverse: a soft-cap, a rotary embedding) is seen. Never looser
    than float32's."""
    if not dtype.is_floating_point:
        return _EPS
    return _EPS * min(1.0, torch.finfo(dtype).eps / torch.finfo(torch.float32).eps)


def _stage_output_pairs(got, want) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, stage value, model value) for what the last pipeline stage returns: the fields of
    its wrapped output (an HF `ModelOutput` with `logits`), or a tensor / tuple compared with the
    model's output (a tensor, or the first fields of an HF base model's output)."""
    if hasattr(got, "keys"):
        return [(f"output.{k}", got[k], getattr(want, k)) for k in got.keys()]
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want.to_tuple() if hasattr(want, "to_tuple") else \
        (want if isinstance(want, tuple) else (want,))
    return [(f"output[{i}]", g, w) for i, (g, w) in enumerate(zip(got_t, want_t, strict=False))]


def _grads(loss: torch.Tensor, params: list[tuple[str, nn.Parameter]]) -> list:
    """d loss / d each parameter (None where the loss does not reach it)."""
    found = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
    return [None if g is None else g.detach() for g in found]


class PipelineChecks:
    """Mixed into `Verify` (it provides `sch`, `inputs`, `kwargs`, `seed`, `rtol`, `report`,
    `_meta`, `_run`, `_fail` and `_settle`)."""

    def _check_pipeline(self) -> None:
        """With pipeline cuts: every parameter belongs to exactly one stage (`partition`'s
        stages, as `build` makes them), and the stages run one after the other compute the
        model's forward; else a `VerificationError` naming the modules left out (or held
        twice) and the cuts, or the stage output that differs."""
        cuts = list(self.sch.pipeline_cuts)
        if not cuts:
            return
        from ..runtime.partition import check_stage_coverage, partition

        root = self.sch.mod
        stages = partition(self.sch)
        try:
            check_stage_coverage(root, stages)
        except SchedulingError as e:
            held = {n for s in stages for n, _ in s.named_parameters(remove_duplicate=False)}
            left = [n for n, _ in root.named_parameters(remove_duplicate=False) if n not in held]
            owners = list(dict.fromkeys(n.rpartition(".")[0] for n in left))
            lines = [f"  {o or '<root>'}: in no pipeline stage (its parameters would never be "
                     "trained)" for o in owners[:6]]
            cut_list = "; ".join(f"{c}: cut_pipeline_stage()" for c in cuts)
            raise VerificationError("\n".join([f"pipeline stages do not hold the model: "
                                               f"{e.problem}", *lines,
                                               f"  primitives applied: {cut_list}"])) from e
        self._check_stages_run_the_forward(stages)

    def _check_stages_run_the_forward(self, stages: list[nn.Module]) -> None:
        """The stages, run in sequence on the example inputs, equal the model's own forward,
        and so do the gradients of every parameter (of the outputs' mean square).

        A stage re-implements what the model's `forward` does between its layers (masks,
        positions, biases, output scaling); that code is checked against the transformers
        version the tests ran, and this check repeats it on the user's model and transformers
        (fp32, eval mode: a structural check, independent of precision and dropout). Skipped
        for a meta model (no values; `build`'s stages run on materialised weights) and for
        inputs a pipeline refuses anyway (a padding mask a stage kind does not take)."""
        from ..runtime.partition import run_stages
        from ..runtime.pipeline_inputs import (
            check_batch_inputs,
            first_stage_args,
            stage_masks,
            stage_outputs,
        )

        if self._meta or not (self.inputs or self.kwargs):
            return
        model = self.sch.mod
        try:
            batch = dict(inspect.signature(model.forward).bind_partial(
                *self.inputs, **self.kwargs).arguments)
            masks = stage_masks(stages[0], batch)
            check_batch_inputs(stages[0], batch)
            args = first_stage_args(stages[0], batch)
        except (TypeError, SchedulingError):
            return  # inputs the stages cannot take: what `build` would refuse at the first step
        mode = model.training
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        try:
            model.eval()  # always: dropout would differ, BatchNorm would update its statistics
            want = self._run(model, amp=False)
            tracker = get_rng_tracker()
            states = tracker.get_states()
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                got = stage_outputs(stages[-1], run_stages(stages, *args, **masks))
            tracker.set_states(states)
            pairs = _stage_output_pairs(got, want)
            # gradients too: a stage that cut the graph (a detached bias or hand-off) computes
            # the same outputs but trains less; one structural loss, the outputs' mean square
            grads = [_grads(sum(t.float().pow(2).mean() for t in side), params)
                     for side in ([g for _, g, _ in pairs], [w for _, _, w in pairs])]
        finally:
            model.train(mode)
        named = [(name, g.detach(), w.detach()) for name, g, w in pairs]
        named += [(f"grad {n}", g, w) for (n, _), g, w in zip(params, *grads, strict=True)
                  if w is not None or g is not None]
        floor = max((_eps(w.dtype) * w.abs().max().item() for _, _, w in named[:len(pairs)]
                     if w.numel()), default=0.0)
        for name, g, w in named:
            if g is None or w is None:
                self._fail(name, f"the pipeline stages run in sequence do not train what the "
                           f"model does: {name} is {'missing' if g is None else 'extra'} "
                           "through the stages.")
                break
            err = (g.double() - w.double()).abs().max().item() if w.numel() else 0.0
            atol = max(self.rtol * w.abs().max().item() if w.numel() else 0.0, floor, 1e-30)
            self.report[f"pipeline stages {name}"] = err
            if g.shape != w.shape or g.dtype != w.dtype or \
                    not torch.allclose(g.double(), w.double(), rtol=self.rtol, atol=atol):
                self._fail(name, f"the pipeline stages run in sequence do not compute the "
                           f"model's forward and backward: {name} max abs error {err:.3e} "
                           f"(atol {atol:.3e}, dtype {g.dtype} for {w.dtype}). The stages re-implement "
                           f"{type(model).__name__}'s forward between its layers, and this "
                           "model or transformers version computes something they do not; "
                           "train it without pipeline stages, or report the model type and "
                           "version.")
                break
        failure = self._settle()
        if failure is not None:
            raise VerificationError(failure[1])


__all__ = ["PipelineChecks"]
