"""Verify points at the guilty module (issue 15, item 3), on 2 real gloo ranks.

1. Every planted bug of `tests/planted_bugs.py` is caught, the report names the planted module
   and the primitive (applied, or missing), both ranks report the same text, and the same
   schedule without the bug passes (the control). One process launch for all of them.
2. No false alarm: the ready schedules (`model_schedule.apply(tp=2)`) of the 8 HF families pass
   Verify, dropout 0.5 everywhere (so the RNG placement check has work to do). One launch.
3. Shape errors name the schedule: `name_shape_errors` after `slapo.build` turns a raw torch
   shape error into a `ScheduledShapeError` naming the path and the `shard`; a compiled block
   with the wrappers still compiles (fullgraph) and computes what it did.
"""

from __future__ import annotations

import pytest
import torch


def _named(kind: str, path: str | None, text: str) -> str:
    """The module a report names: a shape error's path, else the first indented report line's
    path (`  <path>: ...`)."""
    if kind == "ScheduledShapeError":
        return path or ""
    for line in text.splitlines()[1:]:
        if line.startswith("  ") and not line.strip().startswith("primitives applied"):
            return line.strip().split(":")[0]
    return ""


def job_planted_bugs() -> dict:
    """Each planted bug (and its control) under Verify: None when it passes, else (error type,
    path, message)."""
    from planted_bugs import BUGS

    import slapo

    out = {}
    for name, bug in BUGS.items():
        for planted in (False, True):
            model, schedule, batch = bug.make(planted)
            sch = slapo.create_schedule(model)
            try:
                with slapo.Verify(sch, example_kwargs=batch, loss_fn=lambda o: o.loss):
                    schedule(sch)
                out[(name, planted)] = None
            except (slapo.VerificationError, slapo.SchedulingError) as e:
                out[(name, planted)] = (type(e).__name__, getattr(e, "path", None), str(e))
    return out


@pytest.mark.dist
def test_every_planted_bug_is_caught_and_named(dist2):
    from planted_bugs import BUGS

    res = dist2.run(job_planted_bugs, timeout=300)
    assert res[0] == res[1], "the ranks disagree on the reports"
    table = []
    for name, bug in BUGS.items():
        assert res[0][(name, False)] is None, (name, res[0][(name, False)])
        caught = res[0][(name, True)]
        assert caught is not None, f"{name}: not caught"
        kind, path, text = caught
        expected = "ScheduledShapeError" if bug.kind == "shape" else "VerificationError"
        assert kind == expected, (name, kind, text)
        named = _named(kind, path, text)
        assert named.startswith(bug.module), (name, named, text)
        assert bug.primitive in text, (name, bug.primitive, text)
        table.append((name, named))
    assert len(table) == len(BUGS) == 8


def job_ready_schedules_pass() -> dict:
    """Verify (outputs, gradients, one step, RNG placement) of `model_schedule.apply(tp=2)` on
    every family with dropout 0.5 in every dropout site."""
    from test_silent_wrong import FAMILIES, _batch, dropout_model

    import slapo
    from slapo import model_schedule

    out = {}
    for family in FAMILIES:
        model = dropout_model(family, attn_implementation="eager")
        sch = slapo.create_schedule(model)
        with slapo.Verify(sch, example_kwargs=_batch(family), loss_fn=lambda o: o.loss) as v:
            model_schedule.apply(sch, tp=2)
        out[family] = len(v.report)
    return out


@pytest.mark.dist
def test_ready_schedules_of_every_family_pass(dist2):
    res = dist2.run(job_ready_schedules_pass, timeout=300)
    assert res[0] == res[1]
    assert len(res[0]) == 8 and all(n > 10 for n in res[0].values()), res[0]


def job_shape_error_after_build() -> dict:
    """The unsharded-bias bug, built with `slapo.build`: without the names a raw torch error,
    with `name_shape_errors` a ScheduledShapeError naming the path and the shard."""
    import planted_bugs

    import slapo
    from slapo.runtime.shape_errors import ScheduledShapeError, name_shape_errors

    model, schedule, batch = planted_bugs.BUGS["unsharded_bias"].make(True)
    sch = slapo.create_schedule(model)
    schedule(sch)
    tm, _ = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1})
    assert name_shape_errors(model, sch) == 0  # build already did it (and it is idempotent)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as e:
        tm.train_step(batch)
    for n, p in model.named_parameters():  # no step was taken
        assert torch.equal(p.detach(), before[n]), n
    return (type(e.value).__name__, isinstance(e.value, ScheduledShapeError),
            getattr(e.value, "path", None), str(e.value))


@pytest.mark.dist
def test_shape_errors_name_the_schedule_after_build(dist2):
    """`slapo.build` installs the naming: a shape error in training names the module."""
    res = dist2.run(job_shape_error_after_build)
    assert res[0] == res[1]
    named = res[0]
    assert named[1] and named[2] == "transformer.h.0.mlp.c_fc", named
    text = named[3]
    assert "shard(name_or_names='weight', axis=1)" in text, text
    assert "bias (256,) is whole" in text, text
    assert "Fix:" in text


def test_verify_restores_a_model_after_a_shape_error():
    """Verify's shape-error naming uses hooks only: after the error the model's classes, hooks
    and weights are as they were (one process: a shape error planted by a replace)."""
    import models

    import slapo
    from slapo.runtime.shape_errors import ScheduledShapeError

    model = models.gpt2(seed=0)
    sch = slapo.create_schedule(model)

    def bad_split(sch):
        sch["transformer.h.0.attn"].set_attr("head_dim", 12)  # 64 features: the view fails

    with pytest.raises(ScheduledShapeError) as e:
        with slapo.Verify(sch, [models.ids()], loss_fn=lambda o: o.logits.float().pow(2).mean()):
            bad_split(sch)
    assert e.value.path == "transformer.h.0.attn", str(e.value)
    assert "set_attr(" in str(e.value) and "head_dim" in str(e.value)
    classes = {type(m).__name__ for m in model.modules()}
    assert "GPT2Attention" in classes
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.compile
def test_compiled_block_with_shape_error_names_still_compiles():
    """A GPT-2 block whose Conv1Ds carry the wrappers compiles with fullgraph=True (no graph
    break) and computes what the eager block computes."""
    import models

    import slapo
    from slapo import module_patch
    from slapo.runtime.shape_errors import ShapeErrorWrapper, name_shape_errors

    model = models.gpt2(seed=0)
    sch = slapo.create_schedule(model)
    sch["transformer.h.0.mlp.c_fc"].shard("weight", axis=1)  # tp=1: shapes kept, history set
    assert name_shape_errors(model, sch) == 2  # c_fc and its parent mlp
    mlp = model.transformer.h[0].mlp
    assert any(isinstance(w, ShapeErrorWrapper) for w in module_patch.wrappers(mlp))
    x = torch.randn(2, 8, 64)
    expected = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), expected)
