"""Pipelines for every family, not the first two.

1. Every family with a ready schedule, cut by `model_schedule.apply(pp_stages=...)` and run on
   2 gloo ranks, trains like one process (losses, every parameter, every parameter held by
   exactly one rank's stages); ALBERT and T5 are refused before anything is cut.
2. The stage modules reproduce each supported model type's own forward (logits and every
   gradient), sliding-window attention included: Mistral and Qwen2/3 with a window shorter than
   the sequence trained silently wrong before the stages made the model's own masks.
3. Model types with the same module names but a forward the stages do not reproduce are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from reference import LR, reference_losses

import slapo
from slapo import model_schedule
from slapo.runtime.partition import partition, run_stages

PIPELINED = ["bert_mlm", "roberta", "gpt2", "gpt_neo", "opt", "llama", "qwen2", "qwen3"]


def _batches(family: str) -> list[dict]:
    import models

    return [models.batch_for(family, batch=4, seq=16, seed=s) for s in (10, 11, 10, 11)]


def job_family_pipeline(family: str, schedule: str):
    import models

    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    model = getattr(models, family)(seed=0, layers=4)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    model_schedule.apply(sch, pp_stages=4 if schedule == "Interleaved1F1B" else 2)
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        pipeline=schedule, num_microbatches=2)
    batches = _batches(family)
    losses = [tm.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses(ref, batches)),
                               rtol=1e-5, atol=0)
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    held = []
    for stage in tm.stages:
        for n, p in stage.named_parameters(remove_duplicate=False):
            torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=n: f"{n}: {m}")
            held.append(n)
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, held)
    together = everyone[0] + everyone[1]
    assert sorted(together) == sorted(ref_params), set(ref_params) ^ set(together)
    return losses


@pytest.mark.dist
@pytest.mark.parametrize("family", PIPELINED)
def test_every_family_pipelined_matches_one_process(dist2, family):
    res = dist2.run(job_family_pipeline, family, "1F1B", timeout=300)
    assert res[0] == res[1]


@pytest.mark.dist
@pytest.mark.parametrize("family", ["gpt_neo", "opt"])
def test_new_layouts_interleaved_match_one_process(dist2, family):
    res = dist2.run(job_family_pipeline, family, "Interleaved1F1B", timeout=300)
    assert res[0] == res[1]


@pytest.mark.parametrize("family,needle", [("albert", "one shared layer"),
                                           ("t5", "encoder-decoder")])
def test_unpipelinable_families_are_refused_before_any_cut(family, needle):
    import models

    model = getattr(models, family)(layers=4)
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match=needle) as e:
        model_schedule.apply(sch, pp_stages=2, ckpt_ratio=0.5)
    assert "without pp_stages" in str(e.value)
    assert not sch.pipeline_cuts and not list(sch.applied())


# ------------------------------------------------------------------------------------------------
# 2. the stages are the model's forward, model type by model type
# ------------------------------------------------------------------------------------------------

SMALL = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
         "max_position_embeddings": 64, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def _opt(**over):
    cfg = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "ffn_dim": 128,
           "vocab_size": 128, "max_position_embeddings": 64, "dropout": 0.0,
           "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1, **over}
    return tf.OPTForCausalLM(tf.OPTConfig(**cfg))


CASES = {
    "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=64, n_layer=4, n_head=4,
                                                     vocab_size=128, n_positions=64)),
    # layers alternate global and local attention; window 4 < 16 tokens
    "gpt_neo": lambda: tf.GPTNeoForCausalLM(tf.GPTNeoConfig(
        hidden_size=64, num_layers=4, num_heads=4, vocab_size=128, max_position_embeddings=64,
        attention_types=[[["global", "local"], 2]], window_size=4)),
    "opt": _opt,
    # OPT-350m's shape: embeddings narrower than the layers, post-LayerNorm, no final norm
    "opt_project": lambda: _opt(word_embed_proj_dim=32, do_layer_norm_before=False),
    "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**SMALL)),
    "mistral_window": lambda: tf.MistralForCausalLM(tf.MistralConfig(**SMALL, sliding_window=4)),
    "qwen2_window": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "qwen3_window": lambda: tf.Qwen3ForCausalLM(tf.Qwen3Config(
        **SMALL, head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=64)),
    "roberta": lambda: tf.RobertaForMaskedLM(tf.RobertaConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        vocab_size=128, max_position_embeddings=80, pad_token_id=1)),
}


def _cut_every_layer(sch) -> None:
    layers = next(path for path in ("transformer.h", "model.layers", "model.decoder.layers",
                                    "bert.encoder.layer", "roberta.encoder.layer") if path in sch)
    for i in range(3):
        sch[f"{layers}.{i}"].cut_pipeline_stage()


@pytest.mark.parametrize("case", sorted(CASES))
def test_stages_reproduce_the_models_forward_and_gradients(case):
    torch.manual_seed(0)
    model = CASES[case]().eval()  # eval: no dropout, so the two runs are comparable
    ref = copy.deepcopy(model)
    if case.endswith("_window"):  # the window must matter, or the test proves nothing
        assert "sliding_attention" in (getattr(model.config, "layer_types", None) or
                                       ["sliding_attention"])
    sch = slapo.create_schedule(model)
    _cut_every_layer(sch)
    stages = partition(sch)
    assert len(stages) == 4
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = ref(input_ids=ids).logits
    got = run_stages(stages, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().mean().backward()
    want.square().mean().backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        g, r = p.grad, ref_grads[name].grad
        assert (g is None) == (r is None), name
        if g is not None:
            torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_sliding_window_changes_the_output():
    """The window cases above are not vacuous: the same weights with full attention differ."""
    torch.manual_seed(0)
    model = CASES["mistral_window"]().eval()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    windowed = model(input_ids=ids).logits
    model.config.sliding_window = None
    assert (model(input_ids=ids).logits - windowed).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------
# 3. same module names, another forward: refused, naming why
# ------------------------------------------------------------------------------------------------

REFUSED = {
    "gemma": (lambda: tf.GemmaForCausalLM(tf.GemmaConfig(**SMALL, head_dim=16)), "model.layers",
              "laid out like llama"),
    "phi3": (lambda: tf.Phi3ForCausalLM(tf.Phi3Config(**SMALL)), "model.layers",
             "laid out like llama"),
    "deberta": (lambda: tf.DebertaV2Model(tf.DebertaV2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128)), "encoder.layer", "laid out like BERT"),
    "opt_layerdrop": (lambda: _opt(layerdrop=0.5), "model.decoder.layers", "layerdrop"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unverified_model_types_are_refused(case):
    make, layers, needle = REFUSED[case]
    sch = slapo.create_schedule(make())
    sch[f"{layers}.0"].cut_pipeline_stage()
    with pytest.raises(slapo.SchedulingError, match=needle):
        partition(sch)


def test_2023_pipeline_cuts_refuse_t5_before_changing_the_model():
    import models

    from slapo.model_schedule.compat import apply_schedule

    model = models.t5(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(slapo.SchedulingError, match="encoder-decoder"):
        apply_schedule(model, "t5", pipeline_cuts=[[0], [0]], bf16=True)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())
