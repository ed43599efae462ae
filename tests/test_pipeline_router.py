"""A mixture of experts' load-balancing loss through pipeline stages (`runtime/stage_router.py`).

HF's MoE causal LMs add `router_aux_loss_coef * load_balancing_loss_func(...)` to their loss
when `output_router_logits` is set; the function mixes every layer's routing, so the stages
carry its sums to the last one. Proven like the declared-plan sweep (pp=2 on 2 gloo ranks, 1F1B,
2 micro-batches, float64, against one process: losses, every gradient, parameters after 2
AdamW steps, rel 1e-5), with the aux coefficient raised to 0.5 so the aux loss's share of every
router gradient is far above the tolerance, and on a left-padded batch (the mask weighs the
statistics). By default a sample; `SLAPO_SWEEP=all` runs every model type whose `Between` row
says `router=True`. ep=2 x pp=2 with the aux loss: tests/test_moe.py.
"""

from __future__ import annotations

import pytest
import sweep
import test_pipeline_declared as declared
import torch

from slapo.runtime import stages_declared

ROUTED = {"output_router_logits": True, "router_aux_loss_coef": 0.5}
SAMPLE = ("mixtral", "qwen3_moe", "gpt_oss")  # window masks, layer types, biased experts


def _archs() -> list[tuple[str, str]]:
    import hf_tiny

    every = [a for a in hf_tiny.decoders("base_model_pp_plan")
             if getattr(stages_declared.BETWEEN.get(a[0]), "router", False)]
    return sweep.sample(every, [a for a in every if a[0] in SAMPLE])


@pytest.mark.dist
@pytest.mark.timeout(1800)
def test_router_loss_through_pp2_equals_one_process(dist2):
    archs = _archs()
    for padded in (False, True):
        per_rank = dist2.run(declared.job_pp_sweep, archs, 1, padded, ROUTED, timeout=1500)
        results = {k: v for k, (v, _) in per_rank[0].items()}
        print("\n" + declared.table(results))
        assert {k: v for k, (v, _) in per_rank[1].items()} == results
        bad = {k: v for k, v in results.items() if v != "equivalent"}
        assert not bad, (padded, bad)
    assert {a[0] for a in archs} >= set(SAMPLE)


def job_mutation(kind: str) -> str:
    """Mixtral with a broken `stage_stats`: the statistics received from the stage before
    dropped, or the mask ignored."""
    import slapo.runtime.stage_router as sr
    import slapo.runtime.stages_decoder as sd

    honest = sr.stage_stats

    def broken(aux, logits, mask, carried, device):
        if kind == "drop_carried":
            return honest(aux, logits, mask, (), device)
        return honest(aux, logits, None, carried, device)

    sd.stage_stats = broken
    try:
        return declared.job_pp_sweep([("mixtral", "MixtralForCausalLM")], 1, True,
                                     ROUTED)["mixtral"][0]
    finally:
        sd.stage_stats = honest


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["drop_carried", "ignore_mask"])
def test_a_stage_that_loses_router_statistics_fails(dist2, kind):
    results = dist2.run(job_mutation, kind)
    assert all(r.startswith("MISMATCH") for r in results), results


def test_a_router_model_without_what_the_stages_read_is_refused_unchanged():
    """A model that sets `output_router_logits` but records no router logits (its class's
    `_can_record_outputs` lacks them): a SchedulingError before any change."""
    import slapo
    from slapo import model_schedule

    model = declared._tiny("mixtral", output_router_logits=True)
    model._can_record_outputs = {}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match="does not record router logits"):
        model_schedule.apply(sch, pp_stages=2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
