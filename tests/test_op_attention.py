"""Attention cores: SDPA and Tempo against a plain reference, and inside HF BERT/GPT-2/LLaMA."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from slapo.errors import SchedulingError
from slapo.op import (
    SDPAttention,
    SelfAttention,
    TempoAttentionCore,
    causal_mask,
    flash_attn_available,
    padding_mask,
    use_attention_core,
)
from slapo.profile import saved_bytes

D64 = torch.float64


def reference(q, k, v, mask=None, causal=False, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("core_cls", [SDPAttention, TempoAttentionCore])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_core_matches_reference(core_cls, heads, kv_heads, causal):
    torch.manual_seed(0)
    b, s, d = 2, 7, 8
    q = torch.randn(b, heads, s, d, dtype=D64, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, dtype=D64, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, dtype=D64, requires_grad=True)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 5:] = False
    mask = padding_mask(keep)
    core = core_cls()
    out = core.attend(q, k, v, None if causal else mask, causal, 0.0, 0.3)
    ref = reference(q, k, v, None if causal else mask, causal, 0.3)
    assert torch.allclose(out, ref, atol=1e-12)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        assert torch.allclose(a, r, atol=1e-11)


def test_causal_with_longer_keys_is_bottom_right():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 3, 4, dtype=D64)
    k = torch.randn(1, 2, 5, 4, dtype=D64)
    v = torch.randn(1, 2, 5, 4, dtype=D64)
    ref = reference(q, k, v, causal=True)
    for core in (SDPAttention(), TempoAttentionCore()):
        assert torch.allclose(core.attend(q, k, v, None, True), ref, atol=1e-12)
    # The last query sees every key.
    assert causal_mask(3, 5, torch.device("cpu"))[-1].all()


def test_dropout_only_in_training_and_self_attention_module():
    torch.manual_seed(0)
    attn = SelfAttention(32, heads=4, kv_heads=2, dropout=0.5).double()
    x = torch.randn(2, 6, 32, dtype=D64)
    pad = torch.ones(2, 6)
    pad[0, 4:] = 0
    attn.eval()
    y1, y2 = attn(x, pad, is_causal=True), attn(x, pad, is_causal=True)
    assert torch.equal(y1, y2)
    tempo = SelfAttention(32, heads=4, kv_heads=2, dropout=0.5, core=TempoAttentionCore()).double()
    tempo.load_state_dict(attn.state_dict())
    tempo.eval()
    assert torch.allclose(tempo(x, pad, is_causal=True), y1, atol=1e-12)
    attn.train()
    assert not torch.allclose(attn(x, pad, is_causal=True), y1)
    with pytest.raises(ValueError, match="kv_heads"):
        SelfAttention(32, heads=4, kv_heads=3)


def test_sdpa_saves_no_quadratic_tensor():
    torch.manual_seed(0)
    s = 256
    q, k, v = (torch.randn(1, 2, s, 16, requires_grad=True) for _ in range(3))
    sdpa = saved_bytes(lambda a, b, c: SDPAttention().attend(a, b, c), q, k, v, exclude=[q, k, v])
    tempo = saved_bytes(
        lambda a, b, c: TempoAttentionCore().attend(a, b, c), q, k, v, exclude=[q, k, v]
    )
    assert sdpa < 2 * s * s  # output + logsumexp, O(s)
    assert tempo >= 2 * s * s * 4  # the softmax probabilities, O(s^2)


@pytest.mark.parametrize("before_2_12", [True, False])
def test_dropout_cudnn_would_round_only_before_torch_2_12(monkeypatch, before_2_12):
    from slapo.op import attention

    minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    known = {(2, 11): True, (2, 13): False}  # the GPU image's torch, and .venv's
    if minor in known:
        assert attention._CUDNN_MAY_ROUND_DROPOUT is known[minor], torch.__version__
    monkeypatch.setattr(attention, "_CUDNN_MAY_ROUND_DROPOUT", before_2_12)
    rounds = attention.cudnn_would_round_dropout
    assert rounds(0.1, True) is before_2_12  # 1.6 sixteenths
    assert rounds(0.3, True) is before_2_12
    for exact in (0.0, 0.125, 0.0625, 0.5):  # whole sixteenths: cuDNN runs them as given
        assert not rounds(exact, True), exact
    assert not rounds(0.1, False)  # no cuDNN off CUDA


def test_sdpa_dropout_avoids_cudnn_where_it_would_round(monkeypatch):
    """Where cuDNN would round the probability, `attend` runs SDPA under the other backends
    (CPU stands in for CUDA here, so the rule is forced true): the same values as before (CPU
    has no cuDNN SDPA, same kernel, same RNG draws), in training only, and dynamo traces the
    backend switch inside a compiled block (one graph, no break)."""
    from torch._dynamo.utils import counters

    from slapo.op import attention

    entered = []
    inner = attention._sdpa_without_cudnn
    monkeypatch.setattr(attention, "_sdpa_without_cudnn", lambda: (entered.append(1), inner())[1])
    torch.manual_seed(0)
    attn = SelfAttention(32, heads=4, kv_heads=2, dropout=0.1)
    x = torch.randn(2, 6, 32)
    torch.manual_seed(5)
    plain = attn(x, is_causal=True)
    assert not entered  # CPU: the rule is false
    monkeypatch.setattr(attention, "cudnn_would_round_dropout", lambda p, on_cuda: p > 0)
    torch.manual_seed(5)
    assert torch.equal(attn(x, is_causal=True), plain) and entered
    entered.clear()
    attn.eval()
    attn(x, is_causal=True)
    assert not entered  # eval: no dropout, cuDNN is fine
    attn.train()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attn, backend="aot_eager")
    out = compiled(x, is_causal=True)
    assert entered and out.shape == plain.shape
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sdpa_cuda_half():
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
    out = SDPAttention().attend(q, k, v, None, True)
    ref = reference(q.float(), k.float(), v.float(), causal=True)
    assert torch.allclose(out.float(), ref, atol=2e-3)
    if flash_attn_available():
        out2 = SDPAttention(use_flash=False).attend(q, k, v, None, True)
        assert torch.allclose(out.float(), out2.float(), atol=2e-3)


# ---- HF adapters ------------------------------------------------------------------------------

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def hf_models():
    tf = pytest.importorskip("transformers")
    common = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=4)
    return [
        (tf.BertModel, tf.BertConfig(hidden_size=32, intermediate_size=64, **common)),
        (
            tf.GPT2LMHeadModel,
            tf.GPT2Config(
                n_embd=32, n_layer=2, n_head=4, vocab_size=64, bos_token_id=0, eos_token_id=0
            ),
        ),
        (
            tf.LlamaForCausalLM,
            tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_key_value_heads=2, **common),
        ),
    ]


def swap_all(model, make_core):
    from slapo.op import is_hf_attention

    n = 0
    for name, m in list(model.named_modules()):
        if is_hf_attention(m):
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent)._modules[child] = use_attention_core(m, make_core(), name)
            n += 1
    assert n == 2
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("core_cls", [SDPAttention, TempoAttentionCore])
def test_hf_models_with_swapped_core(impl, core_cls):
    for cls, cfg in hf_models():
        cfg._attn_implementation = impl
        for key in (
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "resid_pdrop",
            "embd_pdrop",
            "attn_pdrop",
        ):
            if hasattr(cfg, key):
                setattr(cfg, key, 0.0)
        torch.manual_seed(0)
        ref = cls(cfg).double()
        new = swap_all(copy.deepcopy(ref), core_cls)
        assert ref.config._attn_implementation == impl  # the model config is untouched
        assert set(new.state_dict()) == set(ref.state_dict())
        ids = torch.randint(0, 64, (2, 9))
        am = torch.ones(2, 9, dtype=torch.long)
        am[1, 6:] = 0  # right padding
        out_r, out_n = ref(input_ids=ids, attention_mask=am), new(input_ids=ids, attention_mask=am)
        key = "logits" if hasattr(out_r, "logits") else "last_hidden_state"
        a, b = getattr(out_r, key), getattr(out_n, key)
        # LLaMA's eager softmax runs in fp32 even in an fp64 model, hence the looser bound.
        tol = 1e-6 if impl == "eager" and "Llama" in cls.__name__ else 1e-12
        assert torch.allclose(a[0], b[0], atol=tol) and torch.allclose(a[1, :6], b[1, :6], atol=tol)
        a.sum().backward()
        b.sum().backward()
        for (name, p), q in zip(ref.named_parameters(), new.parameters()):
            if p.grad is not None:
                assert torch.allclose(p.grad, q.grad, atol=max(tol, 1e-10)), (cls.__name__, name)


def test_use_attention_core_rejects_non_attention():
    tf = pytest.importorskip("transformers")
    layer = tf.models.bert.modeling_bert.BertLayer(
        tf.BertConfig(hidden_size=32, num_attention_heads=4)
    )
    with pytest.raises(SchedulingError, match="registry"):
        use_attention_core(layer.intermediate, SDPAttention(), "intermediate")
    cfg = tf.GPT2Config(n_embd=32, n_head=4, reorder_and_upcast_attn=True)
    attn = tf.models.gpt2.modeling_gpt2.GPT2Attention(cfg, layer_idx=0)
    with pytest.raises(SchedulingError, match="reorder_and_upcast_attn"):
        use_attention_core(attn, SDPAttention(), "h.0.attn")


@pytest.mark.parametrize("core_cls", [SDPAttention, TempoAttentionCore])
def test_position_bias_is_folded_into_the_mask(core_cls):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4, dtype=D64) for _ in range(3))
    bias = torch.randn(1, 3, 5, 5, dtype=D64)
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[1, ..., 3:] = False
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = core_cls()(module, q, k, v, keep, scaling=1.0, position_bias=bias)
    s = (q @ k.transpose(-1, -2) + bias).masked_fill(~keep, float("-inf"))
    ref = (torch.softmax(s, -1) @ v).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-12)
    with pytest.raises(ValueError, match="softcap"):
        core_cls()(module, q, k, v, None, softcap=30.0)
