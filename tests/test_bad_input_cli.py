"""Bad input through the command line, the TOML config, the tuner database and `--resume`, in
breadth (issue 15, item 6); one table per surface.

Each case must be *caught* (exit status 2 from argparse or a usage check, or 1 with one
`error:` paragraph for what is found once the run has started), *clear* (the last line is
`slapo train: error: ...` / `slapo tune: error: ...`, names the flag, TOML key, file or row, and
there is no traceback) and change *nothing* on disk (`--out` is not created, or keeps every
file's bytes and mtime; the database and config files are byte-identical). A resume with another
run's options must say so before any tensor is read: the checkpoint loader is replaced by one
that fails the test.

`docs/bad-input.md` publishes the counts and case names; `test_doc_counts_match_tables` keeps it
in sync with the tables below.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import NamedTuple

import pytest
from test_bad_input_api import doc_surface

from slapo.cli import main

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "16",
        "--batch-size", "2", "--steps", "1", "--no-progress", "--no-plot", "--eval-batches", "0"]

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- the "nothing written" helper ---------------------------------------------------------------
def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file under `root` with its mtime and bytes ({} when it does not exist)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    """`slapo ...` in this process: (exit status, stderr, stdout)."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.err, cap.out


def _refused(argv: list[str], capsys, watch: list[Path], rc: int, needles: tuple,
             prog: str) -> str:
    """Run `argv`: it must fail with `rc`, end stderr with one clear error line, print no
    traceback, and change no file under `watch`."""
    before = [_tree(w) if w.is_dir() or not w.exists() else w.read_bytes() for w in watch]
    code, err, out = _run(argv, capsys)
    assert code == rc, (code, err, out)
    assert "Traceback" not in err + out, err
    assert "usage:" not in err, err  # the one error line, not argparse's usage block first
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert lines, (err, out)
    last = lines[-1]
    # argparse reports extra arguments from the top-level parser ("slapo: error: ...")
    assert last.startswith((f"{prog}: error:", "slapo: error: unrecognized")), err
    for needle in needles:
        assert needle in last, f"{needle!r} not in {last!r}"
    after = [_tree(w) if w.is_dir() or not w.exists() else w.read_bytes() for w in watch]
    assert before == after, "a file was written or changed"
    return last


class CliCase(NamedTuple):
    argv: list
    needles: tuple
    rc: int = 2
    patch: object = None  # fn(monkeypatch): what the machine lacks (torchao), for this case


def _no_torchao(monkeypatch) -> None:
    """Make `import torchao` fail, as where the fp8 extra is not installed."""
    _no_module(monkeypatch, "torchao")


def _no_module(monkeypatch, top: str) -> None:
    """Make `import <top>` fail, as where the extra that installs it is not installed."""
    import sys

    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, top, None)


def _stand_in(monkeypatch, top: str) -> None:
    """An empty module in place of `top`: its import succeeds (nothing of it is used)."""
    import sys
    import types

    _no_module(monkeypatch, top)
    monkeypatch.setitem(sys.modules, top, types.ModuleType(top))


QLORA_DIR = ["--model", "{tmp}/llama", "--lora-r", "4", "--lora-4bit"]


# ---- slapo train: every flag --------------------------------------------------------------------
TRAIN_CASES: dict[str, CliCase] = {
    "steps_not_int": CliCase(["--steps", "abc"], ("--steps",)),
    "steps_zero": CliCase(["--steps", "0"], ("--steps must be >= 1",)),
    "batch_size_zero": CliCase(["--batch-size", "0"], ("--batch-size must be >= 1",)),
    "seq_len_zero": CliCase(["--seq-len", "0"], ("--seq-len must be >= 1",)),
    "hidden_size_zero": CliCase(["--hidden-size", "0"], ("--hidden-size must be >= 1",)),
    "num_layers_zero": CliCase(["--num-layers", "0"], ("--num-layers must be >= 1",)),
    "num_heads_zero": CliCase(["--num-heads", "0"], ("--num-heads must be >= 1",)),
    "hidden_not_divisible_by_heads": CliCase(["--hidden-size", "30", "--num-heads", "4"],
                                             ("--hidden-size 30", "--num-heads 4")),
    "cp_zero": CliCase(["--cp", "0"], ("--cp must be >= 1",)),
    "num_experts_zero": CliCase(["--model", "mixtral", "--num-experts", "0"],
                                ("--num-experts must be >= 1",)),
    "experts_per_token_above_experts": CliCase(
        ["--model", "qwen3_moe", "--experts-per-token", "5"],
        ("--experts-per-token 5", "--num-experts 4")),
    "num_experts_on_dense_model": CliCase(["--model", "gpt2", "--num-experts", "8"],
                                          ("--num-experts", "--model gpt2")),
    "progressive_with_moe": CliCase(["--model", "mixtral", "--progressive"],
                                    ("--progressive", "mixture of experts")),
    "ep_zero": CliCase(["--model", "mixtral", "--ep", "0"], ("--ep must be >= 1",)),
    "ep_on_dense_model": CliCase(["--model", "llama", "--ep", "2"], ("--ep 2", "--model llama")),
    "ep_not_dividing_experts": CliCase(["--model", "mixtral", "--ep", "3"],
                                       ("--ep 3 does not divide --num-experts 4",)),
    "cp_pp_with_router_loss": CliCase(["--model", "qwen3_moe", "--cp", "2", "--pp-stages", "2"],
                                      ("--cp 2 with --pp-stages 2", "auxiliary loss")),
    "ep_with_lora": CliCase(["--model", "mixtral", "--ep", "2", "--lora-r", "4"],
                            ("--ep 2 with --lora-r",)),
    "ep_above_world": CliCase(["--model", "mixtral", "--ep", "2"],
                              ("ep=2", "does not divide dp=1"), rc=1),
    "ep_with_config_only_model": CliCase(["--model", "./llama", "--ep", "2"],
                                         ("--ep 2 needs the model's weights",)),
    "cp_above_world": CliCase(["--cp", "2"], ("cp=2", "torchrun --nproc-per-node 2"), rc=1),
    "grad_accum_zero": CliCase(["--grad-accum", "0"], ("--grad-accum must be >= 1",)),
    "grad_accum_not_dividing_batch": CliCase(["--grad-accum", "3"], ("--grad-accum 3",)),
    "lr_zero": CliCase(["--lr", "0"], ("--lr must be > 0",)),
    "lr_not_a_number": CliCase(["--lr", "fast"], ("--lr",)),
    "lr_nan": CliCase(["--lr", "nan"], ("--lr must be > 0",)),
    "min_lr_ratio_above_one": CliCase(["--min-lr-ratio", "2"], ("--min-lr-ratio",)),
    "warmup_negative": CliCase(["--warmup", "-1"], ("--warmup must be >= 0",)),
    "weight_decay_negative": CliCase(["--weight-decay", "-0.1"], ("--weight-decay",)),
    "router_bias_rate_negative": CliCase(["--router-bias-rate", "-0.001"],
                                         ("--router-bias-rate must be >= 0",)),
    "router_bias_rate_without_bias": CliCase(["--model", "mixtral", "--router-bias-rate",
                                              "0.001"], ("--router-bias-rate", "--model mixtral")),
    "grad_clip_negative": CliCase(["--grad-clip", "-1"], ("--grad-clip",)),
    "optimizer_offload_with_value": CliCase(["--optimizer-offload", "yes"],
                                            ("unrecognized arguments: yes",)),
    "optimizer_offload_with_progressive": CliCase(["--optimizer-offload", "--progressive"],
                                                  ("--optimizer-offload", "--progressive",
                                                   "drop one")),
    "dropout_one": CliCase(["--dropout", "1"], ("--dropout must be in [0, 1)",)),
    "seed_not_int": CliCase(["--seed", "1.5"], ("--seed",)),
    "val_fraction_one": CliCase(["--val-fraction", "1"], ("--val-fraction",)),
    "text_field_empty": CliCase(["--text-field", ""], ("--text-field",)),
    "sft_unknown": CliCase(["--sft", "zip"], ("--sft", "'zip'")),
    "epochs_zero": CliCase(["--epochs", "0"], ("--epochs must be > 0",)),
    "keep_best_without_out": CliCase(["--keep-best"], ("--keep-best needs --out",)),
    "sft_without_data": CliCase(["--sft", "pack"], ("--sft needs --data",)),
    "save_every_negative": CliCase(["--save-every", "-1"], ("--save-every must be >= 0",)),
    "keep_last_negative": CliCase(["--keep-last", "-1"], ("--keep-last must be >= 0",)),
    "dist_timeout_zero": CliCase(["--dist-timeout", "0"], ("--dist-timeout must be > 0",)),
    "eval_batches_negative": CliCase(["--eval-batches", "-1"], ("--eval-batches must be >= 0",)),
    "eval_every_negative": CliCase(["--eval-every", "-1"], ("--eval-every must be >= 0",)),
    "eval_every_without_eval_batches": CliCase(["--eval-every", "2"],
                                               ("--eval-every needs --eval-batches",)),
    "tensorboard_with_value": CliCase(["--tensorboard", "yes"], ("unrecognized arguments: yes",)),
    "wandb_without_project": CliCase(["--wandb"], ("--wandb", "expected one argument")),
    "precision_unknown": CliCase(["--precision", "fp4"], ("--precision", "'fp4'")),
    "precision_fp8_without_torchao": CliCase(["--precision", "fp8"],
                                             ("--precision fp8", "pip install slapo[fp8]"),
                                             patch=lambda mp: _no_torchao(mp)),
    "device_unknown": CliCase(["--device", "tpu"], ("--device", "'tpu'")),
    "pp_schedule_unknown": CliCase(["--pp-schedule", "zigzag"], ("--pp-schedule",)),
    "pp_schedule_without_pipeline": CliCase(["--pp-schedule", "GPipe"],
                                            ("--pp-schedule needs --pp-stages",)),
    "dp_shard_with_value": CliCase(["--dp-shard", "yes"], ("unrecognized arguments: yes",)),
    "progress_with_value": CliCase(["--progress", "yes"], ("unrecognized arguments: yes",)),
    "unknown_flag": CliCase(["--warp", "9"], ("unrecognized arguments: --warp",)),
    "model_unknown": CliCase(["--model", "resnet"], ("unknown model 'resnet'",)),
    "model_path_missing": CliCase(["--model", "{tmp}/no_model/"], ("no_model",)),
    # ./llama/config.json in the working directory (the test runs in {tmp})
    "model_shadowed_by_local_dir": CliCase(["--model", "llama"], ("--model llama is ambiguous",
                                                                  "--model ./llama")),
    "data_missing": CliCase(["--data", "{tmp}/nope.txt"], ("nope.txt",)),
    "data_empty_file": CliCase(["--data", "{tmp}/empty.txt"], ("empty.txt", "is empty")),
    "tokenizer_missing": CliCase(["--tokenizer", "{tmp}/no_tok"], ("no_tok",)),
    "config_missing": CliCase(["--config", "{tmp}/nope.toml"], ("--config", "no such file")),
    "out_is_a_file": CliCase(["--out", "{tmp}/afile"], ("--out", "afile")),
    "progressive_with_data": CliCase(["--progressive", "--data", "{tmp}/a.txt"],
                                     ("--progressive",)),
    "resume_missing_dir": CliCase(["--resume", "{tmp}/nope"], ("--resume", "no such")),
    "resume_or_start_with_dir": CliCase(["--resume-or-start", "--resume", "{tmp}"],
                                        ("--resume-or-start",)),
    "resume_without_checkpoint": CliCase(["--resume"], ("no checkpoint in",)),
    "save_every_without_out": CliCase(["--save-every", "1", "--out", "-"],
                                      ("--save-every needs --out",)),
    "overwrite_without_out": CliCase(["--overwrite", "--out", "-"], ("--overwrite needs --out",)),
    # the schedule knobs (checked by the schema, named by their flag)
    "tp_zero": CliCase(["--tp", "0"], ("--tp: tp must be a positive int",)),
    "tp_above_world": CliCase(["--tp", "2"], ("tp=2", "torchrun --nproc-per-node 2"), rc=1),
    # the model against a degree is checked once, by the family's plan in `apply` (on the
    # job's ranks: tests/test_placement.py); one process is refused by the placement first
    "tp_not_dividing_heads": CliCase(["--tp", "2", "--num-heads", "3", "--hidden-size", "96"],
                                     ("tp=2", "torchrun --nproc-per-node 2"), rc=1),
    "ckpt_ratio_above_one": CliCase(["--ckpt-ratio", "2"], ("--ckpt-ratio",)),
    "ckpt_policy_unknown": CliCase(["--ckpt-policy", "some"], ("--ckpt-policy", "'some'")),
    "offload_ratio_above_one": CliCase(["--offload-ratio", "2"], ("--offload-ratio",)),
    "attention_unknown": CliCase(["--attention", "fast"], ("--attention", "'fast'")),
    "cp_attention_unknown": CliCase(["--cp-attention", "striped"],
                                    ("--cp-attention", "'striped'")),
    "fuse_with_value": CliCase(["--fuse", "yes"], ("unrecognized arguments: yes",)),
    "fuse_with_compile_blocks": CliCase(["--fuse", "--compile-blocks"], ("--fuse",)),
    "fuse_compiler_unknown": CliCase(["--fuse", "--fuse-compiler", "nope"],
                                     ("--fuse-compiler", "'nope'")),
    "tempo_with_value": CliCase(["--tempo", "1"], ("unrecognized arguments: 1",)),
    "pp_stages_zero": CliCase(["--pp-stages", "0"], ("--pp-stages",)),
    "pp_stages_above_layers": CliCase(["--pp-stages", "3"], ("pp=3", "torchrun"), rc=1),
    "pp_stages_above_world": CliCase(["--pp-stages", "2"], ("pp=2", "torchrun"), rc=1),
    "sequence_parallel_with_pp": CliCase(["--sequence-parallel", "--pp-stages", "2"],
                                         ("--sequence-parallel",)),
    "vocab_parallel_with_fused_loss": CliCase(["--tp", "2", "--fused-loss", "--vocab-parallel"],
                                              ("--fused-loss", "vocab_parallel=False")),
    "compile_blocks_with_value": CliCase(["--compile-blocks", "nope"],
                                         ("unrecognized arguments: nope",)),
    "kernels_with_value": CliCase(["--kernels", "on"], ("unrecognized arguments: on",)),
    # LoRA (--lora-r N wraps the model with PEFT's LoRA before scheduling)
    "lora_r_negative": CliCase(["--lora-r", "-1"], ("--lora-r must be >= 0",)),
    "lora_alpha_without_r": CliCase(["--lora-alpha", "16"], ("--lora-alpha needs --lora-r",)),
    "lora_alpha_zero": CliCase(["--lora-r", "4", "--lora-alpha", "0"],
                               ("--lora-alpha must be > 0",)),
    "lora_dropout_one": CliCase(["--lora-r", "4", "--lora-dropout", "1"],
                                ("--lora-dropout must be in [0, 1)",)),
    "lora_targets_empty": CliCase(["--lora-r", "4", "--lora-targets", ","],
                                  ("--lora-targets names no module",)),
    # found when the model is built, before anything is written (gpt2: the default --model)
    "lora_targets_match_nothing": CliCase(["--lora-r", "4", "--lora-targets", "c_attn,q_proj"],
                                          ("--lora-targets", "['q_proj'] match no module",
                                           "c_attn, c_fc, c_proj")),
    "lora_with_fuse": CliCase(["--lora-r", "4", "--fuse"], ("--fuse does not compose with "
                                                            "--lora-r",)),
    # QLoRA (--lora-4bit: the --model directory's base quantized by bitsandbytes)
    "lora_4bit_without_r": CliCase(["--lora-4bit"], ("--lora-4bit needs --lora-r",)),
    "lora_4bit_registry_model": CliCase(["--lora-r", "4", "--lora-4bit"],
                                        ("--lora-4bit quantizes", "--model gpt2",
                                         "pass --model DIR")),
    "lora_4bit_with_tp": CliCase([*QLORA_DIR, "--tp", "2"], ("--lora-4bit with --tp",
                                                             "drop --tp")),
    "lora_4bit_with_pp_stages": CliCase([*QLORA_DIR, "--pp-stages", "2"],
                                        ("--lora-4bit with --pp-stages",)),
    "lora_4bit_with_cp": CliCase([*QLORA_DIR, "--cp", "2"], ("--lora-4bit with --cp",)),
    "lora_4bit_with_dp_shard": CliCase([*QLORA_DIR, "--dp-shard"],
                                       ("--lora-4bit with --dp-shard",)),
    "lora_4bit_with_fp16": CliCase([*QLORA_DIR, "--precision", "fp16"],
                                   ("--lora-4bit with --precision fp16",
                                    "use --precision bf16 or fp32")),
    # found when the run is built, before anything is written ({tmp}/llama: config.json only;
    # a stand-in bitsandbytes module, so that the case runs where the extra is not installed)
    "lora_4bit_model_without_weights": CliCase(QLORA_DIR, ("--lora-4bit quantizes",
                                                           "no model.safetensors"),
                                               patch=lambda mp: _stand_in(mp, "bitsandbytes")),
    "lora_4bit_without_bitsandbytes": CliCase(QLORA_DIR, ("--lora-4bit", "bitsandbytes",
                                                          "pip install slapo[qlora]"),
                                              patch=lambda mp: _no_module(mp, "bitsandbytes")),
    "command_unknown": CliCase(["@trian"], ("invalid choice: 'trian'",)),
}


def _argv(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.mark.parametrize("case", list(TRAIN_CASES))
def test_train_bad_flag(case, tmp_path, capsys, monkeypatch):
    c = TRAIN_CASES[case]
    if c.patch is not None:
        c.patch(monkeypatch)
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text('{"model_type": "llama"}')
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = _argv(c.argv, tmp_path)
    if argv[0].startswith("@"):  # a command, not a flag
        argv, prog = [argv[0][1:]], "slapo"
    else:
        prog = "slapo train"
        if "--out" not in argv:
            argv = [*argv, "--out", str(out)]
        elif argv[argv.index("--out") + 1] == "-":  # a case about --out not given
            i = argv.index("--out")
            argv = argv[:i] + argv[i + 2:]
        argv = ["train", *TINY, *argv]
    _refused(argv, capsys, [tmp_path], c.rc, c.needles, prog)


def test_every_train_flag_has_a_case():
    from slapo.train.config import config_fields

    given = {a.lstrip("-").removeprefix("no-") for c in TRAIN_CASES.values() for a in c.argv
             if a.startswith("--")}
    options = {name.replace("_", "-") for name in config_fields()} | {"config"}
    missing = options - given - {"plot"}  # --plot is --progress's twin (a bool without value)
    assert not missing, f"flags without a bad-input case: {sorted(missing)}"


# ---- slapo tune: every flag ---------------------------------------------------------------------
TUNE_CASES: dict[str, CliCase] = {
    "space_unknown": CliCase(["--space", "tpu"], ("--space",)),
    "model_unknown": CliCase(["--model", "resnet"], ("no tuning space for model 'resnet'",)),
    "gpu_model_unknown": CliCase(["--space", "gpu", "--model", "gpt5"], ("no GPU model 'gpt5'",)),
    "mem_cap_gib_negative": CliCase(["--space", "gpu", "--mem-cap-gib", "-1"],
                                    ("--mem-cap-gib must be > 0",)),
    "precisions_unknown": CliCase(["--space", "gpu", "--precisions", "fp4"], ("--precisions",)),
    "precisions_fp8_without_torchao": CliCase(["--space", "gpu", "--precisions", "bf16,fp8"],
                                              ("--precisions fp8", "pip install slapo[fp8]"),
                                              patch=lambda mp: _no_torchao(mp)),
    "dry_run_cpu_space": CliCase(["--dry-run"], ("--dry-run", "--space gpu")),
    "device_unknown": CliCase(["--space", "gpu", "--device", "tpu"], ("--device", "'tpu'")),
    "efficiency_zero": CliCase(["--efficiency", "0"], ("--efficiency must be > 0",)),
    "algorithm_unknown": CliCase(["--algorithm", "magic"], ("--algorithm",)),
    "out_is_a_file": CliCase(["--out", "{tmp}/afile"], ("--out", "afile")),
    "trial_timeout_zero": CliCase(["--trial-timeout", "0"], ("--trial-timeout must be > 0",)),
    "memory_cap_unreadable": CliCase(["--memory-cap", "3X"], ("'3X'",)),
    "steps_zero": CliCase(["--steps", "0"], ("--steps must be >= 1",)),
    "warmup_negative": CliCase(["--warmup", "-1"], ("--warmup must be >= 0",)),
    "batch_sizes_not_ints": CliCase(["--batch-sizes", "2,x"], ("--batch-sizes",)),
    "batch_sizes_zero": CliCase(["--batch-sizes", "0,2"], ("--batch-sizes",)),
    "ckpt_ratios_out_of_range": CliCase(["--ckpt-ratios", "0,2"], ("--ckpt-ratios",
                                                                  "ckpt_ratio")),
    "offload_ratios_out_of_range": CliCase(["--space", "gpu", "--offload-ratios", "0,1.5"],
                                           ("--offload-ratios", "offload_ratio")),
    "attention_unknown": CliCase(["--attention", "fast"], ("--attention",)),
    "fuse_unknown": CliCase(["--fuse", "maybe"], ("--fuse",)),
    "tempo_unknown": CliCase(["--tempo", "maybe"], ("--tempo",)),
    "knob_unknown": CliCase(["--knob", "warp=1"], ("--knob", "no schedule knob")),
    "knob_bad_value": CliCase(["--knob", "kernels=maybe"], ("--knob", "kernels")),
    "knob_already_searched": CliCase(["--knob", "fuse=true"], ("already searches 'fuse'",)),
    "hidden_size_zero": CliCase(["--hidden-size", "0"], ("--hidden-size must be >= 1",)),
    "num_layers_zero": CliCase(["--num-layers", "0"], ("--num-layers must be >= 1",)),
    "num_heads_not_dividing_hidden": CliCase(["--num-heads", "5"], ("--hidden-size 768",
                                                                   "--num-heads 5")),
    "seq_len_zero": CliCase(["--seq-len", "0"], ("--seq-len must be >= 1",)),
    "threads_zero": CliCase(["--threads", "0"], ("--threads must be >= 1",)),
    "seed_not_int": CliCase(["--seed", "x"], ("--seed",)),
    "max_trials_zero": CliCase(["--max-trials", "0"], ("--max-trials must be >= 1",)),
    "kappa_negative": CliCase(["--kappa", "-1"], ("--kappa must be >= 0",)),
    "confirm_negative": CliCase(["--confirm", "-1"], ("--confirm must be >= 0",)),
    "confirm_repeats_negative": CliCase(["--confirm-repeats", "-1"],
                                        ("--confirm-repeats must be >= 0",)),
    "top_zero": CliCase(["--top", "0"], ("--top must be >= 1",)),
    "calibration_corrupt": CliCase(["--calibration", "{tmp}/bad.json"], ("bad.json",)),
    "db_not_sqlite": CliCase(["--db", "{tmp}/afile"], ("afile", "SQLite")),
    "progress_with_value": CliCase(["--progress", "yes"], ("unrecognized arguments: yes",)),
}


@pytest.mark.parametrize("case", list(TUNE_CASES))
def test_tune_bad_flag(case, tmp_path, capsys, monkeypatch):
    c = TUNE_CASES[case]
    if c.patch is not None:
        c.patch(monkeypatch)
    (tmp_path / "afile").write_text("not a directory, not a database\n")
    (tmp_path / "bad.json").write_text("{not json")
    argv = _argv(c.argv, tmp_path)
    if "--out" not in argv:
        argv = [*argv, "--out", str(tmp_path / "run")]
    _refused(["tune", "--no-progress", *argv], capsys, [tmp_path], c.rc, c.needles,
             "slapo tune")


def test_every_tune_flag_has_a_case():
    from slapo.cli import _parser

    sub = _parser()._subparsers._group_actions[0].choices["tune"]
    flags = {s.lstrip("-").removeprefix("no-") for a in sub._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"}
    given = {a.lstrip("-") for c in TUNE_CASES.values() for a in c.argv if a.startswith("--")}
    # --fuse-compiler: an unknown backend is a *failed trial* by design (the search goes on and
    # records it; tests/test_tune_cli.py relies on it), not a usage error
    given.add("fuse-compiler")
    assert flags <= given, f"tune flags without a bad-input case: {sorted(flags - given)}"


# ---- slapo prepare-data: every flag -------------------------------------------------------------
PREPARE_CASES: dict[str, CliCase] = {
    "data_missing": CliCase(["--data", "{tmp}/nope.txt"], ("nope.txt", "no such file")),
    "data_empty_file": CliCase(["--data", "{tmp}/empty.txt"], ("empty.txt", "is empty")),
    "data_not_given": CliCase(["--data", "-"], ("--data",)),
    "data_jsonl_without_field": CliCase(["--data", "{tmp}/rows.jsonl", "--text-field", "body"],
                                        ("rows.jsonl:1", "no field 'body'")),
    "data_not_utf8": CliCase(["--data", "{tmp}/latin1.txt"], ("latin1.txt", "not UTF-8")),
    "tokenizer_missing": CliCase(["--tokenizer", "{tmp}/no_tok"], ("no_tok",)),
    "tokenizer_does_not_load": CliCase(["--tokenizer", "{tmp}/bad_tok"],
                                       ("bad_tok", "AutoTokenizer cannot load it")),
    "text_field_empty": CliCase(["--text-field", ""], ("--text-field", "empty")),
    "val_fraction_one": CliCase(["--val-fraction", "1"], ("--val-fraction", "[0, 1)")),
    "val_fraction_not_a_number": CliCase(["--val-fraction", "most"], ("--val-fraction",)),
    "seed_not_int": CliCase(["--seed", "1.5"], ("--seed",)),
    "out_not_given": CliCase(["--out", "-"], ("--out",)),
    "out_is_a_file": CliCase(["--out", "{tmp}/afile"], ("afile", "is a file")),
    "out_not_empty": CliCase(["--out", "{tmp}/full"], ("full", "not empty", "--overwrite")),
    "overwrite_foreign_files": CliCase(["--out", "{tmp}/full", "--overwrite"],
                                       ("full", "does not write", "notes.md")),
    "overwrite_with_value": CliCase(["--overwrite", "yes"], ("unrecognized arguments: yes",)),
}


def _prepare_inputs(tmp: Path) -> None:
    """What the prepare-data cases point at (all under tmp, which must not change)."""
    (tmp / "afile").write_text("not a directory\n")
    (tmp / "a.txt").write_text("some text\n" * 20)
    (tmp / "rows.jsonl").write_text('{"text": "a row"}\n')
    (tmp / "empty.txt").write_text("")
    (tmp / "latin1.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1") * 10)
    (tmp / "bad_tok").mkdir()
    (tmp / "bad_tok" / "tokenizer.json").write_text("{not a tokenizer")
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.md").write_text("the user's file\n")


@pytest.mark.parametrize("case", list(PREPARE_CASES))
def test_prepare_bad_flag(case, tmp_path, capsys):
    c = PREPARE_CASES[case]
    _prepare_inputs(tmp_path)
    argv = _argv(c.argv, tmp_path)
    for flag, default in (("--data", str(tmp_path / "a.txt")), ("--out", str(tmp_path / "p"))):
        if flag not in argv:
            argv = [*argv, flag, default]
        elif argv[argv.index(flag) + 1] == "-":  # a case about the flag not given
            i = argv.index(flag)
            argv = argv[:i] + argv[i + 2:]
    _refused(["prepare-data", *argv], capsys, [tmp_path], c.rc, c.needles, "slapo prepare-data")
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_every_prepare_flag_has_a_case():
    from slapo.cli import _parser

    sub = _parser()._subparsers._group_actions[0].choices["prepare-data"]
    flags = {s for a in sub._actions for s in a.option_strings
             if s.startswith("--") and s != "--help"}
    given = {a for c in PREPARE_CASES.values() for a in c.argv if a.startswith("--")}
    assert flags <= given, f"prepare-data flags without a bad-input case: {flags - given}"


# ---- slapo train --data DIR: a damaged or mismatched prepared directory -------------------------
def _edit_meta(change):
    def edit(d: Path) -> None:
        meta = json.loads((d / "meta.json").read_text())
        change(meta)
        (d / "meta.json").write_text(json.dumps(meta))
    return edit


def _resize(name: str, delta: int):
    def resize(d: Path) -> None:
        data = (d / name).read_bytes()
        (d / name).write_bytes(data[:delta] if delta < 0 else data + b"\0" * delta)
    return resize


def _other_tokenizer(meta: dict) -> None:
    meta["tokenizer"] = {"name": "/data/tok-bpe", "kind": "hf", "vocab_size": 32000,
                         "eos_id": 2, "fingerprint": "0123456789abcdef"}


PREPARED_CASES: dict[str, tuple] = {
    "meta_missing": (lambda d: (d / "meta.json").unlink(), ("meta.json", "is missing")),
    "meta_not_json": (lambda d: (d / "meta.json").write_text("{not json"),
                      ("meta.json", "not readable JSON")),
    "meta_other_format": (_edit_meta(lambda m: m.update(format="nanogpt")),
                          ("meta.json", "not a slapo prepare-data meta.json")),
    "format_version_future": (_edit_meta(lambda m: m.update(version=99)),
                              ("meta.json", "format version 99", "newer")),
    "meta_field_missing": (_edit_meta(lambda m: m["files"]["train"].pop("tokens")),
                           ("meta.json", "damaged", "train.bin")),
    "dtype_unknown": (_edit_meta(lambda m: m.update(dtype="int8")), ("dtype 'int8'",)),
    "train_bin_truncated": (_resize("train.bin", -100), ("train.bin", "truncated")),
    "train_bin_longer": (_resize("train.bin", 2), ("train.bin", "longer than meta.json")),
    "val_bin_missing": (lambda d: (d / "val.bin").unlink(), ("val.bin", "is missing")),
    "tokenizer_mismatch": (_edit_meta(_other_tokenizer),
                           ("meta.json", "/data/tok-bpe", "pass --tokenizer /data/tok-bpe")),
}


@pytest.fixture(scope="module")
def prepared_dir(tmp_path_factory) -> Path:
    """A small prepared directory (byte tokens) that each case copies and damages."""
    from slapo.data import prepare

    root = tmp_path_factory.mktemp("prepared")
    (root / "a.txt").write_text("some text for the prepared directory\n" * 40)
    prepare(str(root / "a.txt"), root / "data", log=lambda *a: None)
    return root / "data"


@pytest.mark.parametrize("case", list(PREPARED_CASES))
def test_train_on_bad_prepared_dir(case, prepared_dir, tmp_path, capsys):
    damage, needles = PREPARED_CASES[case]
    data = tmp_path / "data"
    shutil.copytree(prepared_dir, data)
    damage(data)
    argv = ["train", *TINY, "--data", str(data), "--out", str(tmp_path / "run")]
    _refused(argv, capsys, [tmp_path], 2, needles, "slapo train")


# ---- TOML config files --------------------------------------------------------------------------
TOML_CASES: dict[str, tuple[str, tuple]] = {
    "unknown_key": ("stepz = 3", ("'stepz'",)),
    "unknown_key_in_table": ("[schedule]\nwarp = 1", ("'schedule.warp'",)),
    "unknown_key_in_nested_table": ("[run.extra]\nwarp = 1", ("'run.extra.warp'",)),
    "int_as_string": ('steps = "3"', ("steps must be int",)),
    "int_as_bool": ("steps = true", ("steps must be int",)),
    "float_as_string": ('lr = "fast"', ("lr must be float",)),
    "bool_as_int": ("fuse = 1", ("fuse must be bool",)),
    "string_as_int": ("model = 3", ("model must be str",)),
    "wrong_type_in_table": ('[schedule]\nckpt_ratio = "half"', ("schedule.ckpt_ratio",
                                                                "must be float")),
    "data_list_of_numbers": ("data = [1, 2]", ("data must be str",)),
    "option_as_table": ('[model]\nname = "gpt2"', ("model must be str",)),
    "array_of_tables": ("[[schedule]]\nfuse = true", ("unknown option 'schedule'",)),
    "same_option_in_two_tables": ("steps = 3\n[run]\nsteps = 5", ("given twice", "'run.steps'")),
    "not_toml": ("steps = [", ("not valid TOML",)),
    "value_out_of_range": ("steps = 0", ("--steps must be >= 1",)),
    "knob_out_of_domain": ('[schedule]\nattention = "fast"', ("--attention",)),
    "knob_out_of_range": ("[schedule]\nckpt-ratio = 2.0", ("--ckpt-ratio",)),
    "choice_unknown": ('precision = "fp4"', ("--precision",)),
    "conflicting_options": ("[schedule]\nfuse = true\ncompile_blocks = true", ("--fuse",)),
}


@pytest.mark.parametrize("case", list(TOML_CASES))
def test_toml_bad_config(case, tmp_path, capsys):
    text, needles = TOML_CASES[case]
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    # no size flags: a flag would override the file's value under test
    argv = ["train", "--no-progress", "--config", str(path), "--out", str(tmp_path / "run")]
    _refused(argv, capsys, [tmp_path], 2, (str(path), *needles), "slapo train")


# ---- the tuner database and its calibration cache -----------------------------------------------
def _sqlite(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    for sql in statements:
        conn.execute(sql)
    conn.commit()
    conn.close()


TRIALS = ("CREATE TABLE trials (key TEXT PRIMARY KEY, seq INTEGER, config TEXT, status TEXT, "
          "metrics TEXT, error TEXT, predicted TEXT, elapsed REAL, ts REAL)")


def _row(config: str = '{"batch_size": 2}', status: str = "ok", metrics: str = "{}") -> str:
    return (f"INSERT INTO trials VALUES ('k', 1, '{config}', '{status}', '{metrics}', '', '{{}}', "
            "0.0, 0.0)")


class _Evil:
    """A pickle that would create a file when unpickled: it must never be."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _pickled_metrics(path: Path) -> None:
    import pickle

    _sqlite(path, TRIALS)
    conn = sqlite3.connect(path)
    blob = pickle.dumps(_Evil(path.parent / "PWNED"))
    conn.execute("INSERT INTO trials VALUES ('k', 1, '{}', 'ok', ?, '', '{}', 0.0, 0.0)", (blob,))
    conn.commit()
    conn.close()


def _truncated(path: Path) -> None:
    from slapo.tune.database import Database, Record

    db = Database(path)
    for i in range(200):
        db.commit(Record({"batch_size": i, "pad": "x" * 200}, "ok", {"throughput": 1.0}))
    db.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])


DB_CASES: dict[str, tuple] = {
    "not_sqlite": (lambda p: p.write_text("key,config\n1,2\n"), ("SQLite",)),
    "truncated": (_truncated, ("SQLite",)),
    "directory": (lambda p: p.mkdir(), ("is a directory",)),
    "other_sqlite_schema": (lambda p: _sqlite(p, "CREATE TABLE runs (id INTEGER)"),
                            ("without a trials table", "runs")),
    "wrong_columns": (lambda p: _sqlite(p, "CREATE TABLE trials (key TEXT, value TEXT)"),
                      ("columns key, value",)),
    "newer_schema_version": (lambda p: _sqlite(p, TRIALS, "PRAGMA user_version = 99"),
                             ("schema version 99",)),
    "unknown_status": (lambda p: _sqlite(p, TRIALS, _row(status="pwned")),
                       ("row 'k'", "status 'pwned'")),
    "config_not_json": (lambda p: _sqlite(p, TRIALS, _row(config="{not json")),
                        ("row 'k'", "config is not a JSON object")),
    "config_not_object": (lambda p: _sqlite(p, TRIALS, _row(config="[1, 2]")),
                          ("config is not a JSON object",)),
    "pickle_in_metrics": (_pickled_metrics, ("metrics is not a JSON object",)),
    "calibration_not_json": ("{not json", ("calibration.json", "not readable JSON")),
    "calibration_not_object": ("[1, 2]", ("calibration.json", "expected a JSON object")),
    "calibration_entry_incomplete": ('{"cpu|float32": {"name": "x"}}',
                                     ("calibration.json", "'cpu|float32'")),
}


@pytest.mark.parametrize("case", list(DB_CASES))
def test_tuner_database_bad_file(case, tmp_path, capsys):
    make, needles = DB_CASES[case]
    files = tmp_path / "files"
    files.mkdir()
    if case.startswith("calibration"):
        bad = files / "calibration.json"
        bad.write_text(make)
        flags = ["--calibration", str(bad)]
    else:
        bad = files / "tune.db"
        make(bad)
        flags = ["--db", str(bad)]
    out = tmp_path / "run"
    _refused(["tune", "--no-progress", "--out", str(out), *flags], capsys, [files, out], 2,
             (str(bad), *needles), "slapo tune")
    assert not (files / "PWNED").exists()  # nothing in the file ran


def test_tuner_database_versions_and_old_files(tmp_path):
    """A new database records its schema version; an unversioned one of the same layout (an
    earlier release's) still opens and keeps its rows."""
    from slapo.tune.database import SCHEMA_VERSION, Database

    db = Database(tmp_path / "new.db")
    db.close()
    conn = sqlite3.connect(tmp_path / "new.db")
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    conn.close()
    _sqlite(tmp_path / "old.db", TRIALS, _row())
    assert [r.config for r in Database(tmp_path / "old.db").records()] == [{"batch_size": 2}]


# ---- --resume mismatches: identity before any tensor is read ------------------------------------
@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 2-step run directory with its final checkpoint."""
    out = tmp_path_factory.mktemp("saved") / "run"
    assert main(["train", *TINY, "--steps", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Reading a tensor of the checkpoint fails the test: the identity must be checked first."""
    import torch.distributed.checkpoint as dcp

    from slapo.train import run_state

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint tensor was read before the run identity was checked")

    monkeypatch.setattr(run_state, "load", refuse)
    monkeypatch.setattr(dcp, "load", refuse)


RESUME_CASES: dict[str, tuple[list, tuple]] = {
    "other_model": (["--model", "llama"], ("--model llama (checkpoint: gpt2)",)),
    "other_hidden_size": (["--hidden-size", "64"], ("--hidden-size 64 (checkpoint: 32)",)),
    "other_num_layers": (["--num-layers", "4"], ("--num-layers 4 (checkpoint: 2)",)),
    "other_num_heads": (["--num-heads", "4"], ("--num-heads 4 (checkpoint: 2)",)),
    "other_seq_len": (["--seq-len", "32"], ("--seq-len 32 (checkpoint: 16)",)),
    "other_batch_size": (["--batch-size", "4"], ("--batch-size 4 (checkpoint: 2)",)),
    "other_seed": (["--seed", "3"], ("--seed 3 (checkpoint: 0)",)),
    "other_dropout": (["--dropout", "0.1"], ("--dropout 0.1 (checkpoint: 0.0)",)),
    "other_data": (["--data", "{tmp}/a.txt"], ("--data",)),
    "other_val_fraction": (["--val-fraction", "0.2"], ("--val-fraction 0.2",)),
    "other_lora_r": (["--lora-r", "4"], ("--lora-r 4 (checkpoint: 0)",)),
    "not_a_run_dir": (["--resume", "{tmp}/empty"], ("cannot resume",)),
    "run_dir_not_checkpoint_dir": (["--resume", "{run}"], ("cannot resume",)),
    "file_not_dir": (["--resume", "{tmp}/a.txt"], ("no such checkpoint directory",)),
}


def _forge_identity(run: Path, override: str) -> None:
    """Give the checkpoint another run's option (as one written by a tp=2 job), keeping its
    checksums valid: the file is what such a job would have written."""
    from slapo.train import checkpoints

    (ckpt,) = checkpoints.candidates(run)
    trainer = ckpt / checkpoints.TRAINER_FILE
    state = json.loads(trainer.read_text())
    key, value = override.split("=")
    state["config"][key] = int(value)
    trainer.write_text(json.dumps(state))
    manifest_path = ckpt / checkpoints.MARKER
    manifest = json.loads(manifest_path.read_text())
    manifest["files"][checkpoints.TRAINER_FILE] = {"size": trainer.stat().st_size,
                                                 "sha256": checkpoints.sha256(trainer)}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_resume_mismatch(case, saved_run, tmp_path, capsys, no_tensor_reads):
    flags, needles = RESUME_CASES[case]
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    (tmp_path / "a.txt").write_text("other text\n" * 50)
    (tmp_path / "empty").mkdir()
    if flags[0].startswith("@"):
        _forge_identity(run, flags[0][1:])
        flags = []
    flags = [f.replace("{tmp}", str(tmp_path)).replace("{run}", str(run)) for f in flags]
    resume = [] if "--resume" in flags else ["--resume"]
    argv = ["train", *TINY, "--steps", "3", "--out", str(run), *resume, *flags]
    rc = 2 if case == "file_not_dir" else 1
    last = _refused(argv, capsys, [run], rc, needles, "slapo train")
    if case.startswith("other_"):
        assert "different run" in last, last


def test_resume_with_the_same_layout_spelled_out_is_the_same_run(saved_run, tmp_path, capsys):
    """`--tp 1` / `--pp-stages 1` are what a run without them did: resuming with them spelled
    out continues the run (the identity compares effective values, not spellings). Fails until
    `slapo/train/resume.py` `check_identity` compares a knob's "not given" (None) as its
    effective value (tp 1, pp_stages 1, sequence_parallel False, vocab_parallel True)."""
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    argv = ["train", *TINY, "--steps", "3", "--out", str(run), "--resume", "--tp", "1",
            "--pp-stages", "1"]
    code, err, out = _run(argv, capsys)
    assert code == 0 and "resumed from" in out, err


# ---- the published counts -----------------------------------------------------------------------
@pytest.mark.parametrize("surface,table", [
    ("CLI: slapo train", TRAIN_CASES), ("CLI: slapo tune", TUNE_CASES),
    ("CLI: slapo prepare-data", PREPARE_CASES), ("Prepared data", PREPARED_CASES),
    ("TOML config", TOML_CASES), ("Tuner database", DB_CASES), ("Resume", RESUME_CASES)])
def test_doc_counts_match_tables(surface, table):
    counts, names = doc_surface(surface)
    assert counts == [len(table)] * 4, (surface, counts, len(table))
    assert sorted(names) == sorted(table), set(names) ^ set(table)
