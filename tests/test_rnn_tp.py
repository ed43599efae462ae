"""Tensor parallelism for recurrent language models (`apply_rnn(..., tp=2)`).

On 2 gloo ranks, `slapo.Verify` wraps `apply_rnn(sch, tp=2, ...)` for a word-level LSTM LM, a
GRU LM and a weight-tied LSTM LM, with and without checkpointing over time chunks: outputs,
every parameter's gradient and the parameters after one SGD step must match the unscheduled
model. In one process, a `VirtualGroup` of 2 checks the plan (what is sharded, what stays
replicated, the recorded history) and that bad input is refused before anything changes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import slapo
from slapo.distributed.group import VirtualGroup
from slapo.errors import SchedulingError
from slapo.model_schedule.rnn import apply_rnn
from slapo.op.rnn import FusedGRU, FusedLSTM

VOCAB, EMB, HIDDEN, BATCH, SEQ = 32, 12, 16, 3, 7


class WordLM(nn.Module):
    """PyTorch's word_language_model: embed -> RNN -> linear (optionally tied)."""

    def __init__(self, kind: str = "LSTM", vocab: int = VOCAB, tie: bool = False,
                 seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        emb = HIDDEN if tie else EMB
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = getattr(nn, kind)(emb, HIDDEN, 2, batch_first=True)
        self.decoder = nn.Linear(HIDDEN, vocab)
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, ids: torch.Tensor):
        out, hidden = self.rnn(self.encoder(ids))
        return self.decoder(out), hidden


def _ids(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss(out) -> torch.Tensor:
    """Next-token cross-entropy plus the final states (so h_n / c_n gradients are checked)."""
    logits, hidden = out
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    ids = _ids()
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return ce + sum(s.pow(2).mean() for s in states)


# ------------------------------------------------------------------------------ 2 gloo ranks
def _verify_one(kind: str, tie: bool, ckpt_chunk: int | None) -> int:
    model = WordLM(kind, tie=tie, seed=1)
    n_params = len(list(model.parameters()))
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [_ids()], loss_fn=_loss) as v:
        apply_rnn(sch, tp=2, ckpt_chunk=ckpt_chunk)
    assert model.encoder.weight.shape == (VOCAB // 2, model.encoder.embedding_dim)
    assert model.decoder.weight.shape[0] == VOCAB // 2
    assert model.decoder.bias.shape == (VOCAB // 2,)
    assert isinstance(model.rnn, FusedLSTM if kind == "LSTM" else FusedGRU)
    assert model.rnn.weight_hh_l0.shape[1] == HIDDEN  # the recurrence stays whole
    assert (model.decoder.weight is model.encoder.weight) == tie
    grads = [k for k in v.report if k.startswith("grad ")]
    assert len(grads) == n_params, (grads, n_params)
    return len(v.report)


def job_verify_all() -> list[int]:
    """Every variant in one job (the pool's start-up and the imports are paid once)."""
    return [_verify_one(kind, tie, chunk)
            for kind, tie, chunk in (("LSTM", False, None), ("LSTM", False, 3),
                                     ("GRU", False, None), ("GRU", False, 3),
                                     ("LSTM", True, 2))]


@pytest.mark.dist
def test_verify_tp2_lstm_gru(dist2):
    n = dist2.run(job_verify_all, timeout=300)
    assert n[0] == n[1] and all(k > 10 for k in n[0])


# ------------------------------------------------------------------------------ one process
def _sch(model: nn.Module, tp: int = 2):
    return slapo.create_schedule(model, group=VirtualGroup(tp, 0))


def test_plan_shards_vocab_layers_only():
    model = WordLM("GRU", seed=2)
    rnn_shapes = {n: p.shape for n, p in model.rnn.named_parameters()}
    sch = apply_rnn(_sch(model))
    assert model.encoder.weight.shape == (VOCAB // 2, EMB)
    assert model.decoder.weight.shape == (VOCAB // 2, HIDDEN)
    assert {n: p.shape for n, p in model.rnn.named_parameters()} == rnn_shapes
    applied = [(path, h.name, h.kwargs.get("mode")) for path, h in sch.applied()]
    assert ("rnn", "replace", None) in applied
    assert ("encoder", "shard", None) in applied
    assert ("encoder", "sync", "fwd_post") in applied
    assert [a for a in applied if a[0] == "decoder"] == [
        ("decoder", "shard", None), ("decoder", "shard", None),
        ("decoder", "sync", "bwd_post"), ("decoder", "sync", "fwd_post")]


def test_tp_one_rank_changes_nothing_but_the_rnn():
    model = WordLM("LSTM")
    sch = apply_rnn(slapo.create_schedule(model), tp=1)
    assert [h.name for _, h in sch.applied()] == ["replace"]
    assert model.encoder.weight.shape == (VOCAB, EMB)


def test_explicit_head_and_unfused_baseline():
    model = WordLM("LSTM")
    model.extra = nn.Linear(HIDDEN, VOCAB)  # a second vocabulary-sized Linear: ambiguous
    apply_rnn(_sch(model), fused=False, head="decoder")
    assert type(model.rnn) is nn.LSTM
    assert model.decoder.weight.shape[0] == VOCAB // 2 and model.extra.weight.shape[0] == VOCAB


def _refused(model: nn.Module, match: str, tp: int = 2, **kw) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rnn_type = type(model.rnn)
    sch = _sch(model, tp)
    with pytest.raises(SchedulingError, match=match):
        apply_rnn(sch, **kw)
    assert not sch.applied() and type(model.rnn) is rnn_type
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())


def test_vocab_not_divisible_is_refused_before_any_change():
    _refused(WordLM("LSTM", vocab=33), "not divisible by tp=2")


def test_bad_tp_and_paths_are_refused():
    model = WordLM("LSTM")
    sch = _sch(model)
    with pytest.raises(SchedulingError, match="group has 2 rank"):
        apply_rnn(sch, tp=4)
    with pytest.raises(SchedulingError, match="positive int"):
        apply_rnn(sch, tp=0)
    assert not sch.applied()
    _refused(WordLM("LSTM"), "must be an nn.Linear", head="encoder")
    _refused(WordLM("LSTM"), "no module at this path", head="nope")
    _refused(WordLM("LSTM"), "must be an nn.Embedding", embeddings=["decoder"])
    ambiguous = WordLM("GRU")
    ambiguous.extra = nn.Linear(HIDDEN, VOCAB)
    _refused(ambiguous, "ambiguous")
    with pytest.raises(SchedulingError, match="one rank"):
        apply_rnn(slapo.create_schedule(WordLM("LSTM")), head="decoder")


def test_already_sharded_and_max_norm_are_refused():
    model = WordLM("LSTM")
    model.encoder.max_norm = 1.0
    _refused(model, "max_norm")
    for path, kw in (("encoder", {}), ("decoder", {"head": "decoder"})):
        model = WordLM("LSTM")
        sch = _sch(model)
        sch[path].shard("weight", axis=0)
        with pytest.raises(SchedulingError, match="already sharded"):
            apply_rnn(sch, **kw)
        assert type(model.rnn) is nn.LSTM and len(sch.applied()) == 1


def test_model_without_vocab_layers_is_refused():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(EMB, HIDDEN)
            self.out = nn.Linear(HIDDEN, 5)

    _refused(Tagger(), "has none")
