"""Left-padded batches (an `attention_mask` with zeros) through Slapo's attention cores, for
every family: `attention="sdpa"` and `tempo=True` replace the model's attention, and each model
builds its padding mask its own way (BERT-style additive 4-D masks, causal + padding, GPT-Neo's
local window, Mistral's sliding window, T5's position bias folded into the mask). The knob grids
run unpadded batches only, so a core that dropped or mis-broadcast the padding would pass them:
here loss and every gradient must equal the unscheduled model's on a padded batch, and the
padding must move the real tokens' logits (else the test would not see a dropped mask). A core
that used row 0's mask for every row fails every case but GPT-Neo's, whose attention neither
knob replaces (checked)."""

from __future__ import annotations

import copy

import models
import pytest
import torch

from slapo import model_schedule
from slapo.op import SDPAttention, TempoAttentionCore

FAMILIES = ["gpt2", "llama", "bert_mlm", "roberta", "albert", "gpt_neo", "opt", "t5", "mt5",
            "mistral", "qwen2"]
LOSS_ATOL, LOSS_RTOL = 2e-6, 2e-7  # fp32 roundoff (mT5's loss at init is 37)
# Tempo's attention core replaces eager attention only (HF's default, SDPA, is kept as is)
KNOBS = {"sdpa": {"attention": "sdpa"}, "tempo": {"attention": "eager", "tempo": True}}
PAD = 10  # row 1's first 10 of 16 tokens are padding: left padding, which a causal model's
# later tokens would attend to without the mask (right padding would hide a dropped mask there)


def padded_batch(family: str) -> dict:
    batch = models.batch_for(family)
    x = batch["input_ids"]
    mask = torch.ones_like(x)
    mask[1, :PAD] = 0
    batch["attention_mask"] = mask
    if family not in ("t5", "mt5"):  # no loss on padding (T5's labels are the decoder's),
        # nor on the first real token: a causal LM predicts it from the last padded position,
        # whose fully masked attention row HF's eager and SDPA paths fill differently
        batch["labels"] = x.masked_fill(mask == 0, -100)
        batch["labels"][1, PAD] = -100
    return batch


def loss_and_grads(model, batch) -> tuple[torch.Tensor, dict]:
    model.train()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_the_unscheduled_model(family, knob):
    ref = getattr(models, family)(seed=0)
    model = copy.deepcopy(ref)
    if knob == "sdpa" and family == "gpt_neo":  # its attention is outside HF's registry
        with pytest.warns(UserWarning, match="changed nothing in GPTNeoForCausalLM"):
            model_schedule.apply(model, **KNOBS[knob])
    else:
        model_schedule.apply(model, **KNOBS[knob])
        core = SDPAttention if knob == "sdpa" else TempoAttentionCore
        if family != "gpt_neo":  # the core this test is about is really in the model
            assert any(isinstance(m, core) for m in model.modules())
    batch = padded_batch(family)
    l_ref, g_ref = loss_and_grads(ref, batch)
    unpadded = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]))
    with torch.no_grad():  # the padding changes the real tokens' logits (T5: the decoder's)
        real = slice(None) if family in ("t5", "mt5") else slice(PAD, None)
        moved = ref(**batch).logits[1, real] - ref(**unpadded).logits[1, real]
        assert moved.abs().max() > 1e-3, moved.abs().max()
    l_new, g_new = loss_and_grads(model, batch)
    torch.testing.assert_close(l_new, l_ref, rtol=LOSS_RTOL, atol=LOSS_ATOL)
    assert g_new.keys() == g_ref.keys() and len(g_ref) > 10
    for n in g_ref:
        torch.testing.assert_close(g_new[n], g_ref[n], rtol=1e-4, atol=1e-5, msg=n)  # mT5: 1e-6
