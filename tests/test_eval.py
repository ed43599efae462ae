"""`slapo eval TARGET`: a run's checkpoint (or a Hugging Face directory) evaluated with no
training: exactly the run's own val loss, the same number for the run and for its merged export
on other data, and bad input refused with exit status 2."""

from __future__ import annotations

import json

import pytest
from test_train_lora import save_base

from slapo.cli import main

pytest.importorskip("peft")
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = ["--seq-len", "16", "--batch-size", "4", "--no-progress", "--no-plot"]


def _quiet(*a, **k):
    pass


def test_slapo_eval_gives_the_runs_val_loss_and_its_exports(tmp_path, capsys):
    from slapo.train.evaluate import eval_target
    from slapo.train.export import export_run

    base, run = save_base(tmp_path / "base"), tmp_path / "run"
    assert main(["train", "--model", base, "--lora-r", "4", *SMALL, "--steps", "2",
                 "--eval-batches", "2", "--lr", "1e-2", "--out", str(run)]) == 0
    logged = json.loads((run / "metrics.json").read_text())["val_loss"]
    own = eval_target(run, log=_quiet)
    assert own["val_loss"] == logged and own["step"] == 2 and own["batches"] == 2

    notes = tmp_path / "notes.txt"
    notes.write_text("A held-out note about gardens, rivers and old maps.\n" * 40)
    got = eval_target(run, data=str(notes), log=_quiet)
    export_run(run, tmp_path / "merged", merge=True, log=_quiet)
    want = eval_target(tmp_path / "merged", data=str(notes), seq_len=16, batch_size=4,
                       eval_batches=2, log=_quiet)
    assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5)
    assert got["val_loss"] != pytest.approx(own["val_loss"], rel=1e-3)  # other data
    before = eval_target(base, data=str(notes), seq_len=16, batch_size=4, eval_batches=2,
                         log=_quiet)
    assert before["val_loss"] != pytest.approx(got["val_loss"], rel=1e-4)  # the adapters count

    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    assert f"val loss {logged:.4f}" in capsys.readouterr().out
    for argv, says in (([str(run), "--batches", "0"], "--batches must be >= 1"),
                       ([str(tmp_path / "nope")], "neither a `slapo train` run directory"),
                       ([base, "--step", "2"], "--step picks a run's checkpoint"),
                       ([str(run), "--step", "7"], "cannot evaluate step 7")):
        assert main(["eval", *argv]) == 2, argv
        assert says in capsys.readouterr().err, argv
