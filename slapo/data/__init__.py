"""Training data for `slapo train`: the shipped public-domain corpus and byte tokenizer (the
offline default), or the user's text files / JSONL / saved HF dataset with any local
AutoTokenizer (`make_data`), packed into blocks by a resumable seeded sampler; or a corpus
larger than memory, tokenised once by `prepare` (`slapo prepare-data`) into memory-mapped token
files that `make_data` maps instead of reading text. `sft`: prompt/response and chat rows with
the loss on the responses only, padded or packed behind a document mask (library only).
"""

from .dataset import (
    IGNORE_INDEX,
    TASKS,
    BlockSampler,
    CorpusLoader,
    FeistelOrder,
    TokenLoader,
    corpus_files,
    load_corpus,
    mask_tokens,
    split_by_record,
    split_by_tail,
    split_tokens,
)
from .loaders import Data, make_data
from .prepare_tokens import prepare
from .prepared import MappedTokens, Prepared, check_prepared, is_prepared, open_prepared
from .prepared_format import tokenizer_identity
from .sft import pack_documents, pad_batch, read_sft_rows, tokenize_row
from .sources import Documents, DocumentStream, InputError, open_documents, read_documents
from .tokenizer import ByteTokenizer, HFTokenizer, check_tokenizer_dir, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "TASKS",
    "BlockSampler",
    "ByteTokenizer",
    "CorpusLoader",
    "FeistelOrder",
    "Data",
    "DocumentStream",
    "Documents",
    "HFTokenizer",
    "InputError",
    "MappedTokens",
    "Prepared",
    "TokenLoader",
    "check_prepared",
    "check_tokenizer_dir",
    "corpus_files",
    "is_prepared",
    "load_corpus",
    "load_tokenizer",
    "make_data",
    "mask_tokens",
    "open_documents",
    "open_prepared",
    "pack_documents",
    "pad_batch",
    "prepare",
    "read_documents",
    "read_sft_rows",
    "split_by_record",
    "split_by_tail",
    "split_tokens",
    "tokenize_row",
    "tokenizer_identity",
]
