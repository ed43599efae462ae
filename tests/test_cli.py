"""`slapo` command line: TOML config, flags overriding it, and clear errors for bad input."""

from __future__ import annotations

import json
import shlex
import signal

import pytest

from slapo.cli import main, parse_train_args, resume_command
from slapo.train import checkpoints, fault_injection
from slapo.train import run_state as ckpt

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--no-progress", "--no-plot", "--eval-batches", "0",
        "--min-lr-ratio", "1", "--dropout", "0.1"]


def write(tmp_path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_toml_options_and_cli_override(tmp_path):
    cfg_file = write(tmp_path, """
model = "llama"
steps = 7
seq-len = 32
lr = 1          # an int is accepted for a float option
[schedule]
attention = "sdpa"
fuse = true
ckpt_ratio = 0.5
""")
    cfg = parse_train_args(["--config", cfg_file])
    assert (cfg.model, cfg.steps, cfg.seq_len, cfg.lr) == ("llama", 7, 32, 1.0)
    assert isinstance(cfg.lr, float)
    assert cfg.knobs() == {"attention": "sdpa", "fuse": True, "ckpt_ratio": 0.5}
    assert cfg.batch_size == 8  # untouched: the default

    cfg = parse_train_args(["--config", cfg_file, "--steps", "3", "--no-fuse", "--model",
                            "gpt2", "--tp", "2"])
    assert (cfg.model, cfg.steps, cfg.seq_len) == ("gpt2", 3, 32)
    assert cfg.knobs() == {"attention": "sdpa", "fuse": False, "ckpt_ratio": 0.5}
    assert cfg.tp == 2  # a degree: the placement's (`setup.placement`), not passed to apply


def test_flags_without_config_and_resume_forms():
    cfg = parse_train_args(["--steps", "5", "--tempo", "--grad-clip", "0"])
    assert cfg.steps == 5 and cfg.tempo is True and cfg.grad_clip is None
    assert cfg.knobs() == {"tempo": True}
    assert parse_train_args(["--resume"]).resume == "latest"
    assert parse_train_args(["--resume", "runs/x/checkpoints/step_000010"]).resume.endswith("10")
    assert parse_train_args([]).resume is None


def test_parallel_knob_flags_reach_the_schedule_knobs():
    """--sequence-parallel and --vocab-parallel/--no-vocab-parallel are `slapo train` flags;
    --tp is the placement's degree (apply reads it from the mesh), validated with the knobs."""
    cfg = parse_train_args(["--tp", "2", "--sequence-parallel", "--no-vocab-parallel"])
    assert cfg.knobs() == {"sequence_parallel": True, "vocab_parallel": False}
    assert cfg.schedule_knobs().tp == 2
    cfg = parse_train_args(["--tp", "2", "--fused-loss"])  # fused loss needs a whole LM head
    assert cfg.knobs() == {"fused_loss": True, "vocab_parallel": False}
    with pytest.raises(ValueError, match="--fused-loss: .*vocab_parallel=False"):
        parse_train_args(["--tp", "2", "--fused-loss", "--vocab-parallel"]).schedule_knobs()


@pytest.mark.parametrize("argv, needle", [
    (["train", "--steps", "abc"], "--steps"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--model", "resnet"], "gpt2, llama"),
    (["train", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--attention", "fast"], "invalid choice: 'fast'"),
    (["train", "--resume"], "--resume needs --out"),
    (["train", "--save-every", "5"], "--save-every needs --out"),
    (["train", "--ckpt-ratio", "2"], "--ckpt-ratio: ckpt_ratio must be a number in [0, 1]"),
    (["train", "--tp", "0"], "--tp: tp must be a positive int"),
    (["train", "--fuse", "--compile-blocks"], "pass fuse=False with compile_blocks=True"),
    (["train", "--sequence-parallel", "--pp-stages", "2"], "--sequence-parallel"),
    (["fly"], "invalid choice: 'fly'"),
])
def test_bad_flags_exit_2_with_message(argv, needle, capsys):
    """One line, the error and where help is, not argparse's ~50-line usage block first."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err
    prog = "slapo" if argv == ["fly"] else "slapo train"
    assert err.startswith(f"{prog}: error: ") and f"(see `{prog} --help`)" in err, err


@pytest.mark.parametrize("text, needle", [
    ("stepz = 3", "unknown option 'stepz'"),
    ("steps = '3'", "steps must be int"),
    ("fuse = 1", "fuse must be bool"),
    ("steps = [", "not valid TOML"),
])
def test_bad_toml_exit_2_with_message(tmp_path, text, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", write(tmp_path, text)])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


def test_missing_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "nope.toml")])
    assert "no such file" in capsys.readouterr().err


def test_tp_without_ranks_is_a_clear_error(capsys):
    assert main(["train", "--tp", "2", "--steps", "1", "--no-progress"]) == 1
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


# ---- --model: a registry name that is also a local model directory -----------------------------
def test_a_registry_name_shadowed_by_a_model_directory_is_refused(tmp_path, monkeypatch, capsys):
    """`--model llama` with ./llama/config.json here trained a fresh registry LLaMA without a
    word. Refused (exit 2, nothing written), naming both ways out; a directory without a
    config.json (a run's --out named after its model) is not a model and stays unambiguous."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", "llama", "--steps", "1", "--out", "run", *TINY])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "--model llama is ambiguous" in err and "--model ./llama" in err, err
    assert "registry architecture 'llama'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()
    (tmp_path / "gpt2").mkdir()  # e.g. `--model gpt2 --out gpt2`: no config.json
    assert parse_train_args(["--model", "gpt2"]).model == "gpt2"
    from slapo.train.models import check_unambiguous, shadowed_model

    check_unambiguous("gpt2")
    assert shadowed_model("./llama") is None  # a path already: not a registry name
    # the Python API refuses it too (TrainConfig.check, which `train(cfg)` runs first)
    from slapo.train.loop import train

    with pytest.raises(ValueError, match="--model llama is ambiguous"):
        train(parse_train_args(["--model", "llama", "--steps", "1", "--out", "run2", *TINY]))
    assert not (tmp_path / "run2").exists()


# ---- a stop: one line naming the newest checkpoint and the resume command ----------------------
def test_resume_command_replaces_the_run_start_flags():
    args = ["--steps", "6", "--resume", "runs/a/checkpoints/step_000002", "--out", "runs/a",
            "--overwrite", "--resume-or-start", "--resume=x", "--resume"]
    assert resume_command(args, True) == "slapo train --steps 6 --out runs/a --resume"
    assert resume_command(["--out", "a b"], False) == "slapo train --out 'a b' --resume-or-start"


@pytest.mark.parametrize("point", ["step", "save"])
def test_ctrl_c_prints_one_line_and_the_run_resumes_bit_identically(point, tmp_path, capsys,
                                                                     monkeypatch, one_thread):
    """Ctrl-C (a real SIGINT to this process, `SLAPO_FAULT=sigint`) in step 3, and in the
    save of step 3 after its tensors are written: exit status 130 and one line, no
    traceback, naming where it stopped, the newest checkpoint (step 2) and the command that
    resumes it; the abandoned save left only its `.tmp`; that command continues with the
    losses of an uninterrupted run."""
    out = tmp_path / "run"
    argv = [*TINY, "--steps", "5", "--save-every", "1", "--out", str(out)]
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setenv(fault_injection.ENV, f"sigint:{point}=3:rank=0")
    assert main(["train", *argv]) == 130
    assert signal.getsignal(signal.SIGINT) is before  # the command's handlers are undone
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith(fault_injection.ENV)]
    assert len(lines) == 1 and "Traceback" not in err, err
    where = "in step 3" if point == "step" else "during the save of step 3"
    newest = checkpoints.checkpoint_dir(out, 2)
    assert lines[0].startswith(f"slapo train: stopped by Ctrl-C (SIGINT) {where}; the newest "
                               f"checkpoint is {newest} (step 2); resume with: slapo train "), err
    assert [checkpoints.step_of(p) for p in checkpoints.candidates(out)] == [2, 1]
    assert all(ckpt.verify(p) is None for p in checkpoints.candidates(out))
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert leftovers == ["step_000001", "step_000002"] + (["step_000003.tmp"] if point == "save"
                                                          else [])
    monkeypatch.delenv(fault_injection.ENV)
    command = shlex.split(lines[0].split("resume with: ")[1])
    assert command[:2] == ["slapo", "train"] and command[-1] == "--resume"
    assert main(command[1:]) == 0
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["resumed_from"] == 2
    straight = tmp_path / "straight"
    assert main(["train", *TINY, "--steps", "5", "--save-every", "1", "--out", str(straight)]) == 0
    assert resumed["losses"] == json.loads((straight / "metrics.json").read_text())["losses"]
    assert not (out / "checkpoints" / "step_000003.tmp").exists()  # replaced by the new save


def test_sigterm_without_a_launcher_is_a_stop_too(tmp_path, capsys, monkeypatch, one_thread):
    """A job scheduler's SIGTERM to a one-process run: exit status 143, the same one line."""
    out = tmp_path / "run"
    monkeypatch.setenv(fault_injection.ENV, "sigterm:step=2:rank=0")
    rc = main(["train", *TINY, "--steps", "4", "--save-every", "1", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines()
           if not line.startswith(fault_injection.ENV)]
    assert rc == 143 and len(err) == 1, err
    assert err[0].startswith(f"slapo train: stopped by SIGTERM in step 2; the newest checkpoint "
                             f"is {checkpoints.checkpoint_dir(out, 1)} (step 1); resume with: "), err
