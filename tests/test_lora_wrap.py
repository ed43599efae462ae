"""`add_lora`: PEFT's LoRA on a model before scheduling, targets checked first; by default the
projections the family's tensor-parallel plan splits (in process, one rank)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")


def test_default_targets_are_the_plan_projections():
    import models

    from slapo.model_schedule.lora_wrap import default_targets

    gpt2 = default_targets(models.gpt2())
    assert gpt2[:4] == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                        "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]
    assert len(gpt2) == 8
    bert = default_targets(models.bert())
    assert "pooler.dense" not in bert and len(bert) == 12  # 6 projections x 2 layers
    assert len(default_targets(models.qwen3())) == 14  # the norms are no projections


def test_add_lora_wraps_and_schedules_like_the_base():
    import models
    import peft

    from slapo.model_schedule import apply
    from slapo.model_schedule.lora_wrap import add_lora

    model = models.llama()
    ids = models.ids()
    want = model(ids, labels=ids).loss
    pm = add_lora(model, r=4, alpha=8)
    assert isinstance(pm, peft.PeftModel)
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert len(trainable) == 28 and all("lora_" in n for n in trainable)
    sch = apply(pm, ckpt_ratio=1.0)  # one rank: the family runs on the wrapped model
    assert sch.mod is pm and sch["base_model.model.model.layers.0"].history
    torch.testing.assert_close(pm(input_ids=ids, labels=ids).loss, want)  # B starts at 0


@pytest.mark.parametrize("targets, says", [(["q_proj", "nope"], "['nope'] match no module"),
                                           ("q_proj", "non-empty list")])
def test_bad_targets_are_refused_unchanged(targets, says):
    import models

    from slapo.errors import SchedulingError
    from slapo.model_schedule.lora_wrap import add_lora

    model = models.llama()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(SchedulingError, match=says.replace("[", r"\[").replace("]", r"\]")):
        add_lora(model, r=4, targets=targets)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert all(p.requires_grad for p in model.parameters())


def test_bad_rank_and_dropout_are_refused():
    import models

    from slapo.errors import SchedulingError
    from slapo.model_schedule.lora_wrap import add_lora

    with pytest.raises(SchedulingError, match="positive int"):
        add_lora(models.gpt2(), r=0)
    with pytest.raises(SchedulingError, match="dropout"):
        add_lora(models.gpt2(), r=4, dropout=1.5)
