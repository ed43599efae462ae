"""The prepared-data disk format (`slapo prepare-data` writes it, `slapo train` maps it): names,
dtypes, and the tokenizer identity a prepared directory records and a run is checked against.

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
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .sources import InputError
from .tokenizer import ByteTokenizer

FORMAT = "slapo-prepared-tokens"
VERSION = 1
META = "meta.json"
SPLITS = ("train", "val")
DTYPES = {"uint16": ("<u2", torch.int16, 0xFFFF), "uint32": ("<u4", torch.int32, 0xFFFFFFFF)}
PROBE = ("Slapo prepares data: 3 tokens, ünïcödé, 東京, naïve café.\n\n  indented\tTAB "
         "1234567890 don't STOP <eos> [SEP]")
EOS_POLICY = ("one EOS after each document (whole text files: after its train part and after "
              "its val part), as make_data packs in memory")


def bin_path(directory: Path, split: str) -> Path:
    return directory / f"{split}.bin"


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
