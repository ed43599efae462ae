"""Streaming metrics of a `slapo train` run: a record per step and per evaluation, as they happen.

A mixture of experts' step record also holds its router's numbers (`moe_metrics`): `aux_loss`
and `load_imbalance` (every sink), `tokens_per_expert` ([layer][expert]: metrics.jsonl only,
the CSV and the scalar loggers take numbers).

Sinks (rank 0 only; the loss is already the same on every rank):
- `OUT/metrics.jsonl` and `OUT/metrics.csv`, always when `--out` is given: appended and flushed
  each record, so `tail -f` and a crashed run's partial log both work;
- TensorBoard (`--tensorboard`: `OUT/tensorboard/`), via `torch.utils.tensorboard`;
- Weights & Biases (`--wandb PROJECT`); `WANDB_MODE=offline` works as usual.
TensorBoard and W&B are imported only when asked for; asked for and not installed, the run
stops before the first step with the install command (never a silent run without the log).

Resume keeps one record per step: records after the checkpoint's step (steps a killed run took
past its last checkpoint, which the resumed run takes again) are dropped from the JSONL/CSV
files before appending, and TensorBoard purges them (`purge_step`).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "MetricsLog", "check_sinks"]

FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "peak_memory_mib",
          "skipped_steps", "val_loss", "val_ppl", "aux_loss", "load_imbalance")
JSONL, CSV, TB_DIR = "metrics.jsonl", "metrics.csv", "tensorboard"


def check_sinks(tensorboard: bool, wandb: str | None) -> None:
    """Raise ValueError naming the flag when an asked-for logger does not import."""
    if tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--tensorboard: TensorBoard does not import here ({e}). Fix: "
                             "`pip install tensorboard` (or `pip install slapo[log]`).") from None
    if wandb:
        try:
            import wandb as _  # noqa: F401
        except ImportError as e:
            raise ValueError(f"--wandb: Weights & Biases does not import here ({e}). Fix: "
                             "`pip install wandb`, or leave --wandb out.") from None


def perplexity(loss: float | None) -> float | None:
    if loss is None:
        return None
    return math.exp(loss) if loss < 80 else float("inf")


def _keep_until(path: Path, step: int, parse) -> None:
    """Drop the records after `step` (a resumed run takes those steps again)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for i, line in enumerate(lines) if parse(i, line) <= step]
    if len(kept) != len(lines):
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)


def _jsonl_step(_: int, line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0  # keep what we cannot read rather than lose it


def _csv_step(i: int, line: str) -> int:
    if i == 0:
        return 0  # the header
    head = line.split(",", 1)[0]
    return int(head) if head.isdigit() else 0


class MetricsLog:
    """One record per call of `log(step, **values)`, to every configured sink."""

    def __init__(self, out: str | Path | None, *, enabled: bool = True,
                 tensorboard: bool = False, wandb: str | None = None,
                 config: dict[str, Any] | None = None, resumed_from: int | None = None):
        self.enabled = enabled and out is not None
        self._files: list = []
        self._tb = self._wandb = None
        if not self.enabled:
            return
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        start = resumed_from or 0
        if resumed_from is not None:
            _keep_until(out / JSONL, start, _jsonl_step)
            _keep_until(out / CSV, start, _csv_step)
        elif (out / JSONL).exists():  # a fresh run in an old --out: start the log afresh
            (out / JSONL).unlink()
            (out / CSV).unlink(missing_ok=True)
        self._jsonl = open(out / JSONL, "a", encoding="utf-8")  # noqa: SIM115 (closed in close)
        new_csv = not (out / CSV).exists()
        self._csv_file = open(out / CSV, "a", newline="", encoding="utf-8")  # noqa: SIM115
        self._csv = csv.DictWriter(self._csv_file, fieldnames=FIELDS, extrasaction="ignore")
        if new_csv:
            self._csv.writeheader()
        self._files = [self._jsonl, self._csv_file]
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out / TB_DIR), purge_step=start + 1 if start else None)
        if wandb:
            import wandb as wb

            self._wandb = wb.init(project=wandb, dir=str(out), config=config or {},
                                  resume="allow")

    def log(self, step: int, **values: Any) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: v for k, v in values.items() if v is not None}}
        if "val_loss" in record:
            record["val_ppl"] = perplexity(record["val_loss"])
        self._jsonl.write(json.dumps(record) + "\n")
        self._csv.writerow(record)
        for f in self._files:
            f.flush()
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and math.isfinite(v)}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(("val/" if k.startswith("val_") else "train/") + k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        for f in self._files:
            f.close()
        self._files = []
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self.enabled = False
