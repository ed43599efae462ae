"""The shipped corpus, byte tokenizer and resumable sampler behind `slapo train`."""

from __future__ import annotations

import math

import torch

from slapo.data import (
    IGNORE_INDEX,
    BlockSampler,
    ByteTokenizer,
    CorpusLoader,
    FeistelOrder,
    corpus_files,
    load_corpus,
    split_tokens,
)


def test_corpus_is_shipped_and_sized():
    files = corpus_files()
    assert len(files) >= 5
    texts = load_corpus()
    total = sum(len(t.encode("utf-8")) for t in texts.values())
    assert 50_000 <= total <= 150_000, total
    assert all(len(t) > 1000 for t in texts.values())
    assert "created equal" in texts["declaration_of_independence.txt"]


def test_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "Shall I compare thee? naïve café, 東京 ✓"
    ids = tok.encode(text, eos=True)
    assert ids[-1] == tok.eos_id and max(ids[:-1]) < 256
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.vocab_size == 260


def test_split_is_deterministic_and_covers_every_file():
    tok = ByteTokenizer()
    texts = load_corpus()
    train, val = split_tokens(texts, tok)
    train2, val2 = split_tokens(texts, tok)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    n_files = len(texts)
    assert (train == tok.eos_id).sum() == n_files and (val == tok.eos_id).sum() == n_files
    total = sum(len(t.encode()) for t in texts.values())
    assert len(train) + len(val) == total + 2 * n_files
    assert 0.08 < len(val) / (len(train) + len(val)) < 0.12


def test_sampler_state_restores_exact_sequence():
    a = BlockSampler(10_000, 64, seed=3)
    for _ in range(5):
        a.next_starts(8)
    state = a.state_dict()
    expected = [a.next_starts(8) for _ in range(40)]  # crosses epochs (156 blocks per epoch)
    b = BlockSampler(10_000, 64, seed=3)
    b.load_state_dict(state)
    got = [b.next_starts(8) for _ in range(40)]
    assert all(torch.equal(x, y) for x, y in zip(expected, got))
    assert a.state.epoch >= 2


def test_sampler_epoch_visits_every_block_once_and_seeds_differ():
    s = BlockSampler(6_400, 64, seed=0)
    n = s.blocks_per_epoch()
    starts = s.next_starts(n)
    assert len(set(starts.tolist())) == n
    assert (starts - starts.min()).remainder(64).eq(0).all()
    assert s.state.epoch == 1 and s.state.position == 0
    other = BlockSampler(6_400, 64, seed=1).next_starts(n)
    assert not torch.equal(starts, other)


def test_stored_order_is_the_seeded_randperm():
    """Up to STORED_ORDER_MAX_BLOCKS the epoch order is the seeded randperm it always was
    (runs and checkpoints made before the computed order existed resume unchanged)."""
    s = BlockSampler(10_000, 64, seed=3)
    g = torch.Generator().manual_seed(3 * 1_000_003 + 0)
    offset = int(torch.randint(64, (1,), generator=g))
    order = torch.randperm((10_000 - offset) // 64, generator=g)
    assert torch.equal(s.next_starts(len(order)), offset + order * 64)


def test_feistel_order_is_a_seeded_bijection():
    for n in (1, 2, 3, 17, 1000, 4097, 65_537):
        perm = FeistelOrder(n, seed=7)(torch.arange(n))
        assert sorted(perm.tolist()) == list(range(n)), n
    a, b = FeistelOrder(1000, seed=7), FeistelOrder(1000, seed=8)
    assert torch.equal(a(torch.arange(1000)), FeistelOrder(1000, seed=7)(torch.arange(1000)))
    assert not torch.equal(a(torch.arange(1000)), b(torch.arange(1000)))
    big = FeistelOrder(10**11, seed=1)(torch.arange(4096))  # 100 G blocks, no index memory
    assert len(set(big.tolist())) == 4096 and int(big.max()) < 10**11


def test_computed_order_visits_every_block_and_resumes_exactly():
    """Above the stored limit (forced small here) an epoch is a computed permutation: every
    block once per epoch, the grid offset per epoch as before, and exact resume."""
    s = BlockSampler(10_000, 64, seed=3, stored_max=10)
    n = s.blocks_per_epoch()
    first = s.next_starts(n)
    assert len(set(first.tolist())) == n and (first - first.min()).remainder(64).eq(0).all()
    assert s.state.epoch == 1
    for _ in range(3):
        s.next_starts(8)
    state = s.state_dict()
    expected = [s.next_starts(8) for _ in range(40)]
    r = BlockSampler(10_000, 64, seed=3)  # the rule travels with the state
    r.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(expected, [r.next_starts(8) for _ in range(40)]))
    old = BlockSampler(10_000, 64, seed=3, stored_max=10)  # a state saved before the rule existed
    old.load_state_dict({k: v for k, v in state.items() if k != "stored_max"})
    assert old.stored_max > 10 and isinstance(old._epoch(old.state.epoch)[1], torch.Tensor)


def test_causal_masked_and_seq2seq_batches():
    causal = CorpusLoader("causal", 32, seed=0).next_batch(4)
    assert causal["input_ids"].shape == (4, 32) and torch.equal(causal["input_ids"],
                                                                causal["labels"])
    assert causal["input_ids"].dtype == torch.long

    masked = CorpusLoader("masked", 64, seed=0)
    b = masked.next_batch(16)
    target = b["labels"] != IGNORE_INDEX
    assert target.any(dim=1).all()
    frac = target.float().mean().item()
    assert 0.08 < frac < 0.25, frac
    assert (b["input_ids"][target] == ByteTokenizer.mask_id).float().mean() > 0.6
    assert (b["input_ids"][~target] != ByteTokenizer.mask_id).all()

    s2s = CorpusLoader("seq2seq", 32, seed=0).next_batch(4)
    assert s2s["input_ids"].shape == (4, 32) and s2s["labels"].shape == (4, 16)


def test_loader_state_resumes_masking_too():
    a = CorpusLoader("masked", 32, seed=5)
    a.next_batch(4)
    state = a.state_dict()
    want = a.next_batch(4)
    b = CorpusLoader("masked", 32, seed=5)
    b.load_state_dict(state)
    got = b.next_batch(4)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert not math.isnan(float(got["input_ids"].float().mean()))
