"""The user's text for `slapo train --data`: text files, globs, JSONL, or a saved HF dataset.

    read_documents("notes/*.txt")                    # every match, sorted: one document each
    read_documents("a.txt,b.md")                     # a comma-separated list of entries
    read_documents("rows.jsonl", text_field="body")  # one document per JSON line
    read_documents("saved_ds/")                      # `datasets.Dataset.save_to_disk` output

Decisions (the issue is silent on them):
- Text files and JSONL are read with the standard library, not `datasets.load_dataset`: that
  needs `datasets` for the plainest input and writes Arrow cache files under ~/.cache for every
  new file. `datasets` (optional, the `hf` extra, imported only here) is used for what only it
  can read: a directory written by `save_to_disk` (recognised by its `dataset_info.json` or
  `dataset_dict.json`); `load_from_disk` memory-maps it, nothing is downloaded or written.
- A plain directory means its `*.txt` files (recursively, sorted).
- A `DatasetDict` trains on its `train` split and validates on `validation` / `val` / `test`
  when one exists (the dataset's own split wins over `--val-fraction`).
- Every problem is an `InputError` naming the path and the fix, raised while reading, so a bad
  `--data` stops the run before anything is written.
"""

from __future__ import annotations

import glob
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SchedulingError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
VAL_SPLITS = ("validation", "val", "test")


class InputError(SchedulingError, ValueError):
    """A bad `--data`, `--tokenizer` or `--model` path (`slapo train` exits with status 2)."""


@dataclass
class Documents:
    """The texts to train on, in a fixed order, and how to split them.

    `by_record`: many small documents (JSONL rows, dataset rows), split into train/val by
    document; otherwise (whole files) each document's tail is the val part. `val`: a
    validation split the data brought with it (a DatasetDict's), or None."""

    texts: list[str]
    source: str
    by_record: bool = False
    val: list[str] | None = None
    files: list[str] = field(default_factory=list)


def read_documents(spec: str, text_field: str = "text") -> Documents:
    """Every document `spec` names (see the module docstring); raises InputError."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise InputError("--data", "no data given.", "pass --data FILE, a glob, a .jsonl file "
                         "or a dataset directory saved with `datasets`.")
    if len(entries) == 1 and is_saved_dataset(Path(entries[0])):
        return _read_saved_dataset(Path(entries[0]), text_field)
    files = [f for e in entries for f in _expand(e)]
    texts: list[str] = []
    by_record = False
    for f in files:
        if f.suffix.lower() in JSONL_SUFFIXES:
            texts += _read_jsonl(f, text_field)
            by_record = True
        else:
            texts.append(_read_text(f))
    return Documents(texts, spec, by_record=by_record, files=[str(f) for f in files])


def is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / n).is_file() for n in
                                 ("dataset_info.json", "dataset_dict.json", "state.json"))


def _expand(entry: str) -> list[Path]:
    """A file, a directory (its *.txt files) or a glob, as sorted existing files."""
    path = Path(entry)
    if glob.has_magic(entry):
        found = sorted(Path(p) for p in glob.glob(entry, recursive=True) if Path(p).is_file())
        if not found:
            raise InputError(entry, "the glob matches no file.",
                             "check the pattern (quote it so the shell does not expand it).")
        return found
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not found:
            raise InputError(entry, "the directory holds no *.txt file and is not a dataset "
                             "saved with `datasets` (no dataset_info.json).",
                             f"pass a glob such as '{entry}/*.md', or the files themselves.")
        return found
    if not path.is_file():
        raise InputError(entry, "no such file or directory.",
                         "pass an existing text file, glob, .jsonl file or saved dataset.")
    return [path]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(str(path), f"not UTF-8 text ({e}).",
                         "convert it to UTF-8, or leave it out of --data.") from None


def _read_jsonl(path: Path, text_field: str) -> list[str]:
    """The `text_field` string of every non-empty line."""
    out = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}", f"not a JSON line ({e}).",
                             "write one JSON object per line (JSONL).") from None
        if not isinstance(row, dict) or text_field not in row:
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise InputError(f"{path}:{n}", f"no field {text_field!r} (has: {keys}).",
                             "pass --text-field NAME with the field that holds the text.")
        if not isinstance(row[text_field], str):
            raise InputError(f"{path}:{n}", f"field {text_field!r} is "
                             f"{type(row[text_field]).__name__}, not text.",
                             "pass --text-field NAME with a string field.")
        out.append(row[text_field])
    if not out:
        raise InputError(str(path), "holds no JSON line.", "check the file.")
    return out


def _read_saved_dataset(path: Path, text_field: str) -> Documents:
    try:
        import datasets
    except ImportError:
        raise InputError(str(path), "is a dataset saved with `datasets`, which is not "
                         "installed.", "pip install 'slapo[hf]' (or datasets).") from None
    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - any loader failure is a bad input
        raise InputError(str(path), f"cannot be loaded with datasets.load_from_disk: {e}",
                         "pass the directory that save_to_disk wrote.") from None
    val = None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise InputError(str(path), f"the DatasetDict has no 'train' split (has: "
                             f"{', '.join(ds)}).", "save the training split as 'train'.")
        name = next((s for s in VAL_SPLITS if s in ds), None)
        val = _column(ds[name], text_field, f"{path}[{name}]") if name else None
        ds = ds["train"]
    return Documents(_column(ds, text_field, str(path)), str(path), by_record=True, val=val)


def _column(ds, text_field: str, where: str) -> list[str]:
    if text_field not in ds.column_names:
        raise InputError(where, f"no column {text_field!r} (has: "
                         f"{', '.join(ds.column_names)}).",
                         "pass --text-field NAME with the column that holds the text.")
    texts = ds[text_field]
    texts = list(texts) if not isinstance(texts, list) else texts
    if texts and not isinstance(texts[0], str):
        raise InputError(where, f"column {text_field!r} holds {type(texts[0]).__name__}, not "
                         "text.", "pass --text-field NAME with a string column.")
    return texts
