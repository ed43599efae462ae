import random

import pytest

from slapo.tune.memory import stage_peak_bytes
from slapo.tune.planner import (
    StageOption,
    brute_force_pipeline,
    pareto_front,
    plan_pipeline,
)


def random_cost(rng, num_stages):
    """Random but structured stage costs: per-stage speed, recompute cost, 1F1B memory."""
    speed = [rng.uniform(0.7, 1.3) for _ in range(num_stages)]
    t_layer, t_recompute = rng.uniform(1, 3), rng.uniform(0.2, 1.2)
    saved, inp, states = rng.uniform(5, 20), rng.uniform(0.5, 2), rng.uniform(1, 5)
    g = rng.randint(1, 8)
    extra_first, extra_last = rng.uniform(0, 3), rng.uniform(0, 3)

    def cost(i, j, c):
        t = speed[i] * (j * t_layer + c * t_recompute) + (extra_first if i == 0 else 0) + (
            extra_last if i == num_stages - 1 else 0)
        m = stage_peak_bytes(states=states * j, layers=j, ckpt_layers=c, saved_per_layer=saved,
                             input_per_layer=inp, stage=i, pp=num_stages, num_microbatches=g)
        return t, float(m)

    return cost, g


@pytest.mark.parametrize("objective", ["1f1b", "max"])
def test_milp_equals_brute_force_on_random_instances(objective):
    rng = random.Random(7)
    checked = feasible = 0
    for _ in range(25):
        s = rng.randint(1, 3)
        layers = rng.randint(s, 8)
        cost, g = random_cost(rng, s)
        cap = rng.uniform(20, 140)
        ref = brute_force_pipeline(cost, layers, s, g, cap, objective)
        got = plan_pipeline(cost, layers, s, g, cap, objective)
        checked += 1
        if ref is None:
            assert got is None
            continue
        feasible += 1
        assert got.objective == pytest.approx(ref.objective, rel=1e-9)
        assert sum(got.layers) == layers and all(0 <= c <= j for c, j in zip(got.ckpt, got.layers))
        assert all(m <= cap for m in got.stage_memory)  # no plan exceeds the cap by prediction
        t, _ = zip(*(cost(i, j, c) for i, (j, c) in enumerate(zip(got.layers, got.ckpt))))
        assert got.stage_time == pytest.approx(list(t))
    assert checked == 25 and feasible >= 20


def test_memory_pressure_makes_early_stages_checkpoint_more():
    def cost(i, j, c):
        m = stage_peak_bytes(states=1.0 * j, layers=j, ckpt_layers=c, saved_per_layer=10,
                             input_per_layer=1, stage=i, pp=4, num_microbatches=16)
        return j * 1.0 + c * 0.33, float(m)

    plan = plan_pipeline(cost, 24, 4, 16, mem_cap=150.0)
    assert plan is not None and sum(plan.layers) == 24
    assert plan.ckpt[0] >= plan.ckpt[-1] and plan.ckpt[0] > 0
    assert plan.to_config() == {"layers_per_stage": plan.layers, "ckpt_layers_per_stage": plan.ckpt}
    assert plan_pipeline(cost, 24, 4, 16, mem_cap=1.0) is None  # nothing fits


def test_large_instance_solves_fast():
    rng = random.Random(3)
    cost, g = random_cost(rng, 8)
    plan = plan_pipeline(cost, 48, 8, 32, mem_cap=400.0)
    assert plan is not None and sum(plan.layers) == 48
    print(f"\n8 stages x 48 layers: {plan.num_options} options, solved in {plan.solve_s:.2f} s")
    assert plan.solve_s < 5.0
    # the MILP beats a uniform split with the best feasible ckpt count per stage
    uniform = [6] * 8
    times = []
    for i, j in enumerate(uniform):
        ok = [cost(i, j, c)[0] for c in range(j + 1) if cost(i, j, c)[1] <= 400.0]
        times.append(min(ok))
    assert plan.objective <= (31 * max(times) + sum(times)) + 1e-9


def test_pareto_front_and_errors():
    opts = [StageOption(2, c, t, m) for c, t, m in [(0, 1.0, 9.0), (1, 1.5, 5.0), (2, 2.0, 6.0), (3, 3.0, 1.0)]]
    assert [o.ckpt for o in pareto_front(opts)] == [0, 1, 3]
    with pytest.raises(ValueError, match="num_stages"):
        plan_pipeline(lambda i, j, c: (1.0, 1.0), 2, 3, 1, 10.0)
    with pytest.raises(ValueError, match="objective"):
        plan_pipeline(lambda i, j, c: (1.0, 1.0), 4, 2, 1, 10.0, objective="min")
    with pytest.raises(ValueError, match="entries"):
        plan_pipeline(lambda i, j, c: (1.0, 1.0), 4, 2, 1, [10.0])
