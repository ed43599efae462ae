"""Training data larger than memory: tokenise once to flat token files, memory-map them to train.

    slapo prepare-data --data 'books/**/*.txt' --tokenizer tok/ --out data/books   # once
    slapo train --data data/books --tokenizer tok/ ...                               # many runs

    meta = prepare("rows.jsonl", "data/rows", "tok/", text_field="body")   # the same in Python
    data = open_prepared("data/rows")       # .train / .val: MappedTokens over the .bin files

The disk format (`FORMAT`, version `VERSION`), one directory:

- `train.bin`, `val.bin`: the packed token streams, raw little-endian `uint16` when the
  tokenizer's vocabulary fits (<= 65536 ids), else `uint32` (nanoGPT's / Megatron's layout:
  `numpy.memmap(path, dtype="<u2")` reads it too). Documents are joined with the tokenizer's
  EOS (else SEP, else nothing), exactly as `make_data` packs them in memory.
- `meta.json`: format and version, dtype, per split the token count, byte size, sha256 of the
  file and the stream `fingerprint` (the same value `TokenLoader.fingerprint` computes over the
  in-memory stream), the tokenizer's identity (name, vocabulary size, EOS id and a fingerprint
  of its vocabulary and of its encoding of a probe text), the source spec, text field, split
  rule, val fraction, seed and EOS policy. Everything is computed while writing.

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

import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..files import fsync_dir
from .dataset import TokenLoader, val_draw
from .sources import PIECE_CHARS, DocumentStream, InputError, open_documents
from .tokenizer import ByteTokenizer, load_tokenizer

__all__ = ["FORMAT", "META", "VERSION", "MappedTokens", "Prepared", "PreparedLoader",
           "check_prepared", "check_tokenizer", "is_prepared", "open_prepared", "prepare",
           "prepared_dir", "read_meta", "tokenizer_identity"]

FORMAT = "slapo-prepared-tokens"
VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": ("<u2", torch.int16, 0xFFFF), "uint32": ("<u4", torch.int32, 0xFFFFFFFF)}
FLUSH_TOKENS = 1 << 20     # a writer buffers this many tokens before writing
SPILL_TOKENS = 1 << 24     # a document longer than this goes to a scratch file (see _DocBuffer)
BATCH_DOCS = 1024          # pieces tokenised together (`encode_many`)
PROGRESS_S = 30.0          # seconds between progress lines
PROBE = ("Slapo prepares data: 3 tokens, ünïcödé, 東京, naïve café.\n\n  indented\tTAB "
         "1234567890 don't STOP <eos> [SEP]")
EOS_POLICY = ("one EOS after each document (whole text files: after its train part and after "
              "its val part), as make_data packs in memory")


def _bin(directory: Path, split: str) -> Path:
    return directory / f"{split}.bin"


# ---- tokenizer identity ---------------------------------------------------------------------
def tokenizer_identity(tok: Any) -> dict[str, Any]:
    """What identifies a tokenizer across copies of its directory: vocabulary size, EOS, and a
    fingerprint of its vocabulary, special ids and encoding of `PROBE` (which catches a
    normaliser or pre-tokeniser change that keeps the vocabulary)."""
    vocab = tok.tok.get_vocab() if hasattr(tok, "tok") else None
    payload = json.dumps({"vocab": sorted(vocab.items()) if vocab is not None else None,
                          "probe": tok.encode(PROBE), "size": tok.vocab_size,
                          "eos": tok.eos_id, "special": list(tok.special_ids)})
    return {"name": tok.name, "kind": "bytes" if isinstance(tok, ByteTokenizer) else "hf",
            "vocab_size": tok.vocab_size, "eos_id": tok.eos_id,
            "fingerprint": hashlib.sha256(payload.encode()).hexdigest()[:16]}


def check_tokenizer(meta: dict[str, Any], tok: Any, directory: str | Path) -> None:
    """Raise InputError unless `tok` is the tokenizer the data was prepared with."""
    want, have = meta["tokenizer"], tokenizer_identity(tok)
    if want["fingerprint"] == have["fingerprint"]:
        return
    this = "the byte tokenizer" if have["kind"] == "bytes" else f"--tokenizer {have['name']}"
    prepared = ("the byte tokenizer (no --tokenizer)" if want["kind"] == "bytes"
                else f"the tokenizer in {want['name']}")
    fix = ("leave --tokenizer out (byte tokens)" if want["kind"] == "bytes"
           else f"pass --tokenizer {want['name']} (or a copy of it)")
    raise InputError(str(Path(directory) / META),
                     f"the data was prepared with {prepared} (vocabulary {want['vocab_size']}, "
                     f"fingerprint {want['fingerprint']}); this run uses {this} (vocabulary "
                     f"{have['vocab_size']}, fingerprint {have['fingerprint']}).",
                     f"{fix}, or prepare the data again with this tokenizer.")


# ---- writing --------------------------------------------------------------------------------
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
    train, val = (_TokenWriter(_bin(tmp, s), dtype) for s in SPLITS)
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


# ---- reading --------------------------------------------------------------------------------
def prepared_dir(spec: str | Path) -> Path | None:
    """The directory `--data spec` names if it is one prepared directory, else None.

    Prepared: it holds train.bin or val.bin (one without a readable meta.json is a broken
    output, which `check_prepared` reports), or a meta.json that names `FORMAT`. A directory of
    text files with some other meta.json stays a text directory."""
    entries = [e.strip() for e in str(spec).split(",") if e.strip()]
    if len(entries) != 1 or not Path(entries[0]).is_dir():
        return None
    path = Path(entries[0])
    if any(_bin(path, s).is_file() for s in SPLITS):
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
        path, tokens = _bin(directory, split), meta["files"][split]["tokens"]
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
    train, val = (MappedTokens(_bin(directory, s), meta["files"][s]["tokens"], meta["dtype"])
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
