"""A byte-level tokenizer: every UTF-8 byte is a token, plus a few specials after 255.

Nothing to download or train, any text round-trips exactly, and the vocabulary (260) is small
enough that the embedding does not dominate a tiny model.
"""

from __future__ import annotations

import torch


class ByteTokenizer:
    """Bytes 0-255 are tokens 0-255; specials follow. Decoding drops the specials."""

    pad_id = 256
    bos_id = 257
    eos_id = 258
    mask_id = 259
    vocab_size = 260

    def encode(self, text: str, *, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ids + [self.eos_id] if eos else ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    name = "bytes"
    random_high = 256      # MLM's random replacements are drawn from [0, random_high)
    special_ids: tuple[int, ...] = ()  # never masked (none: keeps the shipped runs unchanged)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.model")


class HFTokenizer:
    """Any local `AutoTokenizer` directory behind the interface `slapo.data` uses.

    Documents are encoded without the tokenizer's own specials (no [CLS]/[SEP] per document):
    packing joins them with `eos_id` (the tokenizer's EOS, else its SEP, else nothing)."""

    def __init__(self, path: str):
        from .sources import InputError

        check_tokenizer_dir(path)
        try:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loader failure is a bad input
            raise InputError(path, f"AutoTokenizer cannot load it: {e}",
                             "pass a directory written by tokenizer.save_pretrained().") from None
        self.name = str(path)
        t = self.tok
        self.vocab_size = len(t)
        self.eos_id = t.eos_token_id if t.eos_token_id is not None else t.sep_token_id
        self.pad_id = t.pad_token_id if t.pad_token_id is not None else self.eos_id
        self.bos_id = t.bos_token_id
        self.mask_id = t.mask_token_id
        self.random_high = self.vocab_size
        self.special_ids = tuple(sorted(set(t.all_special_ids)))

    def encode(self, text: str, *, eos: bool = False) -> list[int]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ids + [self.eos_id] if eos and self.eos_id is not None else ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int]] = []
        for i in range(0, len(texts), 1024):  # batched: the fast tokenizer runs in Rust
            out += self.tok(texts[i:i + 1024], add_special_tokens=False)["input_ids"]
        return out

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tok.decode(ids, skip_special_tokens=True)


def check_tokenizer_dir(path: str) -> None:
    """Raise InputError unless `path` is a directory holding tokenizer files (cheap: no load)."""
    from pathlib import Path

    from .sources import InputError

    p = Path(path)
    if not p.is_dir():
        raise InputError(path, "no such tokenizer directory.",
                         "pass a local directory written by tokenizer.save_pretrained() "
                         "(nothing is downloaded), or leave --tokenizer out for byte tokens.")
    if not any((p / f).is_file() for f in TOKENIZER_FILES):
        raise InputError(path, f"holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)}).",
                         "save one there with tokenizer.save_pretrained(dir).")


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """The byte tokenizer (None: the offline default) or the AutoTokenizer in `path`."""
    return ByteTokenizer() if path is None else HFTokenizer(path)
