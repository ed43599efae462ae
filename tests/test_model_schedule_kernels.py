"""`apply_kernels` on small real HF models (GPT-2, LLaMA, BERT from configs), CPU reference path:
the scheduled model computes what the original computes (outputs and every gradient), with the
same parameter objects and state-dict keys, and every swap recorded as a `replace`."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slapo  # noqa: E402
from slapo.errors import SchedulingError  # noqa: E402
from slapo.model_schedule.kernels import PLANS, apply_kernels  # noqa: E402
from slapo.op.kernels import FusedGELU, FusedLayerNorm, FusedLlamaMLP, FusedRMSNorm  # noqa: E402

VOCAB, SEQ = 96, 10


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2,
                                  n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  max_position_embeddings=32)
    return transformers.BertForMaskedLM(cfg)


def gpt_neo():
    cfg = transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                    attention_types=[[["global"], 2]], max_position_embeddings=32,
                                    embed_dropout=0.0, resid_dropout=0.0, attention_dropout=0.0,
                                    bos_token_id=0, eos_token_id=0)
    return transformers.GPTNeoForCausalLM(cfg)


def roberta():
    cfg = transformers.RobertaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     max_position_embeddings=40, pad_token_id=1)
    return transformers.RobertaForMaskedLM(cfg)


def albert():
    cfg = transformers.AlbertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=16,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=64, hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, max_position_embeddings=32)
    return transformers.AlbertForMaskedLM(cfg)


def opt():
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                 ffn_dim=64, num_attention_heads=4, max_position_embeddings=32,
                                 word_embed_proj_dim=32, dropout=0.0, bos_token_id=0,
                                 eos_token_id=0, pad_token_id=1)
    return transformers.OPTForCausalLM(cfg)


def t5(ff_proj="gated-gelu", cls=None):
    cfg = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                num_heads=4, feed_forward_proj=ff_proj, dropout_rate=0.0,
                                decoder_start_token_id=0, pad_token_id=0)
    return (cls or transformers.T5ForConditionalGeneration)(cfg)


def t5_v1():
    return t5("relu")


def mt5():
    return t5(cls=transformers.MT5ForConditionalGeneration)


# (model factory, family, replacements: per layer x layers + outside the layers, new classes)
CASES = {
    "gpt2": (gpt2, "gpt2", 2 * 3 + 1, {FusedLayerNorm, FusedGELU}),   # ln_1, ln_2, act; ln_f
    "llama": (llama, "llama", 2 * 3 + 1, {FusedRMSNorm, FusedLlamaMLP}),  # 2 norms, mlp; norm
    # embeddings LN; per layer attention LN, act, output LN; MLM head transform act + LN
    "bert": (bert, "bert", 1 + 2 * 3 + 2, {FusedLayerNorm, FusedGELU}),
    "gpt_neo": (gpt_neo, "gpt_neo", 2 * 3 + 1, {FusedLayerNorm, FusedGELU}),  # as GPT-2
    # embeddings LN; per layer attention LN, act, output LN; the LM head's LN (its GELU is F.gelu)
    "roberta": (roberta, "roberta", 1 + 2 * 3 + 1, {FusedLayerNorm, FusedGELU}),
    # ALBERT's one shared layer (attention LN, act, output LN), embeddings LN, MLM head LN + act
    "albert": (albert, "albert", 3 + 1 + 2, {FusedLayerNorm, FusedGELU}),
    # OPT's ReLU stays: per layer self_attn_layer_norm, final_layer_norm; the decoder's final
    "opt": (opt, "opt", 2 * 2 + 1, {FusedLayerNorm}),
    # T5 v1.1: encoder blocks 2 norms + the gated GELU, decoder blocks 3 + it; a final norm each
    "t5": (t5, "t5", 2 * 3 + 1 + 2 * 4 + 1, {FusedRMSNorm, FusedGELU}),
    "t5_v1": (t5_v1, "t5", 2 * 2 + 1 + 2 * 3 + 1, {FusedRMSNorm}),  # ReLU stays
    "mt5": (mt5, "t5", 2 * 3 + 1 + 2 * 4 + 1, {FusedRMSNorm, FusedGELU}),
}


def run(model, ids):
    out = model(input_ids=ids, labels=ids)
    grads = torch.autograd.grad(out.loss, list(model.parameters()))
    return out.logits.detach(), out.loss.detach(), grads


@pytest.mark.parametrize("name", list(CASES))
def test_scheduled_model_matches_original(name):
    factory, family, expected, new_classes = CASES[name]
    torch.manual_seed(0)
    model = factory()
    ref = copy.deepcopy(model)
    keys = list(model.state_dict())
    params = dict(model.named_parameters())
    sch = slapo.create_schedule(model)

    assert apply_kernels(sch, family) == expected
    new = sch.mod
    assert list(new.state_dict()) == keys
    assert all(p is params[n] for n, p in new.named_parameters())  # shared, not copied
    assert {type(m) for m in new.modules()} >= new_classes
    assert [h.name for _, h in sch.applied()] == ["replace"] * expected

    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = run(new, ids)
    ref_logits, ref_loss, ref_grads = run(ref, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for (pname, _), g, rg in zip(new.named_parameters(), grads, ref_grads):
        torch.testing.assert_close(g, rg, rtol=1e-4, atol=1e-6, msg=pname)
    assert apply_kernels(sch, family) == 0  # the new modules are not targets


def test_llama_reference_path_is_bit_identical():
    """RMSNorm and SwiGLU reference paths are HF's own code: not even a rounding differs."""
    torch.manual_seed(0)
    model = llama()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    apply_kernels(sch, "llama")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = run(sch.mod, ids)
    ref_logits, ref_loss, ref_grads = run(ref, ids)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    assert all(torch.equal(g, rg) for g, rg in zip(grads, ref_grads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_reference_path_is_bit_identical(dtype):
    """T5's norms keep their own rounding order (`style="t5"`), in fp32 and in a bf16 model
    (v1: only the norms are swapped; the tanh GELU's reference is torch's, not HF's formula)."""
    torch.manual_seed(0)
    model = t5_v1().to(dtype)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    apply_kernels(sch, "t5")
    assert all(m.style == "t5" for m in model.modules() if isinstance(m, FusedRMSNorm))
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    logits, loss, grads = run(sch.mod, ids)
    ref_logits, ref_loss, ref_grads = run(ref, ids)
    assert torch.equal(logits, ref_logits) and torch.equal(loss, ref_loss)
    assert all(torch.equal(g, rg) for g, rg in zip(grads, ref_grads))


def test_verify_accepts_the_swap_on_one_layer():
    """`Verify` (outputs, gradients, one optimizer step) on a sub-schedule: a GPT-2 block."""
    torch.manual_seed(0)
    model = gpt2()
    sch = slapo.create_schedule(model)
    block = sch["transformer.h.0"]
    with slapo.Verify(sch, example_inputs=[torch.randint(0, VOCAB, (2, SEQ))],
                      loss_fn=lambda out: out.logits.pow(2).mean()):
        assert apply_kernels(block, "gpt2") == 3
    assert isinstance(model.transformer.h[0].ln_1, FusedLayerNorm)
    assert type(model.transformer.h[1].ln_1) is torch.nn.LayerNorm  # outside the sub-schedule


def test_unknown_family_is_refused_before_any_change():
    model = gpt2()
    sch = slapo.create_schedule(model)
    before = [type(m) for m in model.modules()]
    with pytest.raises(SchedulingError, match="no kernel plan for the 'wideresnet' family"):
        apply_kernels(sch, "wideresnet")
    with pytest.raises(SchedulingError, match="unknown kernel backend"):
        apply_kernels(sch, "gpt2", backend="cuda")
    with pytest.raises(SchedulingError, match="expects a Slapo schedule"):
        apply_kernels(model, "gpt2")
    assert [type(m) for m in model.modules()] == before and sch.applied() == []
    assert set(PLANS) == {"llama", "gpt2", "gpt_neo", "bert", "roberta", "opt", "albert", "t5"}


def test_patched_target_is_refused_before_any_change():
    """A norm already changed by a primitive (here: checkpointed) would lose that change."""
    model = gpt2()
    sch = slapo.create_schedule(model)
    sch["transformer.h.1.ln_2"].checkpoint()
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(SchedulingError, match="already changed by a primitive"):
        apply_kernels(sch, "gpt2")
    assert [type(m).__name__ for m in model.modules()] == before
    assert [h.name for _, h in sch.applied()] == ["checkpoint"]


def test_opt_keeps_relu_and_swaps_layer_norms():
    model = opt()
    sch = slapo.create_schedule(model)
    assert apply_kernels(sch, "opt") == 2 * 2 + 1  # self_attn_layer_norm, final_layer_norm; final
    assert not any(isinstance(m, FusedGELU) for m in model.modules())
