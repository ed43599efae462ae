"""A user's data for the data tests, built from the shipped corpus: a small BPE tokenizer saved
as a Hugging Face directory, and text files plus a JSONL of paragraphs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from slapo.data import load_corpus

SPECIAL = ["[PAD]", "[UNK]", "[BOS]", "[EOS]", "[MASK]"]


def bpe_tokenizer(out: Path, texts: Iterable[str], vocab_size: int) -> Path:
    """Train a byte-level BPE on `texts` and save it as a fast tokenizer directory in `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[BOS]", eos_token="[EOS]", mask_token="[MASK]")
    fast.save_pretrained(out)
    return out


def user_files(out: Path, names: Iterable[str]) -> Path:
    """The corpus files `names` as .txt files in `out`, and `paras.jsonl`: every paragraph of
    the corpus longer than 40 characters as {"id", "body"}."""
    texts = load_corpus()
    for name in names:
        (out / name).write_text(texts[name], encoding="utf-8")
    paras = [p for t in texts.values() for p in t.split("\n\n") if len(p) > 40]
    with open(out / "paras.jsonl", "w", encoding="utf-8") as fh:
        for p in paras:
            fh.write(json.dumps({"id": len(p), "body": p}) + "\n")
    return out
