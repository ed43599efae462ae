"""Simulated plans for GPT 1.3B-7B on 8-64 GPUs (H100 constants) and 7B on 8 x L4 (Mist's case).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/tune_simulate.py [out.json]
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict

from slapo.tune.simulate import DEVICES, GPT_MODELS, LayerModel, simulate


def main() -> None:
    results = []
    t0 = time.perf_counter()
    models = {name: LayerModel(spec) for name, spec in GPT_MODELS.items()}
    t_models = time.perf_counter() - t0
    cases = [("h100", name, n, 16 * n) for name in GPT_MODELS for n in (8, 16, 32, 64)]
    cases += [("l4", "gpt-7b", 8, 128), ("l4", "gpt-2.7b", 8, 128), ("l4", "gpt-1.3b", 8, 128)]
    t1 = time.perf_counter()
    for dev, name, gpus, gbs in cases:
        plans = simulate(GPT_MODELS[name], gpus, gbs, DEVICES[dev], models[name], top=1)
        if not plans:
            print(f"{dev:5s} {name} on {gpus}: no plan fits")
            continue
        print(f"{dev:5s} {plans[0].row()}")
        results.append({"device": dev, "global_batch": gbs, **asdict(plans[0])})
    print(f"block models {t_models:.1f} s, {len(cases)} plans {time.perf_counter() - t1:.1f} s")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
