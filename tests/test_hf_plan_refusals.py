"""Bad input to the families derived from a model's declared plan (`model_schedule/hf_plan.py`):
a style Slapo does not know, a head count tp does not divide, what the translation refuses
(identity experts, a module-output all-reduce, experts whose split would not be exact, a
plan that splits nothing in the layers), a knob
the derived family has no plan for, and a model with neither a declared plan nor a family.
Each is a `SchedulingError` naming the reason and the fix, raised before any change
(`test_bad_input_api._rejected` compares a full snapshot of the model and schedule).

One process: the world of 2 is torch's fake process group (validation runs no collective).
"""

from __future__ import annotations

import pytest
import torch.nn as nn
from hf_tiny import build
from test_bad_input_api import _rejected, fake_world_of_two  # noqa: F401 - the fixture

import slapo
from slapo import model_schedule
from slapo.model_schedule.hf_plan import DeclaredPlan, RefusedPlan


def _sch(model):
    return slapo.create_schedule(model)


def _granite(**overrides):
    model = build("granite", "GraniteForCausalLM")
    for k, v in overrides.items():
        setattr(model.config, k, v)
    return model


def test_a_model_without_a_family_gets_its_declared_plan():
    family = model_schedule.detect(_granite())
    assert family.name == "declared:granite" and family.layer_lists == ("model.layers",)
    assert isinstance(family.tp_plan, DeclaredPlan)
    rows = {(p, type(s).__name__) for p, s in family.tp_plan.entries}
    assert ("self_attn.q_proj", "EnterRegion") in rows and ("mlp.down_proj", "Row") in rows


def test_hand_written_families_override_the_declared_plan():
    assert model_schedule.detect(build("llama", "LlamaForCausalLM")).name == "llama"


def test_unknown_style():
    plan = {**_granite().config.base_model_tp_plan, "layers.*.mlp.down_proj": "rowwise_magic"}
    sch = _sch(_granite(base_model_tp_plan=plan))
    _rejected(sch, lambda s: model_schedule.apply(s, tp=2), "model.layers",
              ("'rowwise_magic'", "layers.*.mlp.down_proj", "does not know", "tp=1"))


def test_kv_heads_tp_does_not_divide():
    model = build("granite", "GraniteForCausalLM")
    model.config.num_key_value_heads = 1  # MQA: one KV head cannot split over 2 ranks
    for layer in model.model.layers:
        for name in ("k_proj", "v_proj"):
            setattr(layer.self_attn, name, nn.Linear(64, 16, bias=False).double())
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "",
              ("num_key_value_heads=1 is not divisible by 2", "choose a tp"))


@pytest.mark.parametrize("model_type,cls,needles", [
    ("inkling_text", "InklingForCausalLM", ("'all_reduce'", "outside a row projection")),
    ("bamba", "BambaForCausalLM", ("no layer rows", "splits nothing")),
])
def test_refused_with_a_named_reason(model_type, cls, needles):
    model = build(model_type, cls)
    family = model_schedule.detect(model)
    assert isinstance(family.tp_plan, RefusedPlan)
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "model.layers",
              (*needles, "use tp=1"))
    model_schedule.apply(_sch(model), tp=1, ckpt_ratio=0.5)  # the other knobs still apply


def test_a_parameter_no_row_covers_in_a_split_module_is_refused(monkeypatch):
    """Apertus's declared plan leaves out its xIELU activation's scalars (`mlp.act_fn.alpha_p`),
    which act on one rank's MLP features: as declared it is refused, naming the parameter;
    Slapo's supplement (`plan_supplements.py`) is what makes it equivalent (test_hf_plans)."""
    from slapo.model_schedule import plan_supplements

    monkeypatch.delitem(plan_supplements.SUPPLEMENTS, "apertus")
    model = build("apertus", "ApertusForCausalLM")
    assert isinstance(model_schedule.detect(model).tp_plan, RefusedPlan)
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "model.layers",
              ("'mlp.act_fn.alpha_p'", "one rank's share", "use tp=1"))


def test_a_layer_with_part_of_a_place_s_projections_is_refused():
    """A hybrid layer whose `self_attn` is another kind keeps it whole (MiniMax's linear
    attention, test_hf_plans); one that has some of the declared projections but not all
    would split a projection without its partner: refused."""
    model = _granite()
    del model.model.layers[1].self_attn.k_proj
    plan = model_schedule.detect(model).tp_plan
    assert isinstance(plan, RefusedPlan) and "layer 1 has" in plan.problem
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "model.layers",
              ("a projection without the one that completes it", "use tp=1"))


def _qwen2_moe(**flags):
    model = build("qwen2_moe", "Qwen2MoeForCausalLM")
    for layer in model.model.layers:
        for k, v in flags.items():
            setattr(layer.mlp.experts, k, v)
    return model


QWEN_EXPERTS = "model.layers.0.mlp.experts"


def _lookalike_llama4():
    """Llama 4's experts have no flags; their layout is known by class *and* module
    (`plan_experts.KNOWN_LAYOUTS`, proven by test_hf_plans), so a class of the same name from
    elsewhere, whose forward was never read, is refused."""
    model = build("llama4_text", "Llama4ForCausalLM")
    for layer in model.model.layers:
        experts = getattr(layer.feed_forward, "experts", None)
        if experts is not None:
            experts.__class__ = type("Llama4TextExperts", (type(experts),),
                                     {"__module__": "my_models.llama4"})
    return model


@pytest.mark.parametrize("model,path,needles", [
    (lambda: _qwen2_moe(has_bias=True), QWEN_EXPERTS, ("expert biases", "once per rank")),
    (lambda: _qwen2_moe(has_post_expert_norm=True), QWEN_EXPERTS,
     ("normalises each expert's output",)),
    (lambda: _qwen2_moe(is_transposed="no"), QWEN_EXPERTS,
     ("no `use_experts_implementation` flags",)),
    (lambda: _lookalike_llama4(), "model.layers.0.feed_forward.experts",
     ("Llama4TextExperts has no",)),
], ids=["bias", "post_expert_norm", "no_flags", "lookalike"])
def test_expert_tp_refuses_what_it_cannot_split_exactly(model, path, needles):
    """Tensor-parallel experts (`plan_experts.Experts`) are refused, before any change, where
    the split would not be the model's computation."""
    _rejected(_sch(model()), lambda s: model_schedule.apply(s, tp=2), path, (*needles, "tp=1"))


def test_identity_experts_are_refused():
    """LongCat's zero-compute experts return their input on every rank, which the experts'
    all-reduce would multiply by tp (its tiny model takes 40 s to build: Qwen2-MoE declares
    the row here instead)."""
    model = _qwen2_moe()
    plan = {**model.config.base_model_tp_plan,
            "layers.*.mlp.experts.identity_expert": "moe_identity_expert"}
    model.config.base_model_tp_plan = plan
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "model.layers",
              ("'moe_identity_expert'", "identity expert", "use tp=1"))


def test_expert_tp_has_no_sequence_parallel_form():
    model = _qwen2_moe()
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2, sequence_parallel=True), "",
              ("sequence_parallel",))


def test_sequence_parallel_has_no_derived_plan():
    _rejected(_sch(_granite()), lambda s: model_schedule.apply(s, tp=2, sequence_parallel=True),
              "", ("sequence_parallel is not implemented for the declared:granite family",))


def test_no_declared_plan_and_no_family():
    model = build("granite", "GraniteForCausalLM")
    model.config.base_model_tp_plan = None
    _rejected(_sch(model), lambda s: model_schedule.apply(s, tp=2), "",
              ("no ready schedule", "declares no base_model_tp_plan", "register_family"))


@pytest.mark.parametrize("model_type,cls", [("gemma3_text", "Gemma3ForCausalLM"),
                                            ("apertus1p5_text", "Apertus1p5TextForCausalLM")])
def test_vocab_parallel_leaves_what_its_kernel_would_change(model_type, cls):
    """Gemma 3's embedding scales its lookup in its own forward, which the vocabulary-parallel
    kernel replaces; Apertus 1.5's loss reads `lm_head.out_features`, which the shard halves.
    Both keep an unsharded embedding and head (the sweep found the first silently wrong)."""
    from slapo.model_schedule import _common

    model = build(model_type, cls)
    assert _common.vocab_parallel(_sch(model)) is False
    assert getattr(model.get_input_embeddings().weight, "_slapo_shard", None) is None
    assert getattr(model.get_output_embeddings().weight, "_slapo_shard", None) is None


def test_slapo_style_supplement_rows_split_what_they_name():
    """The sweep proves LFM3 equivalent at tp=2, which a row that split nothing would also be:
    here its short convolution's packed projection, depthwise weight and output projection,
    and its per-head output gate, are split (LFM3's tiny layers: conv, sliding, full)."""
    model = build("lfm3", "Lfm3ForCausalLM")
    model_schedule.apply(_sch(model), tp=2)
    conv, attn = model.model.layers[0].conv, model.model.layers[1].self_attn
    assert conv.in_proj.weight.shape == (96, 64) and conv.conv.weight.shape == (32, 1, 7)
    assert conv.out_proj.weight.shape == (64, 32) and attn.g_proj.weight.shape == (2, 64)
