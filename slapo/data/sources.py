"""The user's text for `slapo train --data`: text files, globs, JSONL, or a saved HF dataset.

    read_documents("notes/*.txt")                    # every match, sorted: one document each
    read_documents("a.txt,b.md")                     # a comma-separated list of entries
    read_documents("rows.jsonl", text_field="body")  # one document per JSON line
    read_documents("saved_ds/")                      # `datasets.Dataset.save_to_disk` output

    stream = open_documents("books/")                # the same documents, never all in memory
    for doc_no, text, last in stream.pieces(): ...  # `slapo prepare-data` (slapo/data/prepared)

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
- One reader for both paths: `read_documents` (in memory, `make_data`) collects what
  `DocumentStream.pieces` yields, so a prepared dataset and `--data SPEC` see the same documents
  in the same order. The stream reads a text file in pieces of at most `PIECE_CHARS` characters
  cut after a line end (a smaller file is one piece: its whole text), JSONL line by line and a
  saved dataset in batches of rows, so memory is bounded by a piece, not by the corpus.
- JSONL lines are the file's lines (`\\n`, `\\r\\n` or `\\r`), not `str.splitlines` (which also
  splits at U+2028 and other separators that JSON allows inside a string).
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SchedulingError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
VAL_SPLITS = ("validation", "val", "test")
PIECE_CHARS = 2**21  # characters: a text file is read and tokenised in pieces of this size
ROW_BATCH = 1024         # rows of a saved dataset read at a time


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


# (document number, text, last piece of that document?)
Piece = tuple[int, str, bool]


@dataclass
class DocumentStream:
    """The documents a `--data` spec names, read lazily and in order (`open_documents`).

    `pieces()` yields `(doc_no, text, last)`: a document is the run of pieces with one doc_no
    (a text file larger than `PIECE_CHARS` spans several; a row is one piece). `val_pieces()`
    does the same for the validation split the data brought (a DatasetDict's), if any."""

    source: str
    text_field: str = "text"
    files: list[Path] = field(default_factory=list)
    by_record: bool = False
    dataset: Any = None       # the saved dataset's train split (a `datasets.Dataset`)
    val_dataset: Any = None   # its own validation split, or None
    where: str = ""           # how errors name the dataset (its path)
    val_where: str = ""

    @property
    def has_val_split(self) -> bool:
        return self.val_dataset is not None

    def pieces(self) -> Iterator[Piece]:
        if self.dataset is not None:
            yield from _dataset_pieces(self.dataset, self.text_field, self.where)
            return
        doc_no = 0
        for path in self.files:
            if path.suffix.lower() in JSONL_SUFFIXES:
                for text in _jsonl_rows(path, self.text_field):
                    yield doc_no, text, True
                    doc_no += 1
            else:
                for text, last in _text_pieces(path):
                    yield doc_no, text, last
                doc_no += 1

    def val_pieces(self) -> Iterator[Piece]:
        if self.val_dataset is not None:
            yield from _dataset_pieces(self.val_dataset, self.text_field, self.val_where)

    def count(self) -> int:
        """How many documents `pieces()` yields, without tokenising (a JSONL file is read and
        every line checked: a bad line stops here, before any work is written)."""
        if self.dataset is not None:
            return len(self.dataset)
        total = 0
        for path in self.files:
            if path.suffix.lower() in JSONL_SUFFIXES:
                total += sum(1 for _ in _jsonl_rows(path, self.text_field))
            else:
                total += 1
        return total


def open_documents(spec: str, text_field: str = "text") -> DocumentStream:
    """The stream of every document `spec` names; the paths are resolved (and a saved dataset
    opened, memory-mapped) now, the texts read when iterated. Raises InputError."""
    entries = [e.strip() for e in spec.split(",") if e.strip()]
    if not entries:
        raise InputError("--data", "no data given.", "pass --data FILE, a glob, a .jsonl file "
                         "or a dataset directory saved with `datasets`.")
    if len(entries) == 1 and is_saved_dataset(Path(entries[0])):
        return _open_saved_dataset(Path(entries[0]), text_field)
    files = [f for e in entries for f in _expand(e)]
    by_record = any(f.suffix.lower() in JSONL_SUFFIXES for f in files)
    return DocumentStream(spec, text_field, files, by_record)


def read_documents(spec: str, text_field: str = "text") -> Documents:
    """Every document `spec` names, in memory (see the module docstring); raises InputError."""
    stream = open_documents(spec, text_field)
    val = _join(stream.val_pieces()) if stream.has_val_split else None
    return Documents(_join(stream.pieces()), spec, by_record=stream.by_record, val=val,
                     files=[str(f) for f in stream.files])


def _join(pieces: Iterator[Piece]) -> list[str]:
    """Whole documents from their pieces."""
    texts: list[str] = []
    parts: list[str] = []
    for _, text, last in pieces:
        parts.append(text)
        if last:
            texts.append("".join(parts))
            parts = []
    return texts


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
        return _not_all_empty(entry, found)
    if path.is_dir():
        found = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not found:
            raise InputError(entry, "the directory holds no *.txt file and is not a dataset "
                             "saved with `datasets` (no dataset_info.json).",
                             f"pass a glob such as '{entry}/*.md', or the files themselves.")
        return _not_all_empty(entry, found)
    if not path.is_file():
        raise InputError(entry, "no such file or directory.",
                         "pass an existing text file, glob, .jsonl file or saved dataset.")
    return _not_all_empty(entry, [path])


def _not_all_empty(entry: str, files: list[Path]) -> list[Path]:
    """`files`, unless every one is empty (0 bytes): then the entry gives nothing to train on,
    which is bad input (exit status 2, before anything is written), not a failure found later
    as "too few tokens"."""
    if all(f.stat().st_size == 0 for f in files):
        what = ("the file is empty (0 bytes)" if files == [Path(entry)] else
                f"every file it names is empty (0 bytes: {', '.join(map(str, files[:3]))}"
                f"{', ...' if len(files) > 3 else ''})")
        raise InputError(entry, f"{what}: there is no text to train on.",
                         "pass a file that holds text, or leave it out of --data.")
    return files


def _not_utf8(path: Path, e: UnicodeDecodeError) -> InputError:
    return InputError(str(path), f"not UTF-8 text ({e}).",
                      "convert it to UTF-8, or leave it out of --data.")


def _text_pieces(path: Path, size: int | None = None) -> Iterator[tuple[str, bool]]:
    """(piece, last) of a text file: pieces of about `size` characters, each cut after a line
    end (a line longer than `size` is cut inside), newlines translated as `Path.read_text`
    does; an empty file is one empty piece. The concatenation is the file's text."""
    size = size or PIECE_CHARS
    try:
        with open(path, encoding="utf-8") as fh:
            current = _next_piece(fh, size)
            while True:
                following = _next_piece(fh, size)
                yield current, not following
                if not following:
                    return
                current = following
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None


def _next_piece(fh, size: int) -> str:
    piece = fh.read(size)
    if piece and not piece.endswith("\n"):
        piece += fh.readline(size)  # finish the line (a longer one is cut at 2 x size)
    return piece


def _jsonl_rows(path: Path, text_field: str) -> Iterator[str]:
    """The `text_field` string of every non-empty line, one line in memory at a time."""
    count = 0
    try:
        with open(path, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if line.strip():
                    count += 1
                    yield _row_text(line, text_field, f"{path}:{n}")
    except UnicodeDecodeError as e:
        raise _not_utf8(path, e) from None
    if not count:
        raise InputError(str(path), "holds no JSON line.", "check the file.")


def _row_text(line: str, text_field: str, where: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise InputError(where, f"not a JSON line ({e}).",
                         "write one JSON object per line (JSONL).") from None
    if not isinstance(row, dict) or text_field not in row:
        keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
        raise InputError(where, f"no field {text_field!r} (has: {keys}).",
                         "pass --text-field NAME with the field that holds the text.")
    if not isinstance(row[text_field], str):
        raise InputError(where, f"field {text_field!r} is "
                         f"{type(row[text_field]).__name__}, not text.",
                         "pass --text-field NAME with a string field.")
    return row[text_field]


def load_saved_dataset(path: Path):
    """`datasets.load_from_disk(path)` (a Dataset, or a DatasetDict with a 'train' split);
    InputError when `datasets` is missing, the directory does not load, or 'train' is absent.
    Text documents and SFT rows (`sft.read_sft_rows`) read saved datasets through it."""
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
    if isinstance(ds, datasets.DatasetDict) and "train" not in ds:
        raise InputError(str(path), f"the DatasetDict has no 'train' split (has: "
                         f"{', '.join(ds)}).", "save the training split as 'train'.")
    return ds


def _open_saved_dataset(path: Path, text_field: str) -> DocumentStream:
    import datasets

    ds = load_saved_dataset(path)
    val, val_where = None, ""
    if isinstance(ds, datasets.DatasetDict):
        name = next((s for s in VAL_SPLITS if s in ds), None)
        if name:
            val, val_where = _check_column(ds[name], text_field, f"{path}[{name}]"), \
                f"{path}[{name}]"
        ds = ds["train"]
    return DocumentStream(str(path), text_field, by_record=True,
                          dataset=_check_column(ds, text_field, str(path)), val_dataset=val,
                          where=str(path), val_where=val_where)


def _check_column(ds, text_field: str, where: str):
    if text_field not in ds.column_names:
        raise InputError(where, f"no column {text_field!r} (has: "
                         f"{', '.join(ds.column_names)}).",
                         "pass --text-field NAME with the column that holds the text.")
    return ds.select_columns([text_field])


def _dataset_pieces(ds, text_field: str, where: str) -> Iterator[Piece]:
    """Rows in batches of `ROW_BATCH` (the Arrow table stays memory-mapped)."""
    doc_no = 0
    for batch in ds.iter(batch_size=ROW_BATCH):
        for text in batch[text_field]:
            if not isinstance(text, str):
                raise InputError(where, f"column {text_field!r} holds "
                                 f"{type(text).__name__} (row {doc_no}), not text.",
                                 "pass --text-field NAME with a string column.")
            yield doc_no, text, True
            doc_no += 1
