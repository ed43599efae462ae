"""A small public-domain English corpus shipped with Slapo, a byte-level tokenizer and loaders.

Used by `slapo train`, tests and benchmarks so that training runs with nothing downloaded.
"""

from .dataset import (
    IGNORE_INDEX,
    TASKS,
    BlockSampler,
    CorpusLoader,
    corpus_files,
    load_corpus,
    mask_tokens,
    split_tokens,
)
from .tokenizer import ByteTokenizer

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "BlockSampler",
    "ByteTokenizer",
    "CorpusLoader",
    "corpus_files",
    "load_corpus",
    "mask_tokens",
    "split_tokens",
]
