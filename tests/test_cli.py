"""`slapo` command line: TOML config, flags overriding it, and clear errors for bad input."""

from __future__ import annotations

import pytest

from slapo.cli import main, parse_train_args


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
    assert cfg.knobs() == {"attention": "sdpa", "fuse": False, "ckpt_ratio": 0.5, "tp": 2}


def test_flags_without_config_and_resume_forms():
    cfg = parse_train_args(["--steps", "5", "--tempo", "--grad-clip", "0"])
    assert cfg.steps == 5 and cfg.tempo is True and cfg.grad_clip is None
    assert cfg.knobs() == {"tempo": True}
    assert parse_train_args(["--resume"]).resume == "latest"
    assert parse_train_args(["--resume", "runs/x/checkpoints/step_000010"]).resume.endswith("10")
    assert parse_train_args([]).resume is None


def test_parallel_knob_flags_reach_the_schedule_knobs():
    """--sequence-parallel and --vocab-parallel/--no-vocab-parallel are `slapo train` flags."""
    cfg = parse_train_args(["--tp", "2", "--sequence-parallel", "--no-vocab-parallel"])
    assert cfg.knobs() == {"tp": 2, "sequence_parallel": True, "vocab_parallel": False}
    cfg = parse_train_args(["--tp", "2", "--fused-loss"])  # fused loss needs a whole LM head
    assert cfg.knobs() == {"tp": 2, "fused_loss": True, "vocab_parallel": False}
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
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err


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
