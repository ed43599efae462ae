"""`slapo` command line. `slapo train --help` lists every option.

    slapo train --model gpt2 --steps 50 --out runs/gpt2
    slapo train --config run.toml --steps 100          # flags override the TOML file
    slapo train --model llama --precision bf16 --device cuda
    torchrun --nproc-per-node 2 -m slapo.cli train --tp 2 --out runs/tp2
    slapo export runs/tp2 --out exported/tp2           # a Hugging Face directory
    slapo export runs/lora --out adapters/lora --adapter   # a LoRA run: PEFT's adapter directory
    slapo eval runs/gpt2 --data notes.jsonl            # val loss and perplexity, no training
    slapo prepare-data --data 'books/*.txt' --tokenizer tok/ --out data/books
    slapo train --data data/books --tokenizer tok/     # the token files, memory-mapped

Options come from three places, later ones winning: `TrainConfig`'s defaults, the TOML file
(`--config`; keys are the option names, with `_` or `-`, in their section's table such as
`[training]` or `[schedule]`, or at top level or in any other table), then the flags given on
the command line. Each option is declared once, with its help, in `slapo/train/options.py`.

Exit status: 0 done; 2 bad input (a flag, the TOML file, a path: one `error:` line, nothing
written); 1 a failure once the run started; 128 + N when stopped by signal N (130: Ctrl-C,
143: SIGTERM), after one line naming the newest checkpoint and the command that resumes it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: never reach the Hub

class UsageError(ValueError):
    """A bad option: reported as `slapo train: error: ...` with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line: `PROG: error: MESSAGE (see PROG --help)`.

    argparse prints its whole usage block first (~50 lines for `slapo train`, one per flag),
    which buried the one line that says what is wrong; the message names the flag already.
    Sub-commands inherit the class (`add_subparsers` makes parsers of the parent's type)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _base_type(annotation: str) -> str:
    return annotation.split("|")[0].strip()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="slapo", description="Slapo: schedule, verify and train PyTorch "
                     "models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    train = sub.add_parser("train", help="train or fine-tune a language model",
                           description="Train a small model of a chosen architecture, or "
                           "fine-tune a local HF checkpoint, on the public-domain corpus "
                           "shipped with Slapo or on your text (--data, --tokenizer), with "
                           "schedule knobs. Bad paths stop with exit status 2.",
                           argument_default=argparse.SUPPRESS)
    train.add_argument("--config", metavar="FILE.toml", help="options as TOML (flags override)")
    _add_train_options(train)
    from .tune.cli import add_tune_parser  # `slapo tune` (slapo/tune/cli.py)

    add_tune_parser(sub)
    _add_export_parser(sub)
    _add_eval_parser(sub)
    _add_prepare_parser(sub)
    return parser


def _add_prepare_parser(sub: Any) -> None:
    p = sub.add_parser("prepare-data", help="tokenise a corpus once into memory-mapped token "
                       "files for slapo train --data DIR",
                       description="Stream --data (the sources slapo train --data reads), "
                       "tokenise it and write OUT/train.bin, OUT/val.bin (uint16, or uint32 "
                       "for vocabularies over 65536) and OUT/meta.json, with the split slapo "
                       "train makes in memory; then `slapo train --data OUT` maps the files "
                       "instead of reading text. Written atomically; bad input stops with exit "
                       "status 2 before anything is written.")
    p.add_argument("--data", required=True, metavar="SPEC",
                   help="the text: files, globs, directories of *.txt, .jsonl files "
                   "(comma-separated), or a dataset directory saved with `datasets` "
                   "save_to_disk")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a local AutoTokenizer directory (default: byte tokens); train with "
                   "the same one")
    p.add_argument("--text-field", default="text", metavar="F", help=_option_help("text_field"))
    p.add_argument("--val-fraction", type=float, default=0.1, metavar="X",
                   help=_option_help("val_fraction") + " (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the JSONL/dataset "
                   "val draw; train with the same --seed to match --data SPEC in memory "
                   "(default: 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="where to write (a new or "
                   "empty directory)")
    p.add_argument("--overwrite", action="store_true", help="replace a previous prepare-data "
                   "output in --out (nothing else is ever deleted)")
    p.set_defaults(func=_prepare)


def _prepare(args: argparse.Namespace) -> int:
    """`slapo prepare-data` (slapo/data/prepared.py): bad input is exit 2, nothing written."""
    from .data import InputError
    from .data.prepare_tokens import prepare

    try:
        meta = prepare(args.data, args.out, args.tokenizer, text_field=args.text_field,
                       val_fraction=args.val_fraction, seed=args.seed,
                       overwrite=args.overwrite)
    except InputError as e:
        print(f"slapo prepare-data: error: {e}", file=sys.stderr)
        return 2
    files = meta["files"]
    print(f"slapo prepare-data: {files['train']['tokens']:,} train and "
          f"{files['val']['tokens']:,} val tokens ({meta['dtype']}) from "
          f"{meta['source']['documents']:,} documents -> "
          f"{args.out}; train with: slapo train --data {args.out}"
          + (f" --tokenizer {args.tokenizer}" if args.tokenizer else ""))
    return 0


def _add_export_parser(sub: Any) -> None:
    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face directory",
                       description="Consolidate a `slapo train` checkpoint (any tp / pp / "
                       "dp-shard layout) in one process into a save_pretrained directory: "
                       "config.json, model.safetensors, the tokenizer, slapo_export.json. "
                       "AutoModel*.from_pretrained(OUT) loads it; the command checks that by "
                       "reloading it and comparing logits.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the --out directory of a slapo train run")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="where to write (new or "
                   "empty directory)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step "
                   "(default: the newest intact one)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip reloading the written directory to compare logits")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--adapter", action="store_true", help="a LoRA run (--lora-r): write "
                     "PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) "
                     "for peft.PeftModel.from_pretrained(base, HF_DIR), the base being the "
                     "run's --model directory")
    how.add_argument("--merge", action="store_true", help="a LoRA run: merge the adapters into "
                     "the base and write the whole model (AutoModel*.from_pretrained(HF_DIR))")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from .data import InputError
    from .train.checkpoints import CheckpointError
    from .train.export import export_run

    try:
        export_run(args.run_dir, args.out, step=args.step, check=args.check, force=args.force,
                   adapter=args.adapter, merge=args.merge)
    except (InputError, CheckpointError) as e:  # a bad argument; a damaged run file
        print(f"slapo export: error: {e}", file=sys.stderr)
        return 2
    return 0


def _add_eval_parser(sub: Any) -> None:
    p = sub.add_parser("eval", help="a trained model's loss and perplexity, no training",
                       description="Rebuild a `slapo train` run from its checkpoint (or a "
                       "Hugging Face model directory) and print its val loss and perplexity "
                       "on the val split of its data or of --data, computed as the run "
                       "computes its own val loss (slapo/train/evaluate.py). Nothing is "
                       "written; bad input exits with status 2.")
    p.add_argument("target", metavar="RUN_DIR|HF_DIR", help="a slapo train --out directory, "
                   "or a save_pretrained directory")
    p.add_argument("--step", type=int, default=None, help="the checkpoint of this step "
                   "(default: the newest intact one)")
    p.add_argument("--batches", dest="eval_batches", type=int, default=None,
                   help="val batches to average (default: the run's --eval-batches, else 4)")
    for name in ("data", "text_field", "tokenizer", "val_fraction", "sft", "seq_len",
                 "batch_size", "device"):
        kind = {"val_fraction": float, "seq_len": int, "batch_size": int}.get(name, str)
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None,
                       help=_option_help(name) + " (default: the run's)")
    p.set_defaults(func=_eval)


def _eval(args: argparse.Namespace) -> int:
    from .data import InputError
    from .train.checkpoints import CheckpointError
    from .train.evaluate import eval_target

    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "target",
                                                               "step")}
    try:
        eval_target(args.target, step=args.step, **given)
    except (InputError, CheckpointError, ValueError) as e:
        print(f"slapo eval: error: {e}", file=sys.stderr)
        return 2
    return 0


def _option_help(name: str) -> str:
    """An option's one help text: its field's `metadata["help"]` (`slapo.train.config`)."""
    from .train.config import option_fields

    return next(f.metadata["help"] for _, f in option_fields() if f.name == name)


def _add_train_options(train: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig option, section by section: `--name-with-dashes`, typed, with
    the field's help and choices (a schedule knob's: the schema's, `model_schedule.knobs`)."""
    from .train.config import SECTIONS, config_fields, option_fields

    types = config_fields()
    groups = {s: train.add_argument_group(f"{s} options", cls.__doc__.splitlines()[0])
              for s, cls in SECTIONS.items()}
    for section, f in option_fields():
        group, flag = groups[section], "--" + f.name.replace("_", "-")
        kind, knob, choices = _base_type(types[f.name]), section == "schedule", \
            f.metadata.get("choices")
        text = ("schedule knob: " if knob else "") + f.metadata["help"]
        text += (f" (not given: apply's default, {f.default})" if knob
                 else f" (default: {f.default})" if f.default is not None else "")
        if f.name == "resume":
            group.add_argument(flag, nargs="?", const="latest", metavar="CKPT_DIR", help=text)
        elif kind == "bool":
            group.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
        elif choices and f.metadata.get("check"):  # its own validator refuses other values
            group.add_argument(flag, metavar="{" + ",".join(choices) + "}", help=text)
        elif choices:
            group.add_argument(flag, choices=choices, help=text)
        else:
            group.add_argument(flag, type={"int": int, "float": float, "str": str}[kind],
                               metavar=f.name.upper(), help=text)


def load_toml(path: str) -> dict[str, Any]:
    """Options from a TOML file: keys at top level or in tables, `-` or `_`, type-checked."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser as the `tomli` package
        import tomli as tomllib

    from .train.config import config_fields

    try:
        with open(path, "rb") as fh:
            doc = tomllib.load(fh)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML: {e}") from None
    known = config_fields()
    flat: dict[str, Any] = {}
    where_set: dict[str, str] = {}

    def take(table: dict[str, Any], prefix: str) -> None:
        for key, value in table.items():
            name, dotted = key.replace("-", "_"), f"{prefix}{key}"
            if isinstance(value, dict) and name not in known:
                take(value, f"{dotted}.")
                continue
            if name not in known:
                raise UsageError(f"--config {path}: unknown option {dotted!r}; known: "
                                 f"{', '.join(sorted(known))}")
            if name in where_set:  # tables only group: one option, one place
                raise UsageError(f"--config {path}: {name} is given twice ({where_set[name]!r} "
                                 f"and {dotted!r}); keep one")
            if name == "data" and isinstance(value, list) and all(
                    isinstance(v, str) for v in value):
                value = ",".join(value)  # data = ["a.txt", "rows.jsonl"]
            flat[name] = _check_type(dotted, value, known[name], path)
            where_set[name] = dotted

    take(doc, "")
    return flat


def _check_type(key: str, value: Any, annotation: str, path: str) -> Any:
    """The TOML value of option `key` (dotted, as written in the file) against its type."""
    kind = _base_type(annotation)
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "str": isinstance(value, str),
          "bool": isinstance(value, bool)}[kind]
    if not ok:
        raise UsageError(f"--config {path}: {key} must be {kind}, got {value!r}")
    return float(value) if kind == "float" else value


def _name_config_file(msg: str, argv: list[str]) -> str:
    """A value check names the `--flag`; when that option came from the TOML file (not the
    command line), say which file, so the user knows where to edit."""
    if msg.startswith("--config ") or "--config" not in argv:
        return msg
    args = vars(_train_parser(_parser()).parse_args(argv))
    try:
        from_file = set(load_toml(args["config"])) - set(args)
    except UsageError:
        return msg
    named = [k for k in from_file if f"--{k.replace('_', '-')}" in msg.split(":")[0].split()]
    return f"{msg} (set in --config {args['config']})" if named else msg


def parse_train_args(argv: list[str]) -> Any:
    """TrainConfig from defaults < TOML (--config) < flags. Raises SystemExit(2) on bad flags."""
    from .train.config import TrainConfig

    args = vars(_train_parser(_parser()).parse_args(argv))  # its own errors name `slapo train`
    options = load_toml(args.pop("config")) if "config" in args else {}
    options.update(args)
    if options.get("grad_clip") == 0:
        options["grad_clip"] = None
    return TrainConfig(**options)


def _train_parser(parser: argparse.ArgumentParser) -> _Parser:
    return parser._subparsers._group_actions[0].choices["train"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `slapo` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] in ("tune", "export", "eval", "prepare-data"):
        args = parser.parse_args(argv)
        return args.func(args)
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "train":
        parser.parse_args(argv)  # prints help / the error for an unknown command and exits
        return 2
    train_parser = _train_parser(parser)
    from .train import faults, stop_signals

    faults.watch_launcher()  # under torchrun: stop if the agent dies, from the start
    try:
        cfg = parse_train_args(argv[1:])
        cfg.check()  # the values
        from .train.setup import check_inputs

        check_inputs(cfg)  # the paths and the device (an ambiguous --model too)
    except (UsageError, ValueError) as e:
        train_parser.error(_name_config_file(str(e), argv[1:]))  # exits with status 2
    from .train.loop import train

    with stop_signals.stop_signals_trapped(hint=lambda: resume_hint(cfg, argv[1:])):
        try:
            if cfg.progressive:
                from .train.demo import run_progressive

                run_progressive(cfg)
            else:
                train(cfg)
        except BaseException as e:  # noqa: BLE001 - each kind of end gets its one line
            return _train_ended(e, cfg, argv[1:], train_parser)
    return 0


def _train_ended(e: BaseException, cfg: Any, args: list[str], train_parser: _Parser) -> int:
    """The exit status (and one line) of a `slapo train` that did not finish: stopped by a
    signal (any exception it unwound with: a KeyboardInterrupt, DCP's wrapper of one, the gloo
    error of a peer that stopped first), bad input found while reading it (2), a failure (1).
    Anything else is a bug, raised with its traceback."""
    from .data import InputError
    from .errors import SlapoError
    from .train import faults, stop_signals

    why = faults.launcher_gone(faults.launcher_pid())
    if why is not None:  # e.g. a peer that saw it first and exited broke this rank's collective
        faults.launcher_lost(why)  # the cause, once per node; ends the process
    stop = stop_signals.stopped_by(e)
    if stop is not None and not isinstance(e, faults.PeerFailure):  # PeerFailure: a peer died
        if int(os.environ.get("RANK", "0")) == 0:  # one line for the job, not one per rank
            print(stopped_line(stop, cfg, args), file=sys.stderr, flush=True)
        return 128 + stop
    if isinstance(e, InputError):  # a bad --data/--tokenizer/--model found while reading it
        train_parser.error(str(e))  # exits with status 2
    if isinstance(e, (ValueError, FileNotFoundError, SlapoError)):
        print(f"slapo train: error: {e}", file=sys.stderr)
        return 1
    raise e


def stopped_line(signum: int, cfg: Any, args: list[str]) -> str:
    """`slapo train: stopped by Ctrl-C (SIGINT) in step 7; the newest checkpoint is ...;
    resume with: ...` (one line: the traceback of an interrupt says nothing a user needs)."""
    from .train import stop_signals

    name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
    where = stop_signals.phase()
    return f"slapo train: stopped by {name}{f' {where}' if where else ''}; " + resume_hint(
        cfg, args)


def resume_hint(cfg: Any, args: list[str]) -> str:
    """Where a stopped run can go on from, and the command: the newest checkpoint in --out (a
    published one: saves are atomic, so it is complete; `--resume` verifies it and falls back
    to an older one if it was damaged since) and this command with `--resume`."""
    from .train import checkpoints

    if cfg.out is None:
        return "nothing was saved (no --out); rerun the command to start over."
    newest = checkpoints.latest(Path(cfg.out))
    command = resume_command(args, newest is not None)
    if newest is None:
        return f"no checkpoint in {cfg.out} yet; start over with: {command}"
    return (f"the newest checkpoint is {newest} (step {checkpoints.step_of(newest)}); resume with: "
            f"{command}")


_RESUME_FLAGS = ("--resume-or-start", "--no-resume-or-start", "--overwrite", "--no-overwrite")


def resume_command(args: list[str], has_checkpoint: bool) -> str:
    """This `slapo train` command (`args`: its options) resuming from the newest checkpoint in
    its --out (`--resume`; `--resume-or-start` when there is none yet), under the launcher
    that started it (torchrun's command for this node's process count)."""
    kept, i = [], 0
    while i < len(args):
        a = args[i]
        if a == "--resume":  # with its optional value
            i += 1 if i + 1 < len(args) and not args[i + 1].startswith("-") else 0
        elif not (a.startswith("--resume=") or a in _RESUME_FLAGS):
            kept.append(a)
        i += 1
    kept.append("--resume" if has_checkpoint else "--resume-or-start")
    launcher = "slapo train"
    from .train.stop_signals import launched_by_torchrun

    if launched_by_torchrun():
        n = os.environ.get("LOCAL_WORLD_SIZE", "1")
        nodes = "" if os.environ.get("WORLD_SIZE", n) == n else " [your node options]"
        launcher = f"torchrun{nodes} --nproc-per-node {n} -m slapo.cli train"
    return f"{launcher} {shlex.join(kept)}"


if __name__ == "__main__":
    sys.exit(main())
