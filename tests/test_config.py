"""`TrainConfig` is declared: sections of fields, one help text each, from which the CLI flags,
the TOML keys and the knob spaces derive; `check()` checks values only (files and devices:
`train.setup.check_inputs`)."""

from __future__ import annotations

import builtins
import os
from pathlib import Path

import pytest
import torch

from slapo import cli
from slapo.model_schedule.knobs import ScheduleKnobs
from slapo.train.config import (
    SECTIONS,
    CheckpointOptions,
    TrainConfig,
    TrainingOptions,
    option_fields,
)


def test_sections_and_flat_names_are_one_config():
    nested = TrainConfig(training=TrainingOptions(steps=5, precision="bf16"),
                         schedule=ScheduleKnobs(tp=2, fuse=True),
                         checkpoint=CheckpointOptions(out="runs/x"))
    flat = TrainConfig(steps=5, precision="bf16", tp=2, fuse=True, out="runs/x")
    assert nested == flat and nested.options() == flat.options()
    assert (flat.training.steps, flat.schedule.tp, flat.checkpoint.out) == (5, 2, "runs/x")
    assert flat.knobs() == {"fuse": True} and flat.tp == 2  # a degree: the placement's
    assert TrainConfig(**flat.options()) == flat  # a checkpoint's saved config rebuilds it
    # a knob not given reads None (apply's default applies) but the section holds that default
    assert flat.pp_stages is None and flat.schedule.pp_stages == 1
    assert TrainConfig(pp_stages=1) != TrainConfig()  # given is not the same as not given
    flat.steps, flat.tp = 7, None
    assert flat.training.steps == 7 and flat.tp is None and "tp" not in flat.knobs()
    with pytest.raises(TypeError, match="stepz"):
        TrainConfig(stepz=1)


def test_nested_and_flat_toml_load_the_same(tmp_path):
    nested = tmp_path / "nested.toml"
    nested.write_text('[arch]\nmodel = "llama"\n[training]\nsteps = 3\nprecision = "bf16"\n'
                      '[schedule]\ntp = 2\n[checkpoint]\nout = "runs/x"\n')
    flat = tmp_path / "flat.toml"
    flat.write_text('model = "llama"\nsteps = 3\nprecision = "bf16"\ntp = 2\nout = "runs/x"\n')
    a, b = (cli.parse_train_args(["--config", str(p)]) for p in (nested, flat))
    assert a == b and a.arch.model == "llama" and a.tp == 2 and a.knobs() == {}


def test_every_flag_help_is_its_fields_help():
    """One help text per option: the flag shows the field's `metadata["help"]`; the CLI holds no
    table of its own."""
    assert not hasattr(cli, "HELP")
    train = cli._parser()._subparsers._group_actions[0].choices["train"]
    by_flag = {s: a for a in train._actions for s in a.option_strings}
    for section, f in option_fields():
        action = by_flag["--" + f.name.replace("_", "-")]
        assert f.metadata["help"] in action.help, f.name
        assert (section == "schedule") == action.help.startswith("schedule knob: "), f.name
    assert set(SECTIONS) == {"arch", "corpus", "training", "optimizer", "lora", "parallelism",
                             "schedule", "checkpoint", "logging"}


def test_check_touches_no_file_device_or_import(monkeypatch):
    """Every option that names a path, a device or a logger, and `check()` passes without
    looking at any of them (they are `setup.check_inputs`'s)."""
    def touched(*a, **k):
        raise AssertionError(f"check() touched the machine: {a}")

    for name in ("exists", "is_dir", "is_file", "iterdir", "stat"):
        monkeypatch.setattr(Path, name, touched)
    monkeypatch.setattr(os, "stat", touched)
    monkeypatch.setattr(torch.cuda, "is_available", touched)
    real_import = builtins.__import__

    def no_loggers(name, *a, **k):
        if name in ("wandb", "torch.utils.tensorboard", "tensorboard"):
            touched(name)
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_loggers)
    TrainConfig(model="llama", data="books/*.txt", tokenizer="tok/", out="runs/x",
                resume="latest", device="cuda", tensorboard=True, wandb="proj",
                save_every=1).check()
    TrainConfig(model="./my_model", resume="runs/x/checkpoints/step_000001").check()


def test_the_moved_checks_still_stop_train(tmp_path):
    """`train(cfg)` (the Python entry, not only `slapo train`) runs `check_inputs` before
    anything is built."""
    from slapo.train import train

    with pytest.raises(ValueError, match="no such checkpoint directory"):
        train(TrainConfig(resume=str(tmp_path / "nope")))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        train(TrainConfig(out=str(tmp_path / "afile")))
    assert not (tmp_path / "nope").exists()
