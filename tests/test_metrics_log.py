"""The streaming metrics log: JSONL/CSV records as they happen, TensorBoard events, one record
per step across a resume, and a clear error when an asked-for logger is missing."""

from __future__ import annotations

import builtins
import csv
import json
import math

import pytest

from slapo.train.metrics_log import MetricsLog, check_sinks


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_records_stream_and_resume_keeps_one_record_per_step(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in range(1, 6):
        log.log(step, loss=5.0 - step / 10, lr=1e-3)
        # flushed per record: a reader (or a crash) sees every step logged so far
        assert _steps(tmp_path / "metrics.jsonl")[-1] == step
    log.log(4, val_loss=4.5)
    log.close()
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4", "5", "4"]
    assert float(rows[-1]["val_ppl"]) == pytest.approx(math.exp(4.5))

    # killed after step 5, resumed from the checkpoint of step 3: steps 4-5 are taken again
    log = MetricsLog(tmp_path, resumed_from=3)
    log.log(4, loss=1.0)
    log.close()
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
    assert [r["step"] for r in csv.DictReader(open(tmp_path / "metrics.csv"))] == \
        ["1", "2", "3", "4"]

    # a fresh run in the same --out starts a new log
    MetricsLog(tmp_path).close()
    assert _steps(tmp_path / "metrics.jsonl") == []


def test_tensorboard_events_hold_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        log.log(step, loss=float(step), lr=0.1)
    log.log(3, val_loss=2.0)
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/loss")] == [1.0, 2.0, 3.0]
    assert [e.step for e in acc.Scalars("val/val_loss")] == [3]


def test_missing_logger_is_a_clear_error(monkeypatch):
    real = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match=r"--wandb: .*pip install wandb"):
        check_sinks(False, "my-project")
    check_sinks(False, None)  # not asked for: nothing imported, no error


def test_disabled_without_out_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = MetricsLog(None, tensorboard=True)
    log.log(1, loss=1.0)
    log.close()
    assert list(tmp_path.iterdir()) == []
