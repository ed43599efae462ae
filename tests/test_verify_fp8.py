"""`Verify(precision="fp8")`: both models' GEMMs in FP8 (torchao, emulated on CPU), the
tolerance from the model itself as for bf16 (slapo/verify/core.py's module docstring): the
scheduled model passes within `mp_tolerance` (4) times the original's own FP8-vs-fp32 error
at every output, gradient and stepped parameter. Measured (tp=2, tiny LLaMA and GPT-2,
tensorwise and rowwise, seeds 0-3): the worst gradient or parameter of a correct schedule at
2.9x that error, the row-parallel all-reduce dropped at >= 24x."""

from __future__ import annotations

import models
import pytest
import torch

import slapo
from slapo import module_patch
from slapo.errors import SchedulingError, VerificationError
from slapo.runtime.fp8 import Float8Config

pytest.importorskip("torchao.float8")

SMALL = Float8Config(min_dim=16)  # the tiny models' GEMMs all qualify


def _batch():
    return {"input_ids": models.ids(batch=4, seq=16), "labels": models.ids(batch=4, seq=16, seed=2)}


def _worst(v) -> float:
    """The largest error over the original's own fp8-vs-fp32 error, outside the loss."""
    return max(v.report[n] / max(v.baseline[n], 1e-30) for n in v.report
               if n in v.baseline and "loss" not in n)


def _gemms(model) -> int:
    return sum("gemm" in module_patch.module_meta(m) for m in model.modules())


def job_verify_fp8(family: str, recipe: str, mutate: bool):
    """tp=2: (passed, worst ratio or the error's first line, FP8 GEMMs left on the model)."""
    import slapo.runtime
    from slapo.distributed import collectives

    torch.set_num_threads(1)
    mesh = slapo.runtime.init_mesh(tp=2)
    model = getattr(models, family)(seed=0)
    sch = slapo.create_schedule(model, mesh=mesh)
    reduce = collectives.reduce_forward
    try:
        with slapo.Verify(sch, example_kwargs=_batch(), loss_fn=lambda o, *a: o.loss,
                          precision="fp8", fp8=Float8Config(min_dim=16, recipe=recipe),
                          localise=False) as v:
            slapo.model_schedule.apply(sch)
            if mutate:  # the row-parallel all-reduce dropped
                collectives.reduce_forward = lambda y, group=None: y
        result = (True, _worst(v))
    except VerificationError as e:
        result = (False, str(e).splitlines()[0])
    finally:
        collectives.reduce_forward = reduce
    return (*result, _gemms(model))


@pytest.mark.dist
def test_verify_fp8_passes_tp2_and_fails_a_missing_all_reduce(dist2):
    for family in ("llama", "gpt2"):
        for recipe in ("tensorwise", "rowwise"):
            for passed, worst, left in dist2.run(job_verify_fp8, family, recipe, False):
                assert passed and worst < 4 and left == 0, (family, recipe, worst)
        for passed, message, left in dist2.run(job_verify_fp8, family, "tensorwise", True):
            assert not passed and "under fp8" in message and left == 0, (family, message)


def test_verify_fp8_one_process_and_its_model_left_as_it_was(one_thread):
    """A schedule that changes nothing is the original exactly (same FP8 GEMMs, same scales);
    afterwards the user's model has no FP8 GEMM and trains as before."""
    model = models.llama(seed=0)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=_batch(), loss_fn=lambda o, *a: o.loss,
                      precision="fp8", fp8=SMALL) as v:
        pass
    assert max(v.report.values()) == 0.0 and _gemms(model) == 0
    assert all(v.baseline[n] > 0 for n in v.baseline if "grad" in n and "norm" not in n)


def test_verify_fp8_bad_input_is_refused():
    sch = slapo.create_schedule(models.llama(seed=0))
    with pytest.raises(SchedulingError, match="fp8=.*precision='bf16'"):
        slapo.Verify(sch, example_inputs=[models.ids()], precision="bf16", fp8=SMALL)
    with pytest.raises(SchedulingError, match="not a Float8Config"):
        slapo.Verify(sch, example_inputs=[models.ids()], precision="fp8", fp8="rowwise")
