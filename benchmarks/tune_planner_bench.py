"""MILP planner solve times and MILP-vs-brute-force agreement; guided-search trial fractions.

    OMP_NUM_THREADS=1 python benchmarks/tune_planner_bench.py
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_tune_planner import random_cost  # noqa: E402
from test_tune_search import CAP, measure, synthetic_space, true_memory  # noqa: E402

from slapo.tune.planner import brute_force_pipeline, plan_pipeline  # noqa: E402
from slapo.tune.search import exhaustive, guided_search  # noqa: E402


def milp_times() -> None:
    rng = random.Random(0)
    for s, layers in ((2, 12), (4, 24), (8, 48), (16, 96)):
        times, opts = [], []
        for _ in range(5):
            cost, _ = random_cost(rng, s)
            plan = plan_pipeline(cost, layers, s, 32, mem_cap=1e9)
            times.append(plan.solve_s)
            opts.append(plan.num_options)
        print(f"S={s:2d} L={layers:3d}: {max(opts):5d} options, solve {min(times):.2f}-{max(times):.2f} s")
    agree = total = 0
    for _ in range(100):
        s = rng.randint(1, 3)
        layers = rng.randint(s, 8)
        cost, g = random_cost(rng, s)
        cap = rng.uniform(20, 140)
        ref, got = brute_force_pipeline(cost, layers, s, g, cap), plan_pipeline(cost, layers, s, g, cap)
        total += 1
        agree += (ref is None and got is None) or (
            ref is not None and got is not None and abs(ref.objective - got.objective) <= 1e-9 * ref.objective)
    print(f"MILP == brute force on {agree}/{total} random small instances")


def guided_fractions() -> None:
    space = synthetic_space()
    best = exhaustive(space, measure).best.metrics["throughput"]
    rng = random.Random(1)
    fracs, quals = [], []
    for _ in range(50):
        rc, fu, te = rng.uniform(0, 0.8), rng.uniform(0.7, 1.0), rng.uniform(0.9, 1.05)
        sat, mb = rng.uniform(3, 20), rng.uniform(0.85, 1.05)

        def pred(c, rc=rc, fu=fu, te=te, sat=sat, mb=mb):
            bs, r = c["batch_size"], c.get("ckpt_ratio", 0.0)
            t = 0.015 + 0.01 * (bs + sat) * (1 + rc * r) * (fu if c["fuse"] else 1) * (te if c["tempo"] else 1)
            return {"throughput": bs / t, "memory": mb * true_memory(c)}

        g = guided_search(space, measure, pred, mem_cap=CAP)
        fracs.append(g.new_trials / g.num_configs)
        quals.append(g.best.metrics["throughput"] / best)
    fracs.sort()
    print(f"guided search over 50 biased models: trials {min(fracs):.1%}-{max(fracs):.1%} "
          f"(median {fracs[25]:.1%}) of {len(space)}; found {min(quals):.1%}-{max(quals):.1%} of optimum")


if __name__ == "__main__":
    milp_times()
    guided_fractions()
