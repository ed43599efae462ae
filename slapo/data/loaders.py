"""From `--data/--text-field/--tokenizer/--val-fraction` to the train loader and val tokens.

    data = make_data("causal", 64, seed=0, data="notes/*.txt", tokenizer="tok_dir")
    batch = data.train.next_batch(8)          # {"input_ids", "labels"}: packed seq_len blocks
    val = data.val_loader()                   # a fresh loader over the val tokens (or None)

Without `data` the shipped corpus is used, and with the byte tokenizer and the default
val fraction the streams are exactly those of `CorpusLoader` (the demo and tests unchanged).

`data` naming a directory written by `slapo prepare-data` (`prepared.is_prepared`) maps its
token files instead of reading text: the same loader over `MappedTokens`, the split fixed when
it was prepared (`val_fraction` and `text_field` do not apply), the tokenizer checked against
the one it was prepared with.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .dataset import TokenLoader, load_corpus, split_by_record, split_by_tail
from .prepared import MappedTokens, PreparedLoader, open_prepared, prepared_dir
from .sources import read_documents
from .tokenizer import load_tokenizer


@dataclass
class Data:
    train: TokenLoader
    val_tokens: torch.Tensor | MappedTokens
    tokenizer: Any
    source: str
    task: str
    seq_len: int
    seed: int

    def val_loader(self) -> TokenLoader | None:
        """A loader over the val split from its start (the same batches at every eval), or
        None when the split is too small for one block (reported by the caller)."""
        try:
            return TokenLoader(self.task, self.seq_len, self.val_tokens, self.tokenizer,
                               self.seed, what="the val split")
        except ValueError:
            return None


def make_data(task: str, seq_len: int, seed: int = 0, *, data: str | None = None,
              text_field: str = "text", tokenizer: str | None = None,
              val_fraction: float = 0.1) -> Data:
    """Read, tokenize, split and pack; raises InputError for a bad path or field."""
    tok = load_tokenizer(tokenizer)
    if data is not None and prepared_dir(data) is not None:
        return _prepared_data(task, seq_len, seed, data, tok, val_fraction=val_fraction,
                              text_field=text_field)
    if data is None:
        texts = load_corpus()
        train, val = split_by_tail([texts[n] for n in sorted(texts)], tok, val_fraction)
        source = "the shipped corpus"
    else:
        docs = read_documents(data, text_field)
        if docs.by_record or docs.val is not None:
            train, val = split_by_record(docs.texts, tok, val_fraction, seed, docs.val)
        else:
            train, val = split_by_tail(docs.texts, tok, val_fraction)
        source = data
    loader = TokenLoader(task, seq_len, train, tok, seed, what=f"the train split of {source}")
    return Data(loader, val, tok, source, task, seq_len, seed)


def _prepared_data(task: str, seq_len: int, seed: int, data: str, tok: Any, *,
                   val_fraction: float = 0.1, text_field: str = "text") -> Data:
    """A `slapo prepare-data` directory, mapped (see `prepared`); InputError if it is damaged
    or was prepared with another tokenizer. The split was fixed when preparing: a
    `--val-fraction` or `--text-field` other than the prepared one is ignored, with a warning
    (silently training on another split than asked would be worse)."""
    prepared = open_prepared(prepared_dir(data), tok)
    _warn_ignored(data, prepared.meta, val_fraction=val_fraction, text_field=text_field)
    loader = PreparedLoader(task, seq_len, prepared.train, tok, seed,
                            what=f"the train split of {data}",
                            fingerprint=prepared.fingerprint("train"))
    return Data(loader, prepared.val, tok, data, task, seq_len, seed)


def _warn_ignored(data: str, meta: dict, *, val_fraction: float, text_field: str) -> None:
    """Warn for a value that differs from both the prepared one and the default (a default is
    what the user did not ask for: no warning on every run of a directory prepared with
    another fraction)."""
    split, source = meta.get("split", {}), meta.get("source", {})
    asked = {"--val-fraction": (val_fraction, split.get("val_fraction"), 0.1),
             "--text-field": (text_field, source.get("text_field"), "text")}
    for flag, (value, prepared, default) in asked.items():
        if prepared is not None and value not in (prepared, default):
            warnings.warn(f"{data}: {flag} {value!r} is ignored: this directory was prepared with "
                          f"{prepared!r} (slapo prepare-data fixes the split); prepare again to "
                          "change it.", stacklevel=3)
