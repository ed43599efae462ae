"""`slapo prepare-data`: tokenise a corpus once into the prepared-data format
(`prepared_format.py`), streaming, in bounded memory, atomically.

Decisions:
- The split is `make_data`'s, not a new streaming rule, so a prepared directory trains exactly
  like `--data SPEC` in memory (tested: identical tokens, fingerprints and losses). Whole text
  files give each file's tail to val; rows (JSONL, a saved dataset) are drawn by the same seeded
  `randperm` over the document count, which a first pass counts (and checks every JSONL line)
  without tokenising. That draw holds 9 bytes per document (not per token: 100 M documents,
  0.9 GB), the one cost that grows with the corpus; texts are never all in memory.
- A text file larger than `sources.PIECE_CHARS` characters is tokenised in pieces cut after a
  line end, and its tokens are spilled to a scratch file until its tail can be cut. Byte tokens
  are identical to tokenising the whole file; a BPE tokenizer may merge differently across the
  (line-end) cut, which is the price of bounded memory (the in-memory path cannot load such a
  file on most machines anyway).
- Written atomically: into `.OUT.partial-PID` beside `--out`, each file fsynced, `meta.json`
  last, then renamed to `--out`. A killed prepare leaves only that hidden partial directory
  (delete it), never a directory that looks valid. A non-empty `--out` is refused unless
  `overwrite`, which replaces only a directory holding nothing but a previous output's files
  (so `--out ~ --overwrite` deletes nothing).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import fsync_dir
from .dataset import val_draw
from .prepared_format import (
    DTYPES,
    EOS_POLICY,
    FORMAT,
    META,
    SPLITS,
    VERSION,
    bin_path,
    tokenizer_identity,
)
from .sources import PIECE_CHARS, DocumentStream, InputError, open_documents
from .tokenizer import load_tokenizer

FLUSH_TOKENS = 1 << 20     # a writer buffers this many tokens before writing
SPILL_TOKENS = 1 << 24     # a document longer than this goes to a scratch file (see _DocBuffer)
BATCH_DOCS = 1024          # pieces tokenised together (`encode_many`)
PROGRESS_S = 30.0          # seconds between progress lines


def _dtype_for(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 2**16 else "uint32"


class _TokenWriter:
    """Appends token ids to one .bin file, hashing what it writes (file sha256 and the stream
    fingerprint `TokenLoader` would compute), in buffered chunks."""

    def __init__(self, path: Path, dtype: str):
        self.path = path
        self.np_dtype, _, mask = DTYPES[dtype]
        self.limit = mask + 1
        self.fh = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.sha = hashlib.sha256()
        self.stream = hashlib.sha256()
        self.tokens = 0
        self.documents = 0
        self._buf: list[np.ndarray] = []
        self._buffered = 0

    def write(self, ids: list[int] | np.ndarray) -> None:
        if len(ids):
            self._buf.append(np.asarray(ids, dtype=np.int64))
            self._buffered += len(ids)
        if self._buffered >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self._buf:
            return
        ids = np.concatenate(self._buf)
        self._buf, self._buffered = [], 0
        if ids.min() < 0 or ids.max() >= self.limit:
            raise ValueError(f"token id {int(ids.max())} does not fit {self.np_dtype}: the "
                             "tokenizer returned an id outside its vocabulary")
        data = ids.astype(self.np_dtype).tobytes()
        self.fh.write(data)
        self.sha.update(data)
        self.stream.update(ids.astype("<i4").tobytes())
        self.tokens += len(ids)

    def close(self) -> dict[str, Any]:
        """Flush, fsync, close; the file's entry of meta.json."""
        self.flush()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        return {"tokens": self.tokens, "bytes": self.path.stat().st_size,
                "documents": self.documents, "sha256": self.sha.hexdigest(),
                "fingerprint": self.stream.hexdigest()[:16]}


class _DocBuffer:
    """One document's tokens until its end is seen (the tail split needs its length): in
    memory up to `SPILL_TOKENS`, then in a scratch file, so a huge text file stays bounded."""

    def __init__(self, scratch: Path, np_dtype: str):
        self.scratch = scratch
        self.np_dtype = np_dtype
        self.parts: list[np.ndarray] = []
        self.count = 0
        self.spill = None

    def add(self, ids: list[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        self.count += len(arr)
        if self.spill is None and self.count <= SPILL_TOKENS:
            self.parts.append(arr)
            return
        if self.spill is None:
            self.spill = open(self.scratch, "wb")  # noqa: SIM115 - closed in take()
            for part in self.parts:
                self.spill.write(part.astype(self.np_dtype).tobytes())
            self.parts = []
        self.spill.write(arr.astype(self.np_dtype).tobytes())

    def take(self) -> tuple[np.ndarray, int]:
        """(the document's tokens, possibly a read-only map of the scratch file; its length),
        and reset for the next document."""
        count = self.count
        if self.spill is None:
            ids = np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)
        else:
            self.spill.close()
            ids = np.memmap(self.scratch, dtype=self.np_dtype, mode="r", shape=(count,))
        self.parts, self.count, self.spill = [], 0, None
        return ids, count


def _copy(ids: np.ndarray, writer: _TokenWriter, start: int, stop: int) -> None:
    """ids[start:stop] into writer, a bounded block at a time (ids may be a map of a file)."""
    for i in range(start, stop, SPILL_TOKENS):
        writer.write(np.asarray(ids[i:min(i + SPILL_TOKENS, stop)], dtype=np.int64))


class _TailPacker:
    """Whole files: each document's first `1 - val_fraction` of tokens to train, the rest to
    val, EOS after each part (`dataset.split_by_tail`)."""

    def __init__(self, train: _TokenWriter, val: _TokenWriter, eos: list[int],
                 val_fraction: float, scratch: Path):
        self.train, self.val, self.eos, self.val_fraction = train, val, eos, val_fraction
        self.doc = _DocBuffer(scratch, train.np_dtype)

    def add(self, doc_no: int, ids: list[int], last: bool) -> None:
        self.doc.add(ids)
        if not last:
            return
        ids_all, n = self.doc.take()
        cut = int(n * (1 - self.val_fraction))
        _copy(ids_all, self.train, 0, cut)
        self.train.write(self.eos)
        self.train.documents += 1
        if self.val_fraction > 0:
            _copy(ids_all, self.val, cut, n)
            self.val.write(self.eos)
            self.val.documents += 1
        del ids_all
        self.doc.scratch.unlink(missing_ok=True)


class _RecordPacker:
    """Rows: each document whole to train or val (`is_val(doc_no)`), EOS after it
    (`dataset.split_by_record`)."""

    def __init__(self, train: _TokenWriter, val: _TokenWriter, eos: list[int],
                 is_val: Callable[[int], bool]):
        self.train, self.val, self.eos, self.is_val = train, val, eos, is_val

    def add(self, doc_no: int, ids: list[int], last: bool) -> None:
        writer = self.val if self.is_val(doc_no) else self.train
        writer.write(ids)
        if last:
            writer.write(self.eos)
            writer.documents += 1


def _feed(pieces: Iterator[tuple[int, str, bool]], tok: Any, packer: Any,
          progress: Callable[[int], None]) -> None:
    """Tokenise pieces in batches (`encode_many`: HF's fast tokenizer runs them in Rust) and
    hand each piece's ids to the packer, in order."""
    batch: list[tuple[int, str, bool]] = []
    chars = 0
    for piece in pieces:
        batch.append(piece)
        chars += len(piece[1])
        if len(batch) >= BATCH_DOCS or chars >= PIECE_CHARS:
            _encode_batch(batch, tok, packer)
            progress(batch[-1][0])
            batch, chars = [], 0
    if batch:
        _encode_batch(batch, tok, packer)


def _encode_batch(batch: list[tuple[int, str, bool]], tok: Any, packer: Any) -> None:
    for (doc_no, _, last), ids in zip(batch, tok.encode_many([t for _, t, _ in batch])):
        packer.add(doc_no, ids, last)


@dataclass
class _Plan:
    """How the stream is split: the rule recorded in meta.json and the packers to run."""

    rule: str
    is_val: torch.Tensor | None = None


def _plan(stream: DocumentStream, val_fraction: float, seed: int) -> _Plan:
    """`make_data`'s rule for this input (records: the draw needs the count: a first pass)."""
    if stream.has_val_split:
        return _Plan("dataset")
    if stream.by_record:
        return _Plan("record", val_draw(stream.count(), val_fraction, seed)
                     if val_fraction > 0 else None)
    return _Plan("tail")


def _write_streams(stream: DocumentStream, tok: Any, plan: _Plan, tmp: Path,
                   val_fraction: float, log: Callable[[str], None]) -> dict[str, Any]:
    """Tokenise and pack into tmp/train.bin and tmp/val.bin; their meta.json entries."""
    dtype = _dtype_for(tok.vocab_size)
    train, val = (_TokenWriter(bin_path(tmp, s), dtype) for s in SPLITS)
    eos = [] if tok.eos_id is None else [tok.eos_id]
    progress = _Progress(log, train, val)
    try:
        if plan.rule == "tail":
            _feed(stream.pieces(), tok, _TailPacker(train, val, eos, val_fraction,
                                                    tmp / "scratch.bin"), progress)
        else:
            mask = None if plan.is_val is None else plan.is_val.numpy()
            is_val = (lambda i: False) if mask is None else (lambda i: bool(mask[i]))
            _feed(stream.pieces(), tok, _RecordPacker(train, val, eos, is_val), progress)
            if plan.rule == "dataset":
                _feed(stream.val_pieces(), tok, _RecordPacker(train, val, eos, lambda i: True),
                      progress)
    except BaseException:
        train.fh.close()
        val.fh.close()
        raise
    return {"train": train.close(), "val": val.close()}


class _Progress:
    """A line every `PROGRESS_S` seconds: a long prepare shows it is moving."""

    def __init__(self, log: Callable[[str], None], train: _TokenWriter, val: _TokenWriter):
        self.log, self.train, self.val = log, train, val
        self.next = time.monotonic() + PROGRESS_S

    def __call__(self, doc_no: int) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + PROGRESS_S
        self.log(f"  ... {doc_no + 1:,} documents, "
                 f"{self.train.tokens + self.val.tokens:,} tokens written")


def prepare(data: str, out: str | Path, tokenizer: str | None = None, *,
            text_field: str = "text", val_fraction: float = 0.1, seed: int = 0,
            overwrite: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Stream `data` (any `--data` spec), tokenise, split and pack it into `out` (train.bin,
    val.bin, meta.json; see the module docstring); returns the meta.json content.

    Every check (paths, tokenizer, options, `out`) runs before anything is written; a failure
    while writing removes the partial directory. Raises InputError."""
    out = Path(out)
    _check_options(text_field, val_fraction, seed)
    _check_out(out, overwrite)
    tok = load_tokenizer(tokenizer)
    stream = open_documents(data, text_field)
    plan = _plan(stream, val_fraction, seed)  # counts rows (checking every JSONL line)
    created = _make_parents(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        tmp.mkdir()
        files = _write_streams(stream, tok, plan, tmp, val_fraction, log)
        meta = _meta(data, text_field, val_fraction, seed, plan.rule, tok, files)
        _write_json(tmp / META, meta)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in created:
            _rmdir_quietly(parent)
        raise
    return meta


def _check_options(text_field: str, val_fraction: float, seed: int) -> None:
    if not text_field:
        raise InputError("--text-field", "must not be empty.",
                         "pass the JSONL field / dataset column that holds the text.")
    if not 0 <= val_fraction < 1:
        raise InputError("--val-fraction", f"must be in [0, 1), got {val_fraction}.",
                         "pass e.g. 0.1 (or 0: no val split).")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InputError("--seed", f"must be an int, got {seed!r}.", "pass e.g. --seed 0.")


def _check_out(out: Path, overwrite: bool) -> None:
    """`out` is new, empty, or (with overwrite) a previous output and nothing else."""
    if out.exists() and not out.is_dir():
        raise InputError(str(out), "is a file, not a directory.",
                         "pass a new or empty directory as --out.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise InputError(str(out), "exists and is not empty.",
                         "pass a new or empty directory as --out, or --overwrite to replace a "
                         "previous slapo prepare-data output there.")
    foreign = sorted(p.name for p in out.iterdir()
                     if p.name not in {META, *(f"{s}.bin" for s in SPLITS)})
    if foreign:
        raise InputError(str(out), f"holds files slapo prepare-data does not write "
                         f"({', '.join(foreign[:5])}); --overwrite replaces only a previous "
                         "output (meta.json, train.bin, val.bin).",
                         "pass another --out, or empty the directory yourself.")


def _make_parents(out: Path) -> list[Path]:
    """Create out's missing parents; the ones created, deepest first (removed on failure)."""
    missing = [p for p in reversed(out.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    return missing[::-1]


def _rmdir_quietly(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def _publish(tmp: Path, out: Path) -> None:
    """Rename the finished directory to `out` (an empty `out` is removed first; a previous
    output is moved aside, then deleted)."""
    old = None
    if out.is_dir():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def _meta(data: str, text_field: str, val_fraction: float, seed: int, rule: str, tok: Any,
          files: dict[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "version": VERSION, "dtype": _dtype_for(tok.vocab_size),
            "byte_order": "little", "tokenizer": tokenizer_identity(tok),
            "source": {"data": data, "text_field": text_field, "piece_chars": PIECE_CHARS,
                       "documents": files["train"]["documents"] + (
                           files["val"]["documents"] if rule != "tail" else 0)},
            "split": {"rule": rule, "val_fraction": val_fraction, "seed": seed},
            "eos": {"id": tok.eos_id, "policy": EOS_POLICY},
            "files": files, "slapo_version": _version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _version() -> str | None:
    """The installed slapo's version (the package namespace itself is not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slapo")
    except PackageNotFoundError:
        return None
