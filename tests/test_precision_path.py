"""`--precision` from the command line to autocast: one name, one list, one check.

The path (docs/architecture.md): `cli.py` (the flag, from the field) -> `train/config.py`
(`TrainingOptions.precision`, checked by `check_precision`) -> `train/assemble.py`
(`build_trainer(precision=cfg.precision)`) -> `runtime/build.py` (`check_precision`, then
`Precision(name)`; `slapo.build`'s `mixed_precision=` is translated before, in compat) -> `runtime/precision.py` (`Precision.autocast`).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import models
import pytest
import torch

import slapo
from slapo.runtime import precision as prec

SLAPO = Path(slapo.__file__).parent
TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--no-progress", "--no-plot", "--eval-batches", "0",
        "--device", "cpu", "--steps", "1"]


def _name_tests(path: Path) -> list[str]:
    """Functions of `path` that test a value against the precision names: a membership or
    equality test against `PRECISIONS` / `DTYPES` or a literal collection holding "bf16"."""
    found = []
    tree = ast.parse(path.read_text())
    names = {"PRECISIONS", "MIXED_PRECISION"}
    if path.name == "precision.py" or any(  # DTYPES: precision's table, not another module's
            isinstance(n, ast.ImportFrom) and (n.module or "").endswith("precision")
            and any(a.name == "DTYPES" for a in n.names) for n in ast.walk(tree)):
        names.add("DTYPES")
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare) and any(_names_precisions(c, names)
                                                     for c in node.comparators):
                found.append(f"{path.relative_to(SLAPO.parent)}:{fn.name}")
    return sorted(set(found))


def _names_precisions(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    if isinstance(node, ast.Attribute):
        return node.attr in names
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(isinstance(e, ast.Constant) and e.value in ("bf16", "fp16") for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(isinstance(k, ast.Constant) and k.value in ("bf16", "fp16") for k in node.keys)
    return False


def test_one_validation_of_a_precision_name():
    """Only `check_precision` tests a value against the precision names; a second check
    (a config tuple, a `value in DTYPES` in build, argparse choices) fails this test."""
    sites = [s for p in sorted(SLAPO.rglob("*.py")) for s in _name_tests(p)]
    assert sites == ["slapo/runtime/precision.py:check_precision"], sites
    from slapo.cli import _parser

    train = _parser()._subparsers._group_actions[0].choices["train"]
    action = next(a for a in train._actions if "--precision" in a.option_strings)
    assert action.choices is None  # argparse shows the names but leaves the check to it


def test_the_one_list_decides_along_the_whole_path(monkeypatch, tmp_path):
    """A name added to `PRECISIONS` (and its autocast dtype to `DTYPES`) in
    runtime/precision.py alone is accepted by the flag, the TOML file, `TrainConfig.check`,
    `build` and the step: no other layer holds its own list. A name removed there is refused
    by every layer, by the one check."""
    monkeypatch.setattr(prec, "PRECISIONS", (*prec.PRECISIONS, "bf16x"))
    monkeypatch.setitem(prec.DTYPES, "bf16x", torch.bfloat16)
    from slapo.cli import main

    assert main(["train", *TINY, "--precision", "bf16x", "--out", str(tmp_path)]) == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["precision"] == "bf16x" and metrics["config"]["precision"] == "bf16x"

    monkeypatch.setattr(prec, "PRECISIONS", ("fp32", "bf16"))
    from slapo.train.config import TrainConfig

    with pytest.raises(ValueError, match="--precision must be one of"):
        TrainConfig(precision="fp16").check()
    with pytest.raises(prec.PrecisionError, match="precision='fp16'"):
        slapo.build(slapo.create_schedule(models.gpt2(seed=0)), precision="fp16")


def test_precision_and_its_earlier_keyword():
    """`precision=` is the name; `mixed_precision=` (and None for fp32) still works at the
    public edge, and the two at once must agree."""
    tm, _ = slapo.build(slapo.create_schedule(models.gpt2(seed=0)), precision="bf16",
                        optimizer=torch.optim.SGD)
    assert tm.precision.name == "bf16" and tm.precision.dtype is torch.bfloat16
    tm, _ = slapo.build(slapo.create_schedule(models.gpt2(seed=0)), mixed_precision="bf16",
                        optimizer=torch.optim.SGD)
    assert tm.precision.name == "bf16"
    with pytest.raises(slapo.SchedulingError, match="both given"):
        slapo.build(slapo.create_schedule(models.gpt2(seed=0)), precision="bf16",
                    mixed_precision="fp16")
    assert slapo.Verify(slapo.create_schedule(models.gpt2(seed=0)),
                        mixed_precision=None).precision == "fp32"
    assert prec.check_precision(None) == "fp32"
