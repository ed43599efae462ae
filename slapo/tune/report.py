"""The outputs of `slapo tune`: `results.json`, `top.txt` (the printed table) and
`search.png` (predicted vs measured per trial, and the measured throughput in trial order), and
the `slapo train` command of the best configuration."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from ..model_schedule import knobs as _schema
from ..runtime.precision import check_precision
from .driver import OBJECTIVE, TuneReport, status_counts
from .space import Config, config_key

__all__ = ["plot_search", "top_table", "train_command", "write_outputs"]


def _fmt_bytes(n: Any) -> str:
    return "-" if n is None else f"{float(n) / 2**20:,.0f} MiB"


def top_table(report: TuneReport, top: int = 10, title: str | None = None) -> Any:
    """A rich Table of the best configurations, with their predictions and the failures."""
    from rich.table import Table

    ok = report.ok_records()
    knobs = list(dict.fromkeys(k for r in report.records for k in r.config))
    t = Table(title=title or f"slapo tune: top {min(top, len(ok))} of {len(report.records)} "
              f"trials ({report.algorithm}, space of {report.space_size})")
    t.add_column("#", justify="right")
    for k in knobs:
        t.add_column(k)
    for col in ("tokens/s", "vs best", "peak mem", "pred tokens/s", "pred mem"):
        t.add_column(col, justify="right")
    best = float(ok[0].metrics[OBJECTIVE]) if ok else math.nan
    for i, r in enumerate(ok[:top]):
        p = report.predictions.get(config_key(r.config), r.predicted)
        thr = float(r.metrics[OBJECTIVE])
        t.add_row(str(i + 1), *[str(r.config.get(k, "-")) for k in knobs], f"{thr:,.0f}",
                  f"{thr / best:.2f}", _fmt_bytes(r.metrics.get("peak_memory_bytes")),
                  f"{p[OBJECTIVE]:,.0f}" if OBJECTIVE in p else "-", _fmt_bytes(p.get("memory")))
    bad = status_counts([r for r in report.records if not r.ok])
    if bad:
        t.caption = "not ok: " + ", ".join(f"{n} {s}" for s, n in sorted(bad.items()))
    return t


def plot_search(report: TuneReport, path: str | Path) -> Path:
    """PNG: predicted vs measured throughput per trial, and measured throughput in trial order.

    Failed trials sit at the bottom of both panels as red crosses, so a search that spent its
    budget on crashes is visible at a glance.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    order = list(range(len(report.records)))
    meas = [float(r.metrics[OBJECTIVE]) if r.ok else math.nan for r in report.records]
    pred = [float(report.predictions.get(config_key(r.config), r.predicted).get(OBJECTIVE, math.nan))
            for r in report.records]
    ok = [i for i in order if report.records[i].ok]
    failed = [i for i in order if not report.records[i].ok]
    floor = min([m for m in meas if m == m] or [1.0]) * 0.9
    if ok:
        sc = ax1.scatter([pred[i] for i in ok], [meas[i] for i in ok], c=ok, cmap="viridis")
        fig.colorbar(sc, ax=ax1, label="trial #")
    if failed:
        ax1.scatter([pred[i] for i in failed], [floor] * len(failed), marker="x", c="red",
                    label="failed / oom / timeout")
        ax1.legend(loc="lower right")
    ax1.set_xlabel("predicted tokens/s (cost model)")
    ax1.set_ylabel("measured tokens/s")
    ax1.set_title("predicted vs measured")
    best_so_far, cur = [], -math.inf
    for m in meas:
        cur = max(cur, m) if m == m else cur
        best_so_far.append(cur if cur > -math.inf else math.nan)
    ax2.plot(order, meas, "o", label="measured")
    ax2.step(order, best_so_far, where="post", label="best so far")
    if failed:
        ax2.plot(failed, [floor] * len(failed), "x", color="red", label="not ok")
    ax2.set_xlabel("trial #")
    ax2.set_ylabel("tokens/s")
    ax2.set_title(f"{report.algorithm}: {len(report.records)} of {report.space_size} configs")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _flag(name: str, value: Any) -> list[str]:
    """A `slapo train` option as command-line words (bools as --name / --no-name)."""
    dashed = name.replace("_", "-")
    if isinstance(value, bool):
        return [f"--{dashed}" if value else f"--no-{dashed}"]
    return [f"--{dashed}", str(value)]


def train_command(config: Config, options: dict[str, Any] | None = None) -> str:
    """The `slapo train` command that trains with `config`: its schedule knobs under their
    schema names (the same flags, one meaning), its batch size and precision, and the run
    `options` the trials used (model, sizes, sequence length, fuse compiler)."""
    knob_names = set(_schema.names())
    words = ["slapo", "train"]
    for name, value in (options or {}).items():
        if value is not None and name not in config:
            words += _flag(name, value)
    for name, value in config.items():
        if name == "mixed_precision":
            words += _flag("precision", check_precision(value))  # None: an old record's fp32
        elif name == "batch_size" or name in knob_names:
            words += _flag(name, value)
    return " ".join(words)


def write_outputs(report: TuneReport, out: str | Path, top: int = 10,
                  meta: dict[str, Any] | None = None, console: Any = None) -> dict[str, Path]:
    """results.json, top.txt and search.png under `out`; prints the table and the `slapo
    train` command of the best config (`meta["train_options"]`: the trials' run options)
    to `console`."""
    from rich.console import Console

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    options = meta.pop("train_options", None)
    data = {**meta, **report.to_json(top)}
    if report.best is not None:
        data["train_command"] = train_command(report.best.config, options)
    paths = {"json": out / "results.json", "table": out / "top.txt", "plot": out / "search.png"}
    paths["json"].write_text(json.dumps(data, indent=1, sort_keys=True, default=str))
    table = top_table(report, top)
    text = Console(record=True, width=160, file=io.StringIO())
    text.print(table)
    paths["table"].write_text(text.export_text())
    (console or Console()).print(table)
    if "train_command" in data:
        (console or Console()).print(f"best config as a training run: {data['train_command']}",
                                     markup=False, soft_wrap=True)
    try:
        plot_search(report, paths["plot"])
    except ImportError:  # matplotlib is the optional `plot` extra; the rest is still useful
        (console or Console()).print("matplotlib is not installed: no search.png "
                                     "(pip install 'slapo[plot]').", markup=False)
        del paths["plot"]
    return paths


