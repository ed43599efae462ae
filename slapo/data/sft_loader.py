"""`slapo train --data ROWS --sft pack|pad`: supervised fine-tuning rows as the run's loader.

The rows (prompt/response or chat `messages`, `slapo.data.sft`) are read and tokenised once,
split by row (the same seeded draw as JSONL text, `dataset.val_draw`), and laid out as a fixed
table of training rows, `seq_len` tokens each:

- "pack": documents packed behind a document mask (`sft.pack_documents`: `position_ids`
  restarting per document, no attention mask; HF builds the block-diagonal mask from them, and
  the run turns the KV cache off, which would skip it). Only for model types whose HF forward
  was checked to keep packed documents apart (`PACKED_EXACT`); others are refused with "pad".
- "pad": one document per row, right-padded to `seq_len` with an attention mask.

Both truncate a document longer than `seq_len` to its first `seq_len` tokens. A step draws
`batch_size` rows in a seeded order, epoch by epoch (`RowSampler`), so a checkpoint's state
(seed, epoch, position, the table's fingerprint) resumes the exact batches. The loss counts
response tokens only (labels -100 elsewhere), normalised over the global count of them by the
step's token weights (`runtime.token_mean`), across ranks and accumulation slices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .dataset import SamplerState, val_draw
from .sft import Doc, pack_documents, pad_batch, read_sft_rows, tokenize_row
from .sources import InputError

SFT_LAYOUTS = ("pack", "pad")

# Model types whose HF forward (transformers 5.24, SDPA) keeps packed documents apart exactly:
# a one-off float64 sweep packed 3 documents and compared each with its own forward
# (slapo/data/sft.py); tests/test_sft_data.py keeps the proof for llama, qwen3 and gpt2 only.
PACKED_EXACT = frozenset((
    "llama", "mistral", "ministral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
    "gemma", "gemma3_text", "cohere", "cohere2", "phi", "phi3", "phimoe", "gpt2",
    "gpt_bigcode", "gpt_neox", "gptj", "codegen", "starcoder2", "olmo", "olmo2", "olmo3",
    "olmoe", "granite", "granitemoe", "stablelm", "smollm3", "glm", "glm4", "glm4_moe",
    "deepseek_v2", "deepseek_v3", "exaone4", "nemotron", "helium", "internlm3", "minicpm3",
    "ernie4_5", "seed_oss", "arcee", "apertus"))


def check_packable(model_type: str | None) -> None:
    """`--sft pack` only where packed documents provably do not see each other."""
    if model_type not in PACKED_EXACT:
        raise InputError(f"--sft pack with model_type={model_type!r}", "this model's forward "
                         "is not known to keep packed documents apart (its positions, "
                         "recurrent layers or mask let them see each other, or it was not "
                         "checked).", "use --sft pad (one document per row).")


class RowSampler:
    """Rows of a fixed table in a seeded order, epoch by epoch: `{seed, epoch, position}` is
    the whole state (a resumed run draws the rows the uninterrupted run would have)."""

    def __init__(self, num_rows: int, seed: int):
        self.num_rows, self.state = num_rows, SamplerState(seed)
        self._order: tuple[int, torch.Tensor] | None = None

    def _epoch_order(self) -> torch.Tensor:
        epoch = self.state.epoch
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(self.state.seed * 1_000_003 + 31 * epoch + 5)
            self._order = (epoch, torch.randperm(self.num_rows, generator=g))
        return self._order[1]

    def next_rows(self, batch_size: int) -> torch.Tensor:
        out = []
        while batch_size:
            order, pos = self._epoch_order(), self.state.position
            take = min(batch_size, self.num_rows - pos)
            out.append(order[pos:pos + take])
            batch_size -= take
            self.state.position += take
            if self.state.position == self.num_rows:
                self.state.epoch, self.state.position = self.state.epoch + 1, 0
        return torch.cat(out)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.state.seed, "epoch": self.state.epoch,
                "position": self.state.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = SamplerState(int(state["seed"]), int(state["epoch"]),
                                  int(state["position"]))
        self._order = None


def layout_rows(docs: list[Doc], seq_len: int, layout: str, pad_id: int
                ) -> dict[str, torch.Tensor]:
    """The table of `seq_len`-token rows (module docstring)."""
    if layout == "pack":
        return pack_documents(docs, seq_len, pad_id)
    cut = [(list(ids[:seq_len]), list(lab[:seq_len])) for ids, lab in docs if len(ids)]
    return pad_batch(cut, pad_id, multiple_of=seq_len)


def _fingerprint(table: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for key in sorted(table):
        h.update(key.encode())
        h.update(table[key].numpy().tobytes())
    return h.hexdigest()[:16]


class SFTLoader:
    """The train (or val) loader over a table of SFT rows: `next_batch`, `state_dict` and
    `load_state_dict`, as `dataset.TokenLoader` has them."""

    task = "causal"

    def __init__(self, table: dict[str, torch.Tensor], seq_len: int, tokenizer, seed: int,
                 num_tokens: int = 0):
        self.table, self.seq_len, self.tokenizer, self.seed = table, seq_len, tokenizer, seed
        self.num_tokens = num_tokens  # the documents' tokens in the table (no padding)
        self.sampler = RowSampler(len(table["input_ids"]), seed)
        self.batches_drawn = 0
        self.fingerprint = _fingerprint(table)

    def __len__(self) -> int:
        return len(self.table["input_ids"])

    def samples_per_epoch(self) -> int:
        return len(self)

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        rows = self.sampler.next_rows(batch_size)
        self.batches_drawn += 1
        return {k: v[rows] for k, v in self.table.items()}

    def state_dict(self) -> dict[str, Any]:
        return {**self.sampler.state_dict(), "batches_drawn": self.batches_drawn,
                "num_rows": len(self), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("fingerprint")
        if saved != self.fingerprint:
            raise ValueError(f"the checkpoint was trained on other data: its SFT rows "
                             f"({state.get('num_rows')} rows, fingerprint {saved}) are not "
                             f"these ({len(self)} rows, {self.fingerprint}); resume with the "
                             "same --data, --sft, --seq-len, --tokenizer and --val-fraction.")
        self.sampler.load_state_dict(state)
        self.batches_drawn = int(state["batches_drawn"])


@dataclass
class SFTData:
    """What `make_data` returns for SFT rows (the `Data` interface the run reads)."""

    train: SFTLoader
    val: dict[str, torch.Tensor] | None
    tokenizer: Any
    source: str
    task: str
    seq_len: int
    seed: int

    @property
    def val_tokens(self) -> torch.Tensor:
        """The val rows' labelled tokens (what the too-small warning counts)."""
        if self.val is None:
            return torch.zeros(0, dtype=torch.long)
        return self.val["input_ids"][self.val["labels"] != -100]

    def val_loader(self) -> SFTLoader | None:
        """A loader over the val rows from their start (the same batches at every eval)."""
        if self.val is None:
            return None
        return SFTLoader(self.val, self.seq_len, self.tokenizer, self.seed)


def make_sft_data(data: str, layout: str, seq_len: int, tokenizer, seed: int,
                  val_fraction: float) -> SFTData:
    """Read, tokenise, split by row and lay out SFT rows; InputError for bad rows."""
    rows = read_sft_rows(data)
    docs = [tokenize_row(r, tokenizer) for r in rows]
    is_val = val_draw(len(docs), val_fraction, seed)
    flags = [False] * len(docs) if is_val is None else is_val.tolist()
    train = [d for d, v in zip(docs, flags) if not v]
    val = [d for d, v in zip(docs, flags) if v]
    if not train:
        raise InputError(data, f"has {len(docs)} row(s), none left for training after the val "
                         "split.", "add rows or lower --val-fraction.")
    pad = tokenizer.pad_id
    table = layout_rows(train, seq_len, layout, pad)
    val_table = layout_rows(val, seq_len, layout, pad) if val else None
    kept = sum(min(len(ids), seq_len) for ids, _ in train)
    return SFTData(SFTLoader(table, seq_len, tokenizer, seed, kept), val_table, tokenizer, data,
                   "causal", seq_len, seed)


__all__ = ["PACKED_EXACT", "SFT_LAYOUTS", "RowSampler", "SFTData", "SFTLoader",
           "check_packable", "layout_rows", "make_sft_data"]
