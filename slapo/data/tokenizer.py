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
