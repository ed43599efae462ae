"""`slapo train` end to end: the loss falls, checkpoints resume bit-exactly, a real kill too."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slapo.cli import main
from slapo.train import checkpoints
from slapo.train import run_state as ckpt

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--seq-len", "64",
        "--batch-size", "8", "--no-progress"]
ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def train(out: Path, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return json.loads((out / "metrics.json").read_text())


def test_train_50_steps_lowers_loss(tmp_path):
    m = train(tmp_path, "--steps", "50", "--lr", "3e-3")
    losses = m["losses"]
    assert len(losses) == 50 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(260)) < 0.3  # starts near uniform over the byte vocab
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 1.5, (first, last)
    assert m["val_loss"] < math.log(260) - 1.5
    assert m["tokens_per_s"] > 0 and m["tokens_per_step"] == 8 * 64
    assert m["peak_memory_bytes"] > 10 * 2**20
    assert m["config"]["model"] == "gpt2" and m["steps"] == 50
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert checkpoints.latest(tmp_path).name == "step_000050"  # the final state is saved


def test_resume_gives_identical_losses(tmp_path):
    """20 steps straight vs. 20 steps saving at 10 vs. a fresh process state resumed from
    that step-10 checkpoint: every loss equal (fp32 CPU, dropout on: RNG state is restored)."""
    flags = ["--steps", "20", "--dropout", "0.1", "--no-plot", "--eval-batches", "0"]
    straight = train(tmp_path / "straight", *flags)["losses"]
    saving = train(tmp_path / "saving", *flags, "--save-every", "10")["losses"]
    assert saving == straight  # saving a checkpoint does not perturb training
    step10 = tmp_path / "saving" / "checkpoints" / "step_000010"
    assert (step10 / "trainer.json").is_file()
    torch.manual_seed(1234)  # the resumed run must not depend on the caller's RNG state
    resumed = train(tmp_path / "resumed", *flags, "--resume", str(step10))
    assert resumed["resumed_from"] == 10
    assert resumed["losses"][:10] == straight[:10]  # history carried in the checkpoint
    assert resumed["losses"][10:] == straight[10:]
    assert len(resumed["step_times_s"]) == 10


def test_checkpoint_with_group_index_optimizer_keys_still_resumes(tmp_path, monkeypatch):
    """Checkpoints written before optimizer hyper-parameters were keyed by parameter name
    (`optim.param_groups.0.lr`) resume exactly; new ones use names."""
    import functools

    import torch.distributed.checkpoint as dcp

    flags = ["--steps", "4", "--dropout", "0.1", "--no-plot", "--eval-batches", "0",
             "--weight-decay", "0.05"]
    straight = train(tmp_path / "straight", *flags)["losses"]
    with monkeypatch.context() as m:
        m.setattr(ckpt, "_state", functools.partial(ckpt._state, flat=False))
        train(tmp_path / "old", *flags, "--save-every", "2")
    step2 = tmp_path / "old" / "checkpoints" / "step_000002"
    keys = dcp.FileSystemReader(str(step2)).read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" in keys and not ckpt._flat_optimizer(
        dcp.FileSystemReader(str(step2)).read_metadata())
    resumed = train(tmp_path / "resumed", *flags, "--resume", str(step2))
    assert resumed["losses"] == straight
    new = train(tmp_path / "new", *flags, "--save-every", "2")  # today's format
    keys = dcp.FileSystemReader(str(tmp_path / "new" / "checkpoints" / "step_000002")
                                ).read_metadata().state_dict_metadata
    assert "optim.param_groups.transformer.wte.weight.lr" in keys, sorted(keys)[:5]
    assert new["losses"] == straight


def test_resume_latest_continues_the_run_in_out(tmp_path):
    flags = ["--no-plot", "--eval-batches", "0", "--min-lr-ratio", "1"]
    train(tmp_path, *flags, "--steps", "6", "--save-every", "3")
    (tmp_path / "checkpoints" / "step_000009.tmp").mkdir()  # an interrupted save: ignored
    m = train(tmp_path, *flags, "--steps", "8", "--resume")
    assert m["resumed_from"] == 6 and len(m["losses"]) == 8
    assert checkpoints.latest(tmp_path).name == "step_000008"


def test_resume_refuses_a_different_run(tmp_path, capsys):
    train(tmp_path, "--steps", "2", "--no-plot", "--eval-batches", "0")
    rc = main(["train", *TINY, "--out", str(tmp_path), "--steps", "4", "--resume",
               "--seed", "7", "--no-plot"])
    assert rc == 1
    assert "different run" in capsys.readouterr().err


def test_latest_picks_highest_complete_checkpoint(tmp_path):
    assert checkpoints.latest(tmp_path) is None
    for step, complete in ((5, True), (40, True), (100, False)):
        d = checkpoints.checkpoint_dir(tmp_path, step)
        d.mkdir(parents=True)
        if complete:
            (d / checkpoints.MARKER).write_text("{}")
    (tmp_path / "checkpoints" / "step_000200.tmp").mkdir()
    assert checkpoints.latest(tmp_path).name == "step_000040"


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted(tmp_path):
    """A real `python -m slapo.cli train` process, SIGKILLed after its step-10 checkpoint,
    resumed from it: steps 11-20 equal an uninterrupted run's (constant LR, so the killed
    run's larger --steps does not change the schedule)."""
    flags = ["--min-lr-ratio", "1", "--dropout", "0.1", "--no-plot", "--eval-batches", "0"]
    killed = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "slapo.cli", "train", *TINY, *flags,
                             "--steps", "100000", "--save-every", "10", "--out", str(killed)],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    step10 = checkpoints.checkpoint_dir(killed, 10)
    try:
        deadline = time.monotonic() + 120
        while not (step10 / checkpoints.MARKER).exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no step-10 checkpoint after 120 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL  # killed mid-run, not finished
    assert not (killed / "metrics.json").exists()

    straight = train(tmp_path / "straight", *flags, "--steps", "20")["losses"]
    resumed = train(tmp_path / "resumed", *flags, "--steps", "20", "--resume", str(step10))
    assert resumed["resumed_from"] == 10
    assert resumed["losses"][10:] == straight[10:]


def test_graph_breaks_are_reported(tmp_path, capsys, monkeypatch):
    """metrics.json counts dynamo's graph breaks, and the final lines name the first one: with
    `--compile-blocks` each is eager Python on every step."""
    import torch

    from slapo.train import report
    from slapo.train.config import TrainConfig
    from slapo.train.loop import train

    torch._dynamo.reset()

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2

    before = report.graph_break_counts()
    torch.compile(broken, backend="eager")(torch.ones(2))
    found = report.graph_breaks(before)
    assert found["count"] == 1 and found["reasons"], found
    assert report.graph_breaks(report.graph_break_counts())["count"] == 0  # only new ones
    torch._dynamo.reset()
    cfg = dict(model="gpt2", steps=1, batch_size=2, seq_len=16, eval_batches=0, progress=False,
               plot=False)
    train(TrainConfig(**cfg, out=str(tmp_path / "a")))  # the break above was not this run's
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["graph_breaks"] == \
        {"count": 0, "reasons": []}
    assert "graph break" not in capsys.readouterr().out

    monkeypatch.setattr(report, "graph_breaks", lambda before: {"count": 3, "reasons": ["why"]})
    train(TrainConfig(**cfg, out=str(tmp_path / "b")))
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["graph_breaks"]["count"] == 3
    assert "3 torch.compile graph break(s)" in capsys.readouterr().out
