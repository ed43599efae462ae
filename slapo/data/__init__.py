"""Training data for `slapo train`: the shipped public-domain corpus and byte tokenizer (the
offline default), or the user's text files / JSONL / saved HF dataset with any local
AutoTokenizer (`make_data`), packed into blocks by a resumable seeded sampler.
"""

from .dataset import (
    IGNORE_INDEX,
    TASKS,
    BlockSampler,
    CorpusLoader,
    TokenLoader,
    corpus_files,
    load_corpus,
    mask_tokens,
    split_by_record,
    split_by_tail,
    split_tokens,
)
from .loaders import Data, make_data
from .sources import Documents, InputError, read_documents
from .tokenizer import ByteTokenizer, HFTokenizer, check_tokenizer_dir, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "BlockSampler",
    "ByteTokenizer",
    "CorpusLoader",
    "Data",
    "Documents",
    "HFTokenizer",
    "InputError",
    "TokenLoader",
    "check_tokenizer_dir",
    "corpus_files",
    "load_corpus",
    "load_tokenizer",
    "make_data",
    "mask_tokens",
    "read_documents",
    "split_by_record",
    "split_by_tail",
    "split_tokens",
]
