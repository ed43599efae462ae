"""Tempo layers inside real HF blocks: same gradients, same training curve, less saved memory."""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import slapo  # noqa: E402
from slapo.errors import SchedulingError  # noqa: E402
from slapo.op import (  # noqa: E402
    TempoAttentionCore,
    TempoGELU,
    TempoLayerNorm,
    apply_tempo,
    apply_tempo_to_module,
)
from slapo.profile import memory_breakdown, saved_bytes  # noqa: E402

BertLayer = transformers.models.bert.modeling_bert.BertLayer
GPT2Block = transformers.models.gpt2.modeling_gpt2.GPT2Block
RobertaLayer = transformers.models.roberta.modeling_roberta.RobertaLayer


def bert_cfg(**kw):
    base = dict(
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=256,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    base.update(kw)
    return transformers.BertConfig(**base)


def kinds(model):
    return {type(m).__name__ for m in model.modules()}


def rel_err(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_same_grads(ref, new, x_ref, x_new, out_ref, out_new):
    g = torch.randn_like(out_ref)
    params_r = [p for _, p in sorted(ref.named_parameters())]
    params_n = [p for _, p in sorted(new.named_parameters())]
    gr = torch.autograd.grad(out_ref, [x_ref, *params_r], g)
    gn = torch.autograd.grad(out_new, [x_new, *params_n], g)
    for (name, _), a, b in zip(sorted(ref.named_parameters()), gr[1:], gn[1:]):
        if b.norm() < 1e-9:  # e.g. the key bias: its true gradient is 0 (softmax shift invariance)
            assert (a - b).abs().max() < 1e-12, name
        else:
            assert rel_err(a, b) < 1e-10, name
    assert rel_err(gr[0], gn[0]) < 1e-10


@pytest.mark.parametrize(
    "make",
    [
        lambda: BertLayer(bert_cfg()),
        lambda: RobertaLayer(
            transformers.RobertaConfig(
                hidden_size=64,
                num_attention_heads=4,
                intermediate_size=256,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                attn_implementation="eager",
            )
        ),
        lambda: GPT2Block(
            transformers.GPT2Config(
                n_embd=64, n_head=4, resid_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"
            ),
            layer_idx=0,
        ),
    ],
    ids=["bert", "roberta", "gpt2"],
)
def test_fp64_layer_grads_match(make):
    torch.manual_seed(0)
    ref = make().double().train()
    new = apply_tempo_to_module(copy.deepcopy(ref))
    assert {"TempoGELU", "TempoLayerNorm", "TempoAttentionCore"} <= kinds(new)
    assert "TempoGELU" not in kinds(ref)  # the original is untouched
    x = torch.randn(2, 12, 64, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    kw = {}
    if isinstance(ref, GPT2Block):  # the model passes eager attention an additive causal mask
        m = torch.full((12, 12), torch.finfo(torch.float64).min, dtype=torch.float64).triu(1)
        kw["attention_mask"] = m[None, None]
    out_r, out_n = ref(x, **kw), new(x2, **kw)
    out_r = out_r[0] if isinstance(out_r, tuple) else out_r
    out_n = out_n[0] if isinstance(out_n, tuple) else out_n
    assert rel_err(out_n, out_r) < 1e-13
    assert_same_grads(ref, new, x, x2, out_r, out_n)


def test_sdpa_models_keep_their_attention():
    layer = BertLayer(bert_cfg(attn_implementation="sdpa"))
    new = apply_tempo_to_module(layer)
    assert "TempoAttentionCore" not in kinds(new) and "TempoGELU" in kinds(new)


def tiny_bert(seed: int):
    torch.manual_seed(seed)
    cfg = bert_cfg(vocab_size=50, num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    cfg.max_position_embeddings = 32
    return transformers.BertForMaskedLM(cfg)


def test_fp32_training_curve_matches():
    base = tiny_bert(0)
    tempo = apply_tempo_to_module(copy.deepcopy(base))
    assert {"TempoGELU", "TempoLayerNorm", "TempoAttentionCore"} <= kinds(tempo)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (base, tempo)]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 50, (4, 16), generator=g)
    diffs, losses = [], []
    for _ in range(200):
        step_losses = []
        for m, opt in zip((base, tempo), opts):
            loss = m(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            step_losses.append(loss.item())
        diffs.append(abs(step_losses[0] - step_losses[1]))
        losses.append(step_losses[0])
    assert losses[-1] < 0.5 * losses[0]  # it really trained
    assert max(diffs) < 1e-3


@pytest.mark.parametrize("seq,minimum", [(128, 0.30), (512, 0.40)])
def test_bert_large_layer_saved_bytes_drop(seq, minimum):
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        hidden_size=1024,
        num_attention_heads=16,
        intermediate_size=4096,
        attn_implementation="eager",
    )
    layer = BertLayer(cfg).train()  # dropout 0.1 everywhere, as in pre-training
    tempo = apply_tempo_to_module(copy.deepcopy(layer))
    x = torch.randn(2, seq, 1024)
    if seq == 128:  # the full breakdown (forward + backward), per module
        for m in (layer, tempo):  # gradients exist already, as in steady-state training
            m(x).sum().backward()
        rb = memory_breakdown(layer, (x,), exclude=[x])
        rt = memory_breakdown(tempo, (x,), exclude=[x])
        base, new = rb.activations, rt.activations
        n_ffn = 2 * seq * 4096
        # Baseline: GELU keeps its input, FC2 keeps GELU's output.
        assert rb.per_module["intermediate.intermediate_act_fn"]["activations"] == 4 * n_ffn
        assert rb.per_module["output.dense"]["activations"] == 4 * n_ffn
        # Tempo: GELU keeps its output (which FC2 shares) + 1-byte codes.
        gelu = rt.per_module["intermediate.intermediate_act_fn"]["activations"]
        assert gelu == 5 * n_ffn
        assert "activations" not in rt.per_module.get("output.dense", {})
        # The transient peak of the whole step (temporaries included) is lower too.
        assert rt.peak_live < 0.9 * rb.peak_live
    else:  # forward only
        base = saved_bytes(layer, x, exclude=[x])
        new = saved_bytes(tempo, x, exclude=[x])
    drop = 1 - new / base
    print(f"BERT-Large layer s={seq}: {base / 2**20:.1f} -> {new / 2**20:.1f} MiB (-{drop:.1%})")
    assert drop >= minimum


def test_apply_tempo_with_schedule():
    create = getattr(slapo, "create_schedule", None)
    if create is None:
        pytest.skip("slapo.create_schedule not available yet")
    torch.manual_seed(0)
    model = transformers.BertModel(bert_cfg(num_hidden_layers=2, vocab_size=50)).double()
    ref = copy.deepcopy(model)
    sch = create(model)
    # A sub-schedule (one BertLayer) first: only that layer changes.
    done = apply_tempo(sch["encoder.layer.0"])
    paths = [p for p, _ in done]
    assert "encoder.layer.0.intermediate.intermediate_act_fn" in paths
    assert all(p.startswith("encoder.layer.0.") for p in paths)
    assert isinstance(sch.mod.encoder.layer[0].output.LayerNorm, TempoLayerNorm)
    assert type(sch.mod.encoder.layer[1].output.LayerNorm) is torch.nn.LayerNorm
    # Then the whole model: layer 1, embeddings' LayerNorm; layer 0 is not replaced twice.
    done2 = apply_tempo(sch)
    assert {p for p, _ in done2}.isdisjoint(paths)
    m = sch.mod
    assert isinstance(m.embeddings.LayerNorm, TempoLayerNorm)
    assert isinstance(m.encoder.layer[1].intermediate.intermediate_act_fn, TempoGELU)
    assert isinstance(m.encoder.layer[1].attention.self.attn_core, TempoAttentionCore)
    # Same parameters (objects), same state-dict keys, same results.
    assert (
        m.encoder.layer[1].attention.self.query.weight
        is model.encoder.layer[1].attention.self.query.weight
    )
    assert set(m.state_dict()) == set(ref.state_dict())
    ids = torch.randint(0, 50, (2, 10))
    assert torch.allclose(
        m(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state, atol=1e-12
    )
    with pytest.raises(SchedulingError, match="schedule"):
        apply_tempo(model)


def test_replace_helpers_reject_wrong_targets():
    create = getattr(slapo, "create_schedule", None)
    if create is None:
        pytest.skip("slapo.create_schedule not available yet")
    from slapo.op import replace_attention_core, replace_gelu, replace_layernorm

    sch = create(BertLayer(bert_cfg()))
    replace_gelu(sch["intermediate.intermediate_act_fn"])
    replace_layernorm(sch["output.LayerNorm"])
    replace_attention_core(sch["attention.self"])
    assert {"TempoGELU", "TempoLayerNorm", "TempoAttentionCore"} <= kinds(sch.mod)
    with pytest.raises(SchedulingError, match="GELU"):
        replace_gelu(sch["output.dense"])
    with pytest.raises(SchedulingError, match="LayerNorm"):
        replace_layernorm(sch["output.dense"])
    with pytest.raises(SchedulingError, match="registry"):
        replace_attention_core(sch["output"])
