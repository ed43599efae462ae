"""Pipeline planner: per-stage Pareto options + a MILP over the stage partition (after Mist).

Decisions: how many (contiguous) layers each pipeline stage gets and how many of them are
activation-checkpointed. A stage's time and peak memory depend on its index (under 1F1B stage i
holds min(S - i, G) micro-batches, so early stages need more checkpointing), its layer count and
its checkpointed-layer count, through a user-given `stage_cost(i, layers, ckpt) -> (time, mem)`.

1. For each (stage, layers) the checkpoint counts that fit the stage's memory cap are reduced to
   their Pareto front in (time, memory): no option kept is both slower and bigger than another.
2. A MILP picks exactly one option per stage so that the layer counts sum to L, minimising the
   1F1B step time `(G - 1) * max_i T_i + sum_i T_i` (steady state + fill/drain, as in Mist) or
   the simpler `(G + S - 1) * max_i T_i`; `max` is linearised with `Tmax >= T_i`. Solved by
   HiGHS through `scipy.optimize.milp`.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

StageCost = Callable[[int, int, int], tuple[float, float]]


@dataclass
class StageOption:
    layers: int
    ckpt: int
    time: float
    memory: float


@dataclass
class PipelinePlan:
    """A concrete schedule: layers and checkpointed layers per stage, with predicted costs."""

    layers: list[int]
    ckpt: list[int]
    stage_time: list[float]
    stage_memory: list[float]
    objective: float
    solve_s: float = 0.0
    num_options: int = 0
    extra: dict = field(default_factory=dict)

    def to_config(self) -> dict:
        return {"layers_per_stage": list(self.layers), "ckpt_layers_per_stage": list(self.ckpt)}


def pareto_front(options: Sequence[StageOption]) -> list[StageOption]:
    """Options not dominated in (time, memory), fastest first."""
    front: list[StageOption] = []
    for o in sorted(options, key=lambda o: (o.time, o.memory)):
        if not front or o.memory < front[-1].memory:
            front.append(o)
    return front


def _caps(mem_cap: float | Sequence[float], num_stages: int) -> list[float]:
    caps = [float(mem_cap)] * num_stages if np.isscalar(mem_cap) else [float(c) for c in mem_cap]
    if len(caps) != num_stages:
        raise ValueError(f"mem_cap has {len(caps)} entries for {num_stages} stages.")
    return caps


def _objective(times: Sequence[float], g: int, objective: str) -> float:
    s = len(times)
    if objective == "1f1b":
        return (g - 1) * max(times) + sum(times)
    return (g + s - 1) * max(times)


def stage_options(stage_cost: StageCost, num_layers: int, num_stages: int,
                  mem_cap: float | Sequence[float], layer_range: tuple[int, int] | None = None,
                  max_options: int | None = None) -> dict[tuple[int, int], list[StageOption]]:
    """Pareto options per (stage, layer count), memory-feasible only.

    `layer_range` limits a stage's layer count (Mist uses round(L/S) ± 2 to shrink the MILP);
    `max_options` keeps at most that many evenly spaced front points (always the fastest).
    """
    caps = _caps(mem_cap, num_stages)
    lo, hi = layer_range or (1, num_layers - num_stages + 1)
    lo, hi = max(lo, 1), min(hi, num_layers - num_stages + 1)
    out: dict[tuple[int, int], list[StageOption]] = {}
    for i in range(num_stages):
        for j in range(lo, hi + 1):
            opts = []
            for c in range(j + 1):
                t, m = stage_cost(i, j, c)
                if m <= caps[i] and math.isfinite(t):
                    opts.append(StageOption(j, c, float(t), float(m)))
            front = pareto_front(opts)
            if max_options and len(front) > max_options:
                keep = np.unique(np.linspace(0, len(front) - 1, max_options).round().astype(int))
                front = [front[k] for k in keep]
            if front:
                out[(i, j)] = front
    return out


def plan_pipeline(stage_cost: StageCost, num_layers: int, num_stages: int, num_microbatches: int,
                  mem_cap: float | Sequence[float], objective: str = "1f1b",
                  layer_range: tuple[int, int] | None = None, max_options: int | None = None,
                  time_limit_s: float = 60.0) -> PipelinePlan | None:
    """Optimal stage partition and checkpoint counts; None if nothing fits in memory."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    if objective not in ("1f1b", "max"):
        raise ValueError(f"objective must be '1f1b' or 'max', got {objective!r}.")
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"need 1 <= num_stages ({num_stages}) <= num_layers ({num_layers}).")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}.")
    t0 = time.perf_counter()
    opts = stage_options(stage_cost, num_layers, num_stages, mem_cap, layer_range, max_options)
    var: list[tuple[int, StageOption]] = [(i, o) for (i, _), front in sorted(opts.items()) for o in front]
    if any(not any(v[0] == i for v in var) for i in range(num_stages)):
        return None
    n = len(var) + 1  # binaries + Tmax
    g, s = num_microbatches, num_stages
    c = np.zeros(n)
    if objective == "1f1b":
        c[:-1] = [o.time for _, o in var]
        c[-1] = g - 1
    else:
        c[-1] = g + s - 1
    A = lil_matrix((2 * s + 1, n))
    lb, ub = np.zeros(2 * s + 1), np.zeros(2 * s + 1)
    for k, (i, o) in enumerate(var):
        A[i, k] = 1.0  # one option per stage
        A[s, k] = o.layers  # layers sum to L
        A[s + 1 + i, k] = -o.time  # Tmax - T_i >= 0
    for i in range(s):
        lb[i] = ub[i] = 1.0
        A[s + 1 + i, n - 1] = 1.0
        lb[s + 1 + i], ub[s + 1 + i] = 0.0, np.inf
    lb[s] = ub[s] = num_layers
    integrality = np.ones(n)
    integrality[-1] = 0
    res = milp(c, integrality=integrality, bounds=Bounds(np.zeros(n), np.r_[np.ones(n - 1), np.inf]),
               constraints=LinearConstraint(A.tocsr(), lb, ub),
               options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9})
    solve_s = time.perf_counter() - t0
    if res.x is None:
        return None
    chosen: list[StageOption | None] = [None] * s
    for k, (i, o) in enumerate(var):
        if res.x[k] > 0.5:
            chosen[i] = o
    assert all(o is not None for o in chosen)
    times = [o.time for o in chosen]  # type: ignore[union-attr]
    return PipelinePlan([o.layers for o in chosen], [o.ckpt for o in chosen], times,  # type: ignore[union-attr]
                        [o.memory for o in chosen], _objective(times, g, objective), solve_s,  # type: ignore[union-attr]
                        len(var), {"status": res.message})


def brute_force_pipeline(stage_cost: StageCost, num_layers: int, num_stages: int,
                         num_microbatches: int, mem_cap: float | Sequence[float],
                         objective: str = "1f1b") -> PipelinePlan | None:
    """Reference solver: every composition of L into S parts × every checkpoint count."""
    caps = _caps(mem_cap, num_stages)
    best: PipelinePlan | None = None
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        layers = [b - a for a, b in zip((0, *cuts), (*cuts, num_layers))]
        per_stage = []
        for i, j in enumerate(layers):
            per_stage.append([(c, *stage_cost(i, j, c)) for c in range(j + 1)
                              if stage_cost(i, j, c)[1] <= caps[i]])
        if any(not p for p in per_stage):
            continue
        for combo in itertools.product(*per_stage):
            times = [t for _, t, _ in combo]
            obj = _objective(times, num_microbatches, objective)
            if best is None or obj < best.objective - 1e-12:
                best = PipelinePlan(layers, [c for c, _, _ in combo], times, [m for _, _, m in combo], obj)
    return best
