"""The GPU cost model of `slapo tune` against the H100 measurements, on CPU.

    python benchmarks/tune_gpu_check.py [--results benchmarks/results/gpu_train_h100.jsonl]
                                        [--out runs/tune_gpu_check.json] [--models llama-1b]

For every `status: ok` row of the benchmark's results it predicts peak memory and step time of
that (model, knobs, batch, seq) with `slapo.tune.predict_gpu.GPUCostModel` (a fake-tensor step:
nothing is materialised) and prints predicted vs measured. Step time needs one constant per
model family (`efficiency`): it is calibrated on that family's *calibration row* (the last
`slapo_gpu` row without a memory cap) and every other row is validation. Memory has no fitted
constant. Rows whose variant is not a knob set of `model_schedule.apply` (whole-model
`torch.compile`, Liger-Kernel) are listed as not modelled.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

MEM_TARGET, TIME_TARGET = 0.05, 0.15
CALIBRATION_VARIANT = "slapo_gpu"


def row_config(row: dict) -> tuple[dict, bool] | None:
    """(config, schedule) of a measured row, or None when the variant is not a knob set."""
    from gpu_train import SLAPO_KNOBS

    base = {"batch_size": int(row["batch"]), "mixed_precision": "bf16"}
    if row["variant"] == "hf_sdpa":
        return base, False
    if row["variant"] in SLAPO_KNOBS:
        return {**base, **SLAPO_KNOBS[row["variant"]]}, True
    return None


def load_rows(path: str | Path) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("status") == "ok"]


def calibration_rows(rows: list[dict]) -> dict[str, int]:
    """{model: index of its calibration row}: the last uncapped `slapo_gpu` row."""
    out = {}
    for i, r in enumerate(rows):
        if r["variant"] == CALIBRATION_VARIANT and not r.get("cap_gib"):
            out[r["model"]] = i
    return out


def check(rows: list[dict], predictor_for) -> list[dict]:
    """Predicted vs measured per row. `predictor_for(model)` gives a GPUCostModel."""
    cal = calibration_rows(rows)
    models, failed = {}, {}
    for name, i in cal.items():
        m = predictor_for(name)
        cfg, sched = row_config(rows[i])
        try:
            m.calibrate(cfg, rows[i]["step_ms"] / 1e3, schedule=sched)
            models[name] = m
        except Exception as e:  # noqa: BLE001 - reported on every row of the family
            failed[name] = f"failed (calibration row): {type(e).__name__}: {str(e)[:100]}"
    out = []
    for i, r in enumerate(rows):
        res = {"model": r["model"], "variant": r["variant"], "batch": r["batch"],
               "cap_gib": r.get("cap_gib") or 0, "measured_gib": r.get("peak_gib"),
               "measured_ms": r["step_ms"], "role": "calibration" if cal.get(r["model"]) == i
               else "validation"}
        mapped = row_config(r)
        if r["model"] in failed:
            out.append({**res, "status": failed[r["model"]]})
            continue
        if mapped is None or r["model"] not in models:
            out.append({**res, "status": "not modelled"})
            continue
        try:
            p = models[r["model"]].predict(mapped[0], schedule=mapped[1])
        except Exception as e:  # noqa: BLE001 - reported per row, the others still run
            out.append({**res, "status": f"failed: {type(e).__name__}: {str(e)[:120]}"})
            continue
        res.update(predicted_gib=p["memory"] / 2**30, predicted_ms=1e3 * p["step_time_s"],
                   efficiency=models[r["model"]].efficiency, status="ok")
        res["mem_err"] = res["predicted_gib"] / res["measured_gib"] - 1
        res["time_err"] = res["predicted_ms"] / res["measured_ms"] - 1
        res["mem_ok"] = abs(res["mem_err"]) <= MEM_TARGET
        res["time_ok"] = abs(res["time_err"]) <= TIME_TARGET
        out.append(res)
    return out


def table(results: list[dict]) -> str:
    lines = [f"{'model':12s} {'variant':15s} {'b':>3s} {'cap':>4s} {'role':11s} "
             f"{'meas GiB':>8s} {'pred GiB':>8s} {'err':>7s} {'meas ms':>8s} {'pred ms':>8s} "
             f"{'err':>7s}"]
    for r in results:
        head = (f"{r['model']:12s} {r['variant']:15s} {r['batch']:>3d} {r['cap_gib']:>4.0f} "
                f"{r['role']:11s} ")
        if r["status"] != "ok":
            lines.append(head + r["status"])
            continue
        mark = lambda ok: " " if ok else "!"  # noqa: E731
        lines.append(head + f"{r['measured_gib']:8.2f} {r['predicted_gib']:8.2f} "
                     f"{100 * r['mem_err']:+6.1f}%{mark(r['mem_ok'])}"
                     f"{r['measured_ms']:8.1f} {r['predicted_ms']:8.1f} "
                     f"{100 * r['time_err']:+6.1f}%{mark(r['time_ok'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from slapo.tune.model_spaces import GPU_MODELS
    from slapo.tune.predict_gpu import GPUCostModel

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", default=str(HERE / "results" / "gpu_train_h100.jsonl"))
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--models", default=None, help="comma-separated subset of models")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    rows = load_rows(args.results)
    if args.models:
        rows = [r for r in rows if r["model"] in args.models.split(",")]
    results = check(rows, lambda name: GPUCostModel(GPU_MODELS[name]))
    print(table(results))
    ok = [r for r in results if r["status"] == "ok" and r["role"] == "validation"]
    print(f"validation rows: memory within 5%: {sum(r['mem_ok'] for r in ok)}/{len(ok)}; "
          f"step time within 15%: {sum(r['time_ok'] for r in ok)}/{len(ok)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
