"""`slapo train` checkpoints: no code runs from a checkpoint, a damaged one never ends a run.

Real `slapo train` runs (GPT-2 64x2, CPU, dropout on so every RNG stream matters):
- a crafted pickle (its `__reduce__` would run `touch PWNED`) in each file a resume reads is
  refused with an error naming the file, and PWNED is never created (the completion marker is
  forged to match, as an attacker would);
- a killed save, a missing marker, a truncated shard, a missing file and a flipped byte in the
  newest checkpoint: the run resumes from the previous intact one with a warning naming what
  was skipped and why, and its losses equal the uninterrupted run's bit for bit;
- `--resume` bad input: a different `--hidden-size` / `--model` gets the "different run"
  message (identity checked before any tensor is read), no checkpoint is exit status 2 unless
  `--resume-or-start`; `--keep-last`, `--dist-timeout`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from slapo.cli import main
from slapo.train import checkpoint_read, checkpoints
from slapo.train import run_state as ckpt

TINY = ["--hidden-size", "64", "--num-layers", "2", "--num-heads", "4", "--seq-len", "32",
        "--batch-size", "4", "--dropout", "0.1", "--no-progress", "--no-plot",
        "--eval-batches", "0"]
STEPS = ["--steps", "6"]


pytestmark = pytest.mark.usefixtures("one_thread")


def train(out: Path, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    return json.loads((out / "metrics.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """An uninterrupted 6-step run's losses, and a run directory with checkpoints at 3 and 6."""
    root = tmp_path_factory.mktemp("runs")
    straight = train(root / "straight", *STEPS)["losses"]
    saved = train(root / "saved", *STEPS, "--save-every", "3")
    assert saved["losses"] == straight
    return {"straight": straight, "saved": root / "saved"}


def _copy(runs: dict, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(runs["saved"], out)
    return out


# ---- forging (what an attacker with write access to a checkpoint would do) ---------------------
class Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _payload(marker: Path, torch_format: bool = False) -> bytes:
    if not torch_format:
        return pickle.dumps(Evil(marker))
    buf = io.BytesIO()
    torch.save(Evil(marker), buf)
    return buf.getvalue()


def _reseal(ck: Path, name: str) -> None:
    """Update COMPLETE.json so the forged file passes the integrity check."""
    manifest = json.loads((ck / checkpoints.MARKER).read_text())
    data = (ck / name).read_bytes()
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / checkpoints.MARKER).write_text(json.dumps(manifest))


def _forge_file(ck: Path, name: str, data: bytes) -> None:
    (ck / name).write_bytes(data)
    _reseal(ck, name)


def _forge_dcp_item(ck: Path, fqn: str, data: bytes) -> str:
    """Point DCP's entry `fqn` at `data`, appended to its .distcp file; re-pickle .metadata
    (this test's own trusted file) and reseal both. Returns the .distcp file name."""
    meta = pickle.loads((ck / ".metadata").read_bytes())
    key = next(k for k in meta.storage_data if k.fqn == fqn)
    info = meta.storage_data[key]
    shard = ck / info.relative_path
    old = shard.read_bytes()
    meta.storage_data[key] = dataclasses.replace(info, offset=len(old), length=len(data))
    shard.write_bytes(old + data)
    (ck / ".metadata").write_bytes(pickle.dumps(meta))
    _reseal(ck, info.relative_path)
    _reseal(ck, ".metadata")
    return info.relative_path


def _resume_fails(out: Path, ck: Path, capsys) -> str:
    rc = main(["train", *TINY, *STEPS, "--out", str(out / "again"), "--resume", str(ck)])
    err = capsys.readouterr().err
    assert rc == 1, err
    return err


@pytest.mark.parametrize("name", [".metadata", "rng_rank0.json", "trainer.json"])
def test_crafted_pickle_in_a_checkpoint_file_is_refused(runs, tmp_path, capsys, name):
    out = _copy(runs, tmp_path)
    ck, marker = checkpoints.checkpoint_dir(out, 6), tmp_path / "PWNED"
    _forge_file(ck, name, _payload(marker, torch_format=name != ".metadata"))
    assert ckpt.verify(ck) is None  # the forged marker matches: only the loader stands guard
    err = _resume_fails(out, ck, capsys)
    assert name in err and "Traceback" not in err and "refus" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("fqn", ["optim.param_groups.transformer.wte.weight.lr",
                                 "model.transformer.wte.weight"])
def test_crafted_pickle_in_a_distcp_item_is_refused(runs, tmp_path, capsys, fqn):
    """A non-tensor item (our planner) and a tensor item (DCP's own weights-only load)."""
    out = _copy(runs, tmp_path)
    ck, marker = checkpoints.checkpoint_dir(out, 6), tmp_path / "PWNED"
    shard = _forge_dcp_item(ck, fqn, _payload(marker, torch_format=True))
    err = _resume_fails(out, ck, capsys)
    assert shard in err and "Traceback" not in err, err
    assert not marker.exists()


def test_crafted_completion_marker_is_refused(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    ck, marker = checkpoints.checkpoint_dir(out, 6), tmp_path / "PWNED"
    (ck / checkpoints.MARKER).write_bytes(_payload(marker))
    err = _resume_fails(out, ck, capsys)
    assert checkpoints.MARKER in err and "not a JSON file" in err, err
    assert not marker.exists()


def test_legacy_pickled_rng_file_is_never_read(runs, tmp_path, capsys):
    """The issue's exploit: `rng_rank0.pt` holding a crafted pickle. An old-format checkpoint
    (no marker) is refused; next to a new-format one the file is simply never opened."""
    out = _copy(runs, tmp_path)
    marker = tmp_path / "PWNED"
    old = checkpoints.checkpoint_dir(out, 3)
    (old / checkpoints.MARKER).unlink()
    (old / "rng_rank0.pt").write_bytes(_payload(marker, torch_format=True))
    err = _resume_fails(out, old, capsys)
    assert "no COMPLETE.json" in err
    new = checkpoints.checkpoint_dir(out, 6)
    (new / "rng_rank0.pt").write_bytes(_payload(marker, torch_format=True))
    assert main(["train", *TINY, "--steps", "7", "--out", str(out), "--resume"]) == 0
    assert not marker.exists()


@pytest.mark.parametrize("module,name", [("builtins", "eval"), ("builtins", "getattr"),
                                         ("os", "system"), ("torch", "load"),
                                         ("torch.distributed.checkpoint.filesystem",
                                          "FileSystemReader")])
def test_metadata_unpickler_resolves_only_metadata_classes(tmp_path, module, name):
    data = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00\x8c" + bytes([len(module)]) + \
        module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93."
    with pytest.raises(checkpoints.CheckpointError, match=f"refusing to unpickle {module}.{name}"):
        checkpoint_read._MetadataUnpickler(io.BytesIO(data), tmp_path / ".metadata").load()


# ---- damaged checkpoints: fall back to the newest intact one ----------------------------------
def _kill_mid_save(ck: Path) -> str:
    """What kill -9 during a save leaves: a `.tmp` directory, half written, never renamed."""
    tmp = ck.with_name(ck.name + ".tmp")
    ck.rename(tmp)
    (tmp / checkpoints.MARKER).unlink()
    shard = tmp / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    return ""  # not a published checkpoint: nothing to skip, nothing to warn about


def _no_marker(ck: Path) -> str:
    (ck / checkpoints.MARKER).unlink()
    return "no COMPLETE.json"


def _truncate_shard(ck: Path) -> str:
    shard = ck / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return "__0_0.distcp has"


def _missing_file(ck: Path) -> str:
    (ck / "rng_rank0.json").unlink()
    return "missing file rng_rank0.json"


def _flip_byte(ck: Path) -> str:
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    return "__0_0.distcp does not match its sha256"


@pytest.mark.parametrize("damage", [_kill_mid_save, _no_marker, _truncate_shard, _missing_file,
                                    _flip_byte])
def test_damaged_newest_checkpoint_falls_back_with_identical_losses(runs, tmp_path, capsys,
                                                                   damage):
    out = _copy(runs, tmp_path)
    newest = checkpoints.checkpoint_dir(out, 6)
    why = damage(newest)
    capsys.readouterr()
    m = train(out, *STEPS, "--resume")
    err = capsys.readouterr().err
    assert m["resumed_from"] == 3
    assert m["losses"] == runs["straight"]  # bit for bit
    if why:
        assert f"skipping checkpoint {newest}: {why}" in err, err
        assert m["resume_skipped"] == [{"checkpoint": str(newest),
                                        "reason": m["resume_skipped"][0]["reason"]}]
        assert why in m["resume_skipped"][0]["reason"]
    else:
        assert m["resume_skipped"] == [] and "skipping" not in err
    assert ckpt.verify(newest) is None  # the resumed run saved step 6 again, intact


def test_explicit_damaged_checkpoint_is_an_error(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    ck = checkpoints.checkpoint_dir(out, 6)
    _flip_byte(ck)
    err = _resume_fails(out, ck, capsys)
    assert "does not match its sha256" in err and "--resume` with no directory" in err


def test_every_checkpoint_damaged_is_an_error(runs, tmp_path, capsys):
    out = _copy(runs, tmp_path)
    for step in (3, 6):
        _missing_file(checkpoints.checkpoint_dir(out, step))
    rc = main(["train", *TINY, *STEPS, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert rc == 1 and "no intact checkpoint" in err
    assert err.count("skipping checkpoint") == 2


# ---- resume: bad input ------------------------------------------------------------------------
@pytest.mark.parametrize("flags,shown", [
    (["--hidden-size", "32"], "--hidden-size 32 (checkpoint: 64)"),
    (["--model", "llama"], "--model llama (checkpoint: gpt2)"),
])
def test_resume_a_different_run_says_so_before_loading(runs, tmp_path, capsys, flags, shown):
    out = _copy(runs, tmp_path)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    rc = main(["train", *TINY, *STEPS, "--out", str(out), "--resume", *flags])
    err = capsys.readouterr().err
    assert rc == 1
    assert "different run" in err and shown in err and "Traceback" not in err, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # nothing written


def test_resume_with_no_checkpoint_is_a_usage_error(tmp_path, capsys):
    out = tmp_path / "typo"
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, *STEPS, "--out", str(out), "--resume"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "--resume-or-start" in err and "drop --resume" in err
    assert not out.exists()
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, *STEPS, "--resume", str(tmp_path / "nope")])
    assert e.value.code == 2 and "no such checkpoint directory" in capsys.readouterr().err


def test_resume_or_start_starts_fresh_then_resumes(tmp_path, capsys):
    out = tmp_path / "job"
    first = train(out, "--steps", "3", "--resume-or-start")
    assert first["resumed_from"] is None
    assert "starting from step 0" in capsys.readouterr().out
    second = train(out, *STEPS, "--resume-or-start")
    assert second["resumed_from"] == 3 and second["losses"][:3] == first["losses"]
    assert len(second["losses"]) == 6


@pytest.mark.parametrize("flags,text", [
    (["--keep-last", "-1"], "--keep-last must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout must be > 0"),
    (["--resume-or-start", "--resume", "x"], "--resume-or-start resumes from the newest"),
])
def test_bad_checkpoint_flags_are_usage_errors(tmp_path, capsys, flags, text):
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY, "--out", str(tmp_path), *flags])
    assert e.value.code == 2 and text in capsys.readouterr().err


# ---- retention, timeout -----------------------------------------------------------------------
def test_keep_last_keeps_the_newest_and_removes_stale_temp_dirs(tmp_path):
    (tmp_path / "checkpoints" / "step_000001.tmp").mkdir(parents=True)  # a killed save
    cfg = tmp_path / "run.toml"
    cfg.write_text("keep-last = 2\n")
    train(tmp_path, "--config", str(cfg), "--steps", "8", "--save-every", "2")
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == ["step_000006", "step_000008"]
    assert all(ckpt.verify(tmp_path / "checkpoints" / n) is None for n in left)


def test_keep_all_by_default(tmp_path):
    train(tmp_path, "--steps", "4", "--save-every", "2")
    assert [p.name for p in checkpoints.candidates(tmp_path)] == ["step_000004", "step_000002"]


def test_dist_timeout_reaches_init_process_group(monkeypatch):
    import torch.distributed as dist

    from slapo.train import config, setup

    class Captured(Exception):
        pass

    def fake_init(backend, timeout):
        raise Captured(backend, timeout)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # a complete torchrun environment:
    monkeypatch.setenv("MASTER_PORT", "29500")      # init_mesh joins it with the timeout
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", fake_init)
    with pytest.raises(Captured) as e:
        setup.setup(config.TrainConfig(dist_timeout=7.5, device="cpu"))
    assert e.value.args == ("gloo", timedelta(seconds=7.5))
    assert config.TrainConfig().dist_timeout == config.DIST_TIMEOUT_S == 60


# ---- exec audit -------------------------------------------------------------------------------
def test_pattern_with_forged_signature_cannot_inject_code(tmp_path):
    """graph/matcher.py builds a pattern's forward with `exec` from its parameter names: a
    forged `__signature__` whose name smuggles a statement is refused, nothing runs."""
    import inspect

    from slapo.graph.matcher import trace_pattern

    marker = tmp_path / "PWNED"

    def pattern(x):
        return x + 1

    param = inspect.signature(pattern).parameters["x"]
    param._name = f"x=__import__('os').system('touch {marker}')"  # bypasses Parameter's check
    pattern.__signature__ = inspect.Signature([param])
    with pytest.raises(ValueError, match="not identifiers"):
        trace_pattern(pattern)
    assert not marker.exists()
    assert len(list(trace_pattern(lambda x: x + 1).graph.nodes)) == 3  # a normal pattern traces


# ---- a real kill -9 during a save -------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_an_intact_checkpoint(tmp_path, capsys):
    """A real `slapo train` process, SIGKILLed as soon as its step-4 save directory appears
    (mid-save: DCP, RNG, hashing and rename take tens of ms). Whatever the moment, `--resume`
    finds an intact checkpoint and the losses continue bit for bit (constant LR, so the killed
    run's huge --steps does not change the schedule)."""
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    flags = [*TINY, "--min-lr-ratio", "1"]
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "slapo.cli", "train", *flags, "--steps",
                             "100000", "--save-every", "2", "--out", str(out)], env=env,
                            cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    tmp4 = checkpoints.checkpoint_dir(out, 4).with_name("step_000004.tmp")
    try:
        deadline = time.monotonic() + 120
        while not tmp4.exists():
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no step-4 save after 120 s"
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    published = checkpoints.checkpoint_dir(out, 4).exists()
    print("killed", "after" if published else "during", "the step-4 save")
    assert published or tmp4.exists()  # either the save finished or its .tmp is left over
    straight = train(tmp_path / "straight", *flags[len(TINY):], "--steps", "6")["losses"]
    resumed = train(out, "--min-lr-ratio", "1", "--steps", "6", "--resume")
    assert resumed["resumed_from"] == (4 if published else 2)
    assert resumed["losses"] == straight
    assert not tmp4.exists()  # the final save at step 6 removed the stale .tmp of step 4
