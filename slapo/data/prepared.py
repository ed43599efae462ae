"""Training data larger than memory: tokenise once to flat token files, memory-map them to train.

    slapo prepare-data --data 'books/**/*.txt' --tokenizer tok/ --out data/books   # once
    slapo train --data data/books --tokenizer tok/ ...                               # many runs

    meta = prepare("rows.jsonl", "data/rows", "tok/", text_field="body")   # the same in Python
    data = open_prepared("data/rows")       # .train / .val: MappedTokens over the .bin files

The disk format: `prepared_format.py`; writing it (`prepare`): `prepare_tokens.py`. Reading it:

- Training maps the files read-only and copy-free (`torch.from_file`, a private mapping: every
  rank maps the same file and the OS page cache holds it once); batches are gathered from the
  map by the existing `BlockSampler`, so resume stays bit-exact. The stream is viewed as the
  signed type of the same width and widened with a mask (`MappedTokens`), because indexing
  unsigned tensors is not implemented in every supported torch. The run's data fingerprint is
  read from `meta.json` (hashing a 100 GB file at start would take minutes); the start-up check
  compares each file's size with `meta.json` (a truncated copy is refused), not its hash.
- With a prepared directory the split is fixed: `--val-fraction` and `--text-field` of
  `slapo train` do not apply (meta.json holds the ones used); `--tokenizer` must be the one
  the data was prepared with (compared by fingerprint, so a copy of the directory is fine).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .dataset import TokenLoader
from .prepared_format import DTYPES, FORMAT, META, SPLITS, VERSION, bin_path, check_tokenizer
from .sources import InputError

__all__ = ["MappedTokens", "Prepared", "PreparedLoader", "check_prepared", "is_prepared",
           "open_prepared", "prepared_dir", "read_meta"]


def prepared_dir(spec: str | Path) -> Path | None:
    """The directory `--data spec` names if it is one prepared directory, else None.

    Prepared: it holds train.bin or val.bin (one without a readable meta.json is a broken
    output, which `check_prepared` reports), or a meta.json that names `FORMAT`. A directory of
    text files with some other meta.json stays a text directory."""
    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if len(entries) != 1 or not Path(entries[0]).is_dir():
        return None
    path = Path(entries[0])
    if any(bin_path(path, s).is_file() for s in SPLITS):
        return path
    return path if _names_format(path / META) else None


def _names_format(meta: Path) -> bool:
    """Does the start of this meta.json name our format (cheap: no full parse)?"""
    try:
        with open(meta, "rb") as fh:
            return FORMAT.encode() in fh.read(4096)
    except OSError:
        return False


def is_prepared(spec: str | Path) -> bool:
    """Does `--data spec` name a `slapo prepare-data` directory (see `prepared_dir`)?"""
    return prepared_dir(spec) is not None


def _corrupt(path: Path, problem: str, meta: dict[str, Any] | None = None) -> InputError:
    source = meta.get("source") if isinstance(meta, dict) else None
    spec = source.get("data") if isinstance(source, dict) else None
    data = f"--data '{spec}'" if isinstance(spec, str) else "(with the original --data)"
    return InputError(str(path), problem, f"prepare the data again: slapo prepare-data "
                      f"--out {path.parent} --overwrite {data}.")


def read_meta(directory: str | Path) -> dict[str, Any]:
    """meta.json of a prepared directory, checked (format, version, fields); InputError."""
    path = Path(directory) / META
    if not path.is_file():
        raise InputError(str(path), "is missing: the directory is not a finished slapo "
                         "prepare-data output (a killed prepare leaves no meta.json).",
                         f"run slapo prepare-data --out {Path(directory)} --overwrite again.")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"is not readable JSON ({e}).") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _corrupt(path, f"is not a slapo prepare-data meta.json (format "
                       f"{meta.get('format') if isinstance(meta, dict) else None!r}, "
                       f"expected {FORMAT!r}).")
    version = meta.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise InputError(str(path), f"has format version {version}, newer than this Slapo "
                         f"reads ({VERSION}).", "upgrade slapo, or prepare the data again "
                         "with this version.")
    _check_fields(meta, path)
    return meta


def _check_fields(meta: dict[str, Any], path: Path) -> None:
    """The fields the loader reads, with their types."""
    def bad(what: str) -> InputError:
        return _corrupt(path, f"is damaged: {what}.")

    if meta.get("version") != VERSION:
        raise bad(f"version {meta.get('version')!r} is not {VERSION}")
    if meta.get("dtype") not in DTYPES:
        raise bad(f"dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    tok = meta.get("tokenizer")
    if not (isinstance(tok, dict) and isinstance(tok.get("fingerprint"), str)):
        raise bad("no tokenizer fingerprint")
    files = meta.get("files")
    for split in SPLITS:
        entry = files.get(split) if isinstance(files, dict) else None
        if not (isinstance(entry, dict) and _count(entry.get("tokens"))
                and isinstance(entry.get("fingerprint"), str)):
            raise bad(f"no token count and fingerprint for {split}.bin")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_prepared(directory: str | Path) -> dict[str, Any]:
    """meta.json checked, and each .bin file's size against it (cheap: no file is read);
    returns the meta. Raises InputError."""
    directory = Path(directory)
    meta = read_meta(directory)
    itemsize = np.dtype(DTYPES[meta["dtype"]][0]).itemsize
    for split in SPLITS:
        path, tokens = bin_path(directory, split), meta["files"][split]["tokens"]
        if not path.is_file():
            raise _corrupt(path, f"is missing (meta.json lists {tokens:,} {split} tokens).",
                           meta)
        size, want = path.stat().st_size, tokens * itemsize
        if size != want:
            what = "truncated" if size < want else "longer than meta.json says"
            raise _corrupt(path, f"is {what}: {size:,} bytes, meta.json says {tokens:,} "
                           f"{meta['dtype']} tokens ({want:,} bytes).", meta)
    return meta


class MappedTokens:
    """A token stream in a .bin file, mapped read-only and never copied: what `TokenLoader`
    needs of a token tensor (`len`, and `tokens[index]` as int64 ids).

    `mapped` is the torch tensor over the file's pages (`torch.from_file`, a private
    mapping: nothing is written back). It has the signed type of the file's width; indexing
    widens to int64 and masks, so ids >= 2**15 in a uint16 file come out right."""

    def __init__(self, path: Path, tokens: int, dtype: str):
        _, signed, self.mask = DTYPES[dtype]
        self.path = path
        self.dtype = dtype
        self.mapped = (torch.from_file(str(path), shared=False, size=tokens, dtype=signed)
                       if tokens else torch.zeros(0, dtype=signed))

    def __len__(self) -> int:
        return self.mapped.numel()

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.mapped[index].long() & self.mask

    def __repr__(self) -> str:
        return f"MappedTokens({self.path}, {len(self):,} {self.dtype} tokens)"


@dataclass
class Prepared:
    """A prepared directory opened for training: its meta and the mapped streams."""

    directory: Path
    meta: dict[str, Any]
    train: MappedTokens
    val: MappedTokens

    def fingerprint(self, split: str = "train") -> str:
        return self.meta["files"][split]["fingerprint"]


def open_prepared(directory: str | Path, tokenizer: Any = None) -> Prepared:
    """Check and map a prepared directory; with `tokenizer`, refuse one other than the data's
    (InputError, before anything is trained)."""
    if sys.byteorder != "little":
        raise InputError(str(directory), "prepared token files are little-endian; this "
                         "machine is big-endian.", "train on a little-endian machine.")
    directory = Path(directory)
    meta = check_prepared(directory)
    if tokenizer is not None:
        check_tokenizer(meta, tokenizer, directory)
    train, val = (MappedTokens(bin_path(directory, s), meta["files"][s]["tokens"], meta["dtype"])
                  for s in SPLITS)
    return Prepared(directory, meta, train, val)


class PreparedLoader(TokenLoader):
    """`TokenLoader` over a mapped stream whose fingerprint comes from meta.json (computed
    while the file was written), not from hashing the whole stream at start."""

    def __init__(self, *args: Any, fingerprint: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._meta_fingerprint = fingerprint

    @property
    def fingerprint(self) -> str:
        return self._meta_fingerprint
