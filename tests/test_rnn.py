"""Fused LSTM/GRU (`slapo.op.rnn`) and the recurrent schedule (`model_schedule.rnn.apply_rnn`).

Every scheduled variant is compared with the original `nn.LSTM` / `nn.GRU` in fp32: outputs
(output and final states), the gradient of every parameter and of the input, and the parameters
after one optimizer step. Saved-for-backward bytes are checked against EcoRNN's accounting.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slapo
from slapo.errors import SchedulingError
from slapo.model_schedule.rnn import apply_rnn, rnn_paths
from slapo.op.rnn import FusedGRU, FusedLSTM
from slapo.op.rnn_kernels import LAYOUTS
from slapo.profile import saved_bytes

RTOL, ATOL = 1e-5, 1e-6


class WordLM(nn.Module):
    """Word-level RNN language model (PyTorch's word_language_model): embed -> RNN -> linear."""

    def __init__(self, kind: str = "LSTM", vocab: int = 40, emb: int = 12, hidden: int = 16,
                 layers: int = 2, bidirectional: bool = False, batch_first: bool = True):
        super().__init__()
        self.encoder = nn.Embedding(vocab, emb)
        self.rnn = getattr(nn, kind)(emb, hidden, layers, batch_first=batch_first,
                                     bidirectional=bidirectional)
        self.decoder = nn.Linear(hidden * (2 if bidirectional else 1), vocab)

    def forward(self, ids: torch.Tensor, hidden=None):
        out, hidden = self.rnn(self.encoder(ids), hidden)
        return self.decoder(out), hidden


def _tensors(out) -> list[torch.Tensor]:
    """output, h_n[, c_n] of an RNN (or logits and states of the LM), flattened."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _tensors(o)]


def _loss(out) -> torch.Tensor:
    """A loss touching every output element with a distinct weight (so every gradient path,
    h_n and c_n included, is exercised)."""
    total = 0.0
    for t in _tensors(out):
        w = torch.linspace(-1.0, 1.0, t.numel()).reshape(t.shape)
        total = total + (t * w).sum() + t.pow(2).mean()
    return total


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what}: {m}")


def _check_equal(ref: nn.Module, new: nn.Module, inputs: tuple, lr: float = 0.5) -> None:
    """Outputs, every gradient (parameters and floating inputs) and one SGD step match."""
    in_ref = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    in_new = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out_ref, out_new = ref(*in_ref), new(*in_new)
    for i, (a, b) in enumerate(zip(_tensors(out_new), _tensors(out_ref), strict=True)):
        _close(a, b, f"output {i}")
    _loss(out_ref).backward()
    _loss(out_new).backward()
    params = dict(new.named_parameters())
    assert set(params) == {n for n, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        _close(params[name].grad, p.grad, f"grad {name}")
    for a, b in zip(in_new, in_ref):
        if a.requires_grad:
            _close(a.grad, b.grad, "input grad")
    for m in (ref, new):
        torch.optim.SGD(m.parameters(), lr=lr).step()
    for name, p in ref.named_parameters():
        _close(params[name].detach(), p.detach(), f"param after step {name}")


CONFIGS = [  # (batch_first, bidirectional, num_layers, bias, with initial state)
    (False, False, 1, True, False),
    (True, True, 2, True, True),
    (False, True, 1, False, True),
]


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ckpt_chunk", [None, 3])
@pytest.mark.parametrize("cfg", CONFIGS, ids=["plain", "bf-bi-2l-hx", "nobias-bi-hx"])
def test_fused_module_matches_torch(kind, layout, ckpt_chunk, cfg):
    batch_first, bi, layers, bias, with_hx = cfg
    torch.manual_seed(0)
    ref = getattr(nn, kind)(5, 6, layers, bias=bias, batch_first=batch_first, bidirectional=bi)
    fused = {"LSTM": FusedLSTM, "GRU": FusedGRU}[kind]
    new = fused.from_module(copy.deepcopy(ref), layout=layout, ckpt_chunk=ckpt_chunk)
    T, B = 7, 3
    x = torch.randn(B, T, 5) if batch_first else torch.randn(T, B, 5)
    if not with_hx:
        _check_equal(ref, new, (x,))
        return
    h0 = torch.randn(layers * (2 if bi else 1), B, 6)
    if kind == "GRU":
        _check_equal(ref, new, (x, h0))
    else:  # (h0, c0) as separate inputs, so their gradients are compared too
        _check_equal(_WithState(ref), _WithState(new), (x, h0, torch.randn_like(h0)))


class _WithState(nn.Module):
    """Calls an LSTM with (h0, c0) passed as two positional inputs."""

    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn = rnn

    def forward(self, x, h0, c0):
        return self.rnn(x, (h0, c0))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_unbatched_input(kind):
    torch.manual_seed(0)
    ref = getattr(nn, kind)(4, 5, 2)
    new = {"LSTM": FusedLSTM, "GRU": FusedGRU}[kind].from_module(copy.deepcopy(ref),
                                                                 layout="batch_minor")
    _check_equal(ref, new, (torch.randn(6, 4),))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ckpt_chunk", [None, 4])
@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_apply_rnn_word_lm(kind, layout, ckpt_chunk):
    """The schedule on a word-level LM: same logits, states, gradients and Adam step."""
    torch.manual_seed(0)
    ref = WordLM(kind)
    model = copy.deepcopy(ref)
    sch = apply_rnn(model, layout=layout, ckpt_chunk=ckpt_chunk)
    assert type(sch.mod.rnn) is {"LSTM": FusedLSTM, "GRU": FusedGRU}[kind]
    assert [(p, h.name) for p, h in sch.applied()] == [("rnn", "replace")]
    ids = torch.randint(0, 40, (3, 10))
    _check_equal(ref, sch.mod, (ids,))


def test_one_adam_step_and_training_loop():
    """Three Adam steps on the LM (optimizer built before the swap: parameters are shared)."""
    torch.manual_seed(0)
    ref = WordLM("LSTM")
    model = copy.deepcopy(ref)
    opt_new = torch.optim.Adam(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2)
    sch = apply_rnn(model, layout="hidden_major", ckpt_chunk=3)
    ids = torch.randint(0, 40, (4, 9))
    for _ in range(3):
        for m, opt in ((ref, opt_ref), (sch.mod, opt_new)):
            opt.zero_grad()
            logits, _ = m(ids[:, :-1])
            nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            opt.step()
    for (n, p), q in zip(ref.named_parameters(), sch.mod.parameters()):
        _close(q.detach(), p.detach(), n)


def test_state_dict_loads_both_ways():
    torch.manual_seed(0)
    ref = WordLM("LSTM", bidirectional=True)
    sch = apply_rnn(copy.deepcopy(WordLM("LSTM", bidirectional=True)), layout="batch_minor")
    sd_ref, sd_new = ref.state_dict(), sch.mod.state_dict()
    assert list(sd_ref) == list(sd_new)
    assert all(sd_ref[k].shape == sd_new[k].shape for k in sd_ref)
    sch.mod.load_state_dict(sd_ref)            # original checkpoint -> fused model
    back = WordLM("LSTM", bidirectional=True)
    back.load_state_dict(sch.mod.state_dict())  # fused checkpoint -> original model
    ids = torch.randint(0, 40, (2, 5))
    with torch.no_grad():
        for a, b in zip(_tensors(back(ids)), _tensors(ref(ids))):
            _close(a, b, "reloaded")


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_verify_passes(kind):
    torch.manual_seed(0)
    sch = slapo.create_schedule(WordLM(kind, bidirectional=True))
    ids = torch.randint(0, 40, (2, 8))
    with slapo.Verify(sch, example_inputs=[ids], loss_fn=_loss) as v:
        apply_rnn(sch, layout="hidden_major", ckpt_chunk=3)
    assert any(k.startswith("grad rnn.weight_hh_l1") for k in v.report)


def test_check_catches_the_seed_backward_bug(monkeypatch):
    """Negative control: a backward using tanh(c_{t-1}) instead of tanh(c_t) (the bug the seed
    notes in an older EcoRNN file) keeps the forward exact but fails the gradient check."""
    def wrong_grads(i, f, g, o, c_prev, c, dh, dc):
        return right(i, f, g, o, c_prev, c_prev, dh, dc)   # tanh of the wrong cell state

    right = slapo.op.rnn_kernels.lstm_cell_grads
    monkeypatch.setattr(slapo.op.rnn_kernels, "lstm_cell_grads", wrong_grads)
    torch.manual_seed(0)
    ref = WordLM("LSTM", layers=1)
    sch = apply_rnn(copy.deepcopy(ref))
    with pytest.raises(AssertionError, match="grad"):
        _check_equal(ref, sch.mod, (torch.randint(0, 40, (3, 8)),))


# ---- saved bytes: EcoRNN's accounting --------------------------------------------------------
T, B, D_IN, H = 16, 4, 8, 32
F32 = 4


def _lstm_saved(ckpt_chunk):
    torch.manual_seed(0)
    ref = nn.LSTM(D_IN, H)
    x = torch.randn(T, B, D_IN, requires_grad=True)
    return saved_bytes(FusedLSTM.from_module(ref, ckpt_chunk=ckpt_chunk), x), saved_bytes(ref, x)


def test_saved_bytes_fused_lstm_is_ecornn_accounting():
    """No checkpointing: the input (kept by the projection GEMM), W_hh^T (one copy), and per step
    the 4 activated gates plus c_t and h_t (c_{t-1}, h_{t-1} of the next step): 6 B·H per step,
    plus h_0 and c_0. Less than half of what nn.LSTM keeps."""
    fused, ref = _lstm_saved(None)
    assert fused == F32 * (T * B * D_IN + 4 * H * H + 6 * T * B * H + 2 * B * H)
    assert fused < ref / 2


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_saved_bytes_time_chunks(chunk):
    """With chunks of k steps only the input, the weights (W_hh^T and the summed bias) and the
    (h, c) at the T/k - 1 inner chunk boundaries (plus the shared zero h_0 = c_0) are kept."""
    fused, _ = _lstm_saved(chunk)
    boundaries = T // chunk - 1
    assert fused == F32 * (T * B * D_IN + 4 * H * H + 4 * H + B * H * (1 + 2 * boundaries))


# ---- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"layout": "time_major"}, "unknown RNN layout"),
    ({"ckpt_chunk": 0}, "ckpt_chunk must be a positive int"),
    ({"ckpt_chunk": True}, "ckpt_chunk must be a positive int"),
    ({"ckpt_chunk": 2.5}, "ckpt_chunk must be a positive int"),
    ({"compile_cell": "yes"}, "compile_cell must be True or False"),
    ({"fused": False, "ckpt_chunk": 4}, "need the fused RNN"),
    ({"fused": 1}, "fused must be True or False"),
])
def test_bad_knobs_change_nothing(kwargs, match):
    model = WordLM("LSTM")
    sch = slapo.create_schedule(model)
    with pytest.raises(SchedulingError, match=match):
        apply_rnn(sch, **kwargs)
    assert type(model.rnn) is nn.LSTM and not sch.applied()


class MyLSTM(nn.LSTM):
    pass


@pytest.mark.parametrize("second, match", [
    (nn.LSTM(4, 6, proj_size=3), "proj_size=3"),
    (MyLSTM(4, 6), "MyLSTM subclasses nn.LSTM"),
])
def test_unsupported_modules_change_nothing(second, match):
    """The GRU before the unsupported module is not replaced either (checked first)."""
    model = nn.Sequential(nn.GRU(4, 4), second)
    sch = slapo.create_schedule(model)
    with pytest.raises(SchedulingError, match=match):
        apply_rnn(sch)
    assert type(model[0]) is nn.GRU and not sch.applied()


def test_model_without_rnn():
    model = nn.Sequential(nn.Linear(4, 6), nn.RNN(6, 6))
    assert rnn_paths(model) == []
    with pytest.raises(SchedulingError, match="no nn.LSTM or nn.GRU"):
        apply_rnn(model)


def test_packed_sequence_is_a_clear_error():
    sch = apply_rnn(WordLM("GRU"))
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(3, 5, 12), [5, 4, 2],
                                               batch_first=True)
    with pytest.raises(SchedulingError, match="PackedSequence.*pad_packed_sequence"):
        sch.mod.rnn(packed)


def test_fused_off_is_the_baseline_and_twice_is_refused():
    model = WordLM("LSTM")
    assert apply_rnn(model, fused=False).applied() == []
    sch = apply_rnn(model)
    with pytest.raises(SchedulingError, match="not scheduled twice"):
        apply_rnn(sch)


@pytest.mark.compile
def test_compiled_cell_matches_torch():
    torch.manual_seed(0)
    ref = WordLM("LSTM", layers=1)
    sch = apply_rnn(copy.deepcopy(ref), compile_cell=True, ckpt_chunk=4)
    _check_equal(ref, sch.mod, (torch.randint(0, 40, (3, 8)),))
    assert not slapo.op.rnn_kernels._COMPILED["LSTM"].failed  # it really ran compiled
