"""The shipped corpus as fixed-length token blocks, and a seeded sampler that can resume exactly.

Split: each document's first `1 - val_fraction` of tokens go to train and the rest to val, so the
split is deterministic, needs no shuffling, and val covers every document's style.

Blocks: a split's token stream is cut into non-overlapping blocks of `seq_len` tokens. Each
epoch of the sampler shifts the grid by a seeded offset (so the model sees different block
boundaries) and visits the blocks in a seeded order. The sampler's whole state is three ints
(seed, epoch, position), so it saves as JSON and resumes bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import torch

from .tokenizer import ByteTokenizer

CORPUS_PACKAGE = "slapo.data"
CORPUS_DIR = "corpus"
IGNORE_INDEX = -100  # label value HF losses skip


def corpus_files() -> list[str]:
    """Names of the shipped corpus files, sorted (the order fixes the token stream)."""
    root = resources.files(CORPUS_PACKAGE) / CORPUS_DIR
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".txt"))


def load_corpus() -> dict[str, str]:
    """{file name: text} of the shipped public-domain corpus (see slapo/data/README.md)."""
    root = resources.files(CORPUS_PACKAGE) / CORPUS_DIR
    return {name: (root / name).read_text(encoding="utf-8") for name in corpus_files()}


def split_tokens(texts: dict[str, str], tokenizer: ByteTokenizer, val_fraction: float = 0.1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val) token streams: each document split at `1 - val_fraction`, EOS after each part."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    names = sorted(texts)
    return split_by_tail([texts[n] for n in names], tokenizer, val_fraction)


def _eos(tokenizer) -> list[int]:
    return [] if tokenizer.eos_id is None else [tokenizer.eos_id]


def _stream(ids: list[int], tokenizer) -> torch.Tensor:
    """A packed token stream, int16 when the vocabulary fits (half the memory), else int32."""
    dtype = torch.int16 if tokenizer.vocab_size <= 2**15 else torch.int32
    return torch.tensor(ids, dtype=dtype)


def split_by_tail(texts: list[str], tokenizer, val_fraction: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole files: each document's first `1 - val_fraction` of tokens to train, the rest to
    val, EOS after each part (val covers every document's style; no shuffling needed)."""
    train: list[int] = []
    val: list[int] = []
    for ids in tokenizer.encode_many(texts):
        cut = int(len(ids) * (1 - val_fraction))
        train += ids[:cut] + _eos(tokenizer)
        if val_fraction > 0:
            val += ids[cut:] + _eos(tokenizer)
    return _stream(train, tokenizer), _stream(val, tokenizer)


def val_draw(n: int, val_fraction: float, seed: int) -> torch.Tensor | None:
    """Which of `n` documents go to val: a seeded `val_fraction` of them, at least one (None: no
    val rows). One rule for in-memory data and `slapo prepare-data`, which streams documents
    and so needs the draw before it has read them."""
    if val_fraction == 0 or n < 2:
        return None
    n_val = max(1, round(n * val_fraction))
    g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    is_val = torch.zeros(n, dtype=torch.bool)
    is_val[torch.randperm(n, generator=g)[:n_val]] = True
    return is_val


def split_by_record(texts: list[str], tokenizer, val_fraction: float, seed: int,
                    val_texts: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Many small documents (JSONL rows, dataset rows): a seeded `val_fraction` of the
    documents (at least one) go to val, the rest to train, each packed in its original order
    with EOS between documents. `val_texts` (a split the data brought) replaces the draw."""
    is_val = None if val_texts is not None else val_draw(len(texts), val_fraction, seed)
    if val_texts is not None:
        train_docs, val_docs = texts, val_texts
    elif is_val is None:
        train_docs, val_docs = texts, []
    else:
        train_docs = [t for t, v in zip(texts, is_val.tolist()) if not v]
        val_docs = [t for t, v in zip(texts, is_val.tolist()) if v]

    def pack(docs: list[str]) -> torch.Tensor:
        out: list[int] = []
        for ids in tokenizer.encode_many(docs):
            out += ids + _eos(tokenizer)
        return _stream(out, tokenizer)

    return pack(train_docs), pack(val_docs)


def fingerprint(tokens: torch.Tensor) -> str:
    """sha256 of a token stream: a checkpoint records it, so resuming on other data (or with
    another tokenizer) is refused instead of silently drawing different batches."""
    import hashlib

    return hashlib.sha256(tokens.to(torch.int32).numpy().tobytes()).hexdigest()[:16]


@dataclass
class SamplerState:
    seed: int
    epoch: int = 0
    position: int = 0  # blocks already drawn in this epoch


STORED_ORDER_MAX_BLOCKS = 1 << 24  # above: the epoch's order is computed, not stored (128 MiB)


class FeistelOrder:
    """A seeded permutation of range(n) evaluated per index, in O(1) memory.

    `randperm(n)` stores 8 bytes per block: about 390 MB on every rank for 50 B tokens at
    sequence 1024. This is a keyed, balanced Feistel network over the smallest even power of
    two >= n (a bijection there), walked until it lands inside [0, n) ("cycle walking", also a
    bijection; fewer than 4 steps on average as the domain is < 4n). Vectorised over a batch of
    positions with int64 tensor ops, every intermediate below 2**62, so it is exact on any
    device and version.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError(f"FeistelOrder needs n >= 1, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # bits per half
        self.mask = (1 << self.half) - 1
        g = torch.Generator().manual_seed(seed)
        self.keys = [int(k) for k in torch.randint(1, 2**30, (self.ROUNDS,), generator=g)]

    def _round(self, right: torch.Tensor, key: int) -> torch.Tensor:
        """A keyed mix of `half`-bit values into `half` bits (multiply-xorshift, 30-bit lanes)."""
        lane = (1 << 30) - 1  # products of two 30-bit values stay below 2**60
        x = (right ^ key) & lane
        x = (x * 0x2C1B3C6D) ^ ((x * 0x2C1B3C6D) >> 31)
        x = (x & lane) * 0x297A2D39
        return (x ^ (x >> 29)) & self.mask

    def _permute(self, i: torch.Tensor) -> torch.Tensor:
        left, right = i >> self.half, i & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        out = self._permute(positions.to(torch.long))
        outside = out >= self.n
        while bool(outside.any()):
            out[outside] = self._permute(out[outside])
            outside = out >= self.n
        return out


class BlockSampler:
    """Draws batches of block starts from a token stream, epoch by epoch, from a seed.

    Every rank builds the same sampler and draws the same global batch (the runtime slices it
    for data parallelism), so there is one sampler state for the whole job. An epoch's order is
    a stored `randperm` up to `STORED_ORDER_MAX_BLOCKS` blocks and a `FeistelOrder` (computed
    per position, O(1) memory) above, so corpora far larger than memory cost no index memory.
    """

    def __init__(self, num_tokens: int, seq_len: int, seed: int = 0,
                 stored_max: int | None = None):
        if num_tokens < 2 * seq_len:
            raise ValueError(f"the corpus split has {num_tokens} tokens, too few for blocks of "
                             f"{seq_len}; use a smaller --seq-len.")
        self.num_tokens = num_tokens
        self.seq_len = seq_len
        self.stored_max = STORED_ORDER_MAX_BLOCKS if stored_max is None else stored_max
        self.state = SamplerState(seed)
        self._epoch_cache: tuple[int, int, torch.Tensor | FeistelOrder] | None = None

    def _epoch(self, epoch: int) -> tuple[int, torch.Tensor | FeistelOrder]:
        """This epoch's grid offset and block order (a tensor, or a computed permutation)."""
        if self._epoch_cache is not None and self._epoch_cache[0] == epoch:
            return self._epoch_cache[1], self._epoch_cache[2]
        g = torch.Generator().manual_seed(self.state.seed * 1_000_003 + epoch)
        offset = int(torch.randint(self.seq_len, (1,), generator=g))
        count = (self.num_tokens - offset) // self.seq_len
        if count <= self.stored_max:
            order: torch.Tensor | FeistelOrder = torch.randperm(count, generator=g)
        else:
            order = FeistelOrder(count, int(torch.randint(2**62, (1,), generator=g)))
        self._epoch_cache = (epoch, offset, order)
        return offset, order

    def _count(self, order: torch.Tensor | FeistelOrder) -> int:
        return order.n if isinstance(order, FeistelOrder) else len(order)

    def blocks_per_epoch(self) -> int:
        return self._count(self._epoch(self.state.epoch)[1])

    def next_starts(self, batch_size: int) -> torch.Tensor:
        """The next `batch_size` block starts (crossing into the next epoch when needed)."""
        out: list[torch.Tensor] = []
        need = batch_size
        while need:
            offset, order = self._epoch(self.state.epoch)
            count = self._count(order)
            take = min(need, count - self.state.position)
            pos = self.state.position
            blocks = order(torch.arange(pos, pos + take)) if isinstance(order, FeistelOrder) \
                else order[pos:pos + take]
            out.append(offset + blocks * self.seq_len)
            need -= take
            self.state.position += take
            if self.state.position == count:
                self.state.epoch += 1
                self.state.position = 0
        return torch.cat(out).to(torch.long)

    def state_dict(self) -> dict[str, int]:
        return {"seed": self.state.seed, "epoch": self.state.epoch,
                "position": self.state.position, "stored_max": self.stored_max}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume exactly, with the order rule the state was saved under: a state without
        `stored_max` predates the computed order, so every epoch was a stored randperm."""
        self.state = SamplerState(int(state["seed"]), int(state["epoch"]), int(state["position"]))
        self.stored_max = int(state.get("stored_max", 2**63 - 1))
        self._epoch_cache = None


def gather_blocks(tokens: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """[len(starts), length] int64 token ids."""
    index = starts[:, None] + torch.arange(length)[None, :]
    return tokens[index].long()


def mask_tokens(ids: torch.Tensor, tokenizer: ByteTokenizer, generator: torch.Generator,
                prob: float = 0.15) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT-style masking: of `prob` of the positions, 80% -> MASK, 10% -> random token (from
    `tokenizer.random_high`: bytes, or the whole vocabulary), 10% unchanged; labels are the
    original ids there and IGNORE_INDEX elsewhere. The tokenizer's `special_ids` (EOS, SEP, ...
    of an HF tokenizer) are never chosen.

    What transformers' `DataCollatorForLanguageModeling` does, but drawn from a generator the
    caller seeds per batch: the collator's own generator is state that a checkpoint would have
    to carry, this is a pure function of (seed, batch number), so resume stays exact."""
    chosen = torch.rand(ids.shape, generator=generator) < prob
    if tokenizer.special_ids:
        chosen &= ~torch.isin(ids, torch.tensor(tokenizer.special_ids, dtype=ids.dtype))
    chosen[:, 0] |= ~chosen.any(dim=1)  # at least one target per row, so the loss is defined
    labels = torch.where(chosen, ids, torch.full_like(ids, IGNORE_INDEX))
    roll = torch.rand(ids.shape, generator=generator)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = tokenizer.mask_id
    random_pos = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[random_pos] = torch.randint(tokenizer.random_high, ids.shape,
                                       generator=generator)[random_pos]
    return inputs, labels


TASKS = ("causal", "masked", "seq2seq")


class TokenLoader:
    """Batches of packed token streams for a task, drawn by a resumable `BlockSampler`.

    - "causal": input_ids = labels = a block of seq_len (HF causal LMs shift labels themselves).
    - "masked": a block with 15% of positions masked; labels only at the masked positions.
    - "seq2seq": input_ids = a block of seq_len; labels = the seq_len // 2 tokens that follow it
      (continue the text; the model makes decoder inputs from labels).
    Randomness of masking comes from a generator seeded by (seed, step), never the global RNG,
    so batches do not depend on what else consumed random numbers. The state (sampler position,
    batches drawn, the stream's fingerprint) is JSON, so a checkpoint resumes it exactly.
    """

    def __init__(self, task: str, seq_len: int, tokens: torch.Tensor, tokenizer, seed: int = 0,
                 what: str = "the data"):
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; use one of {TASKS}")
        if task == "masked" and tokenizer.mask_id is None:
            from .sources import InputError

            raise InputError(tokenizer.name, "the tokenizer has no mask token, which a masked "
                             "LM needs.", "use a tokenizer with one (e.g. BERT's [MASK]), or "
                             "add it: tokenizer.add_special_tokens({'mask_token': '[MASK]'}).")
        self.task = task
        self.seq_len = seq_len
        self.seed = seed
        self.tokenizer = tokenizer
        self.tokens = tokens
        self.target_len = seq_len // 2 if task == "seq2seq" else 0
        need = 2 * seq_len + self.target_len
        if len(tokens) < need:  # bad input (exit status 2), like an empty file
            from .sources import InputError

            raise InputError(what, f"has {len(tokens)} tokens, too few for blocks of {seq_len} "
                             f"(at least {need} are needed).", "use a smaller --seq-len or more "
                             "data.")
        self.sampler = BlockSampler(len(self.tokens) - self.target_len, seq_len, seed)
        self.batches_drawn = 0
        self._fingerprint: str | None = None

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            self._fingerprint = fingerprint(self.tokens)
        return self._fingerprint

    def next_batch(self, batch_size: int) -> dict[str, torch.Tensor]:
        starts = self.sampler.next_starts(batch_size)
        self.batches_drawn += 1
        if self.task == "causal":
            ids = gather_blocks(self.tokens, starts, self.seq_len)
            return {"input_ids": ids, "labels": ids.clone()}
        if self.task == "masked":
            ids = gather_blocks(self.tokens, starts, self.seq_len)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + 7919 * self.batches_drawn)
            inputs, labels = mask_tokens(ids, self.tokenizer, g)
            return {"input_ids": inputs, "labels": labels}
        both = gather_blocks(self.tokens, starts, self.seq_len + self.target_len)
        return {"input_ids": both[:, :self.seq_len], "labels": both[:, self.seq_len:].clone()}

    def samples_per_epoch(self) -> int:
        """Blocks one pass over the train tokens draws (this epoch's grid)."""
        return self.sampler.blocks_per_epoch()

    def state_dict(self) -> dict[str, int | str]:
        return {**self.sampler.state_dict(), "batches_drawn": self.batches_drawn,
                "num_tokens": len(self.tokens), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        """Restore the position; refuse a state saved on other tokens (other data, another
        tokenizer or split): the batches would differ silently."""
        saved = state.get("fingerprint")
        if saved is not None and saved != self.fingerprint:
            raise ValueError(f"the checkpoint was trained on other data: its token stream has "
                             f"{state.get('num_tokens')} tokens (fingerprint {saved}), this "
                             f"one {len(self.tokens)} ({self.fingerprint}); resume with the "
                             "same --data, --text-field, --tokenizer and --val-fraction.")
        self.sampler.load_state_dict(state)
        self.batches_drawn = int(state["batches_drawn"])


class CorpusLoader(TokenLoader):
    """`TokenLoader` over the shipped corpus and the byte tokenizer (the offline default)."""

    def __init__(self, task: str, seq_len: int, seed: int = 0, split: str = "train",
                 val_fraction: float = 0.1):
        tokenizer = ByteTokenizer()
        train, val = split_tokens(load_corpus(), tokenizer, val_fraction)
        tokens = {"train": train, "val": val}[split]
        super().__init__(task, seq_len, tokens, tokenizer, seed,
                         what=f"the shipped corpus' {split} split")
