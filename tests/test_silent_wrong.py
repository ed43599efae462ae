"""The silent-wrong training paths of issue 15, on real gloo ranks and one process.

1. Pipelined masked-LM encoders (BERT, RoBERTa) train their MLM head: GPipe, 1F1B,
   Interleaved1F1B and ZBVZeroBubble match one process; a parameter in no stage is refused at
   `build`; an exception on one rank during `train_step` is raised on every rank.
2. Under plain TP, dropout inside the head/feature-sharded regions draws per-rank masks while
   the replicated regions keep identical masks (every registered family), reproducibly under
   `checkpoint`.
3. `model_schedule.apply` checks every knob (and heads / KV heads against tp) before changing
   anything.
"""

from __future__ import annotations

import copy

import pytest
import sweep
import torch
from reference import LR, STEPS, reference_losses, runnable_schedules

# ------------------------------------------------------------------------------------------------
# models (small, from configs; dropout where the test needs it)
# ------------------------------------------------------------------------------------------------


def _mlm(family: str, layers: int = 4):
    import models

    return models.bert_mlm(seed=0, layers=layers) if family == "bert" else \
        models.roberta(seed=0, layers=layers)


def _mlm_batches(family: str, batch: int = 8, seq: int = 16) -> list[dict]:
    import models

    out = []
    for seed in (10, 11, 10, 11, 10)[:STEPS]:
        ids = models.ids(batch=batch, seq=seq, seed=seed)
        if family == "roberta":
            ids = ids.clamp(min=3)  # keep clear of padding/special ids
        out.append({"input_ids": ids, "labels": ids})
    return out


P = 0.5  # dropout everywhere: any mask mistake shows
# dynamo's cheapest backend for the compiled-TP tests; torch before 2.13 refuses "eager" under
# TP (it drops the gradient through forward all-reduces: slapo/primitives/compile.py)
EAGER = "eager" if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13) else "aot_eager"


def dropout_model(family: str, p: float = P, **over):
    """One small model per registered family with dropout `p` in every dropout site."""
    import transformers as tf

    torch.manual_seed(0)
    common = {"vocab_size": 128, "max_position_embeddings": 64}
    specs = {
        "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel,
                 {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64, "resid_pdrop": p,
                  "embd_pdrop": p, "attn_pdrop": p, "bos_token_id": 0, "eos_token_id": 0}),
        "gpt_neo": (tf.GPTNeoConfig, tf.GPTNeoForCausalLM,
                    {"hidden_size": 64, "num_layers": 2, "num_heads": 4,
                     "attention_types": [[["global", "local"], 1]], "window_size": 8,
                     "embed_dropout": p, "attention_dropout": p, "resid_dropout": p,
                     "bos_token_id": 0, "eos_token_id": 0}),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM,
                  {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "attention_dropout": p,
                   "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}),
        "opt": (tf.OPTConfig, tf.OPTForCausalLM,
                {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "ffn_dim": 128, "word_embed_proj_dim": 64, "dropout": p,
                 "attention_dropout": p, "bos_token_id": 0, "eos_token_id": 0,
                 "pad_token_id": 1}),
        "bert": (tf.BertConfig, tf.BertForMaskedLM,
                 {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "intermediate_size": 128, "hidden_dropout_prob": p,
                  "attention_probs_dropout_prob": p}),
        "roberta": (tf.RobertaConfig, tf.RobertaForMaskedLM,
                    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 128, "hidden_dropout_prob": p,
                     "attention_probs_dropout_prob": p, "pad_token_id": 1,
                     "max_position_embeddings": 80}),
        "albert": (tf.AlbertConfig, tf.AlbertForMaskedLM,
                   {"hidden_size": 64, "embedding_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "intermediate_size": 128,
                    "hidden_dropout_prob": p, "attention_probs_dropout_prob": p,
                    "classifier_dropout_prob": p}),
        "t5": (tf.T5Config, tf.T5ForConditionalGeneration,
               {"d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2,
                "num_decoder_layers": 2, "num_heads": 4, "decoder_start_token_id": 0,
                "pad_token_id": 0, "dropout_rate": p}),
    }
    cfg_cls, model_cls, kw = specs[family]
    cfg = cfg_cls(**{**common, **kw, **over})
    return model_cls(cfg)


# the module whose *input* is the output of each sharded random region of layer 0: the
# row-parallel projection after the attention core (and T5's FF `wo`, after its dropout)
ROW_INPUTS = {
    "gpt2": ["transformer.h.0.attn.c_proj"],
    "gpt_neo": ["transformer.h.0.attn.attention.out_proj"],
    "llama": ["model.layers.0.self_attn.o_proj"],
    "opt": ["model.decoder.layers.0.self_attn.out_proj"],
    "bert": ["bert.encoder.layer.0.attention.output.dense"],
    "roberta": ["roberta.encoder.layer.0.attention.output.dense"],
    "albert": ["albert.encoder.albert_layer_groups.0.albert_layers.0.attention.dense"],
    "t5": ["encoder.block.0.layer.0.SelfAttention.o",
           "encoder.block.0.layer.1.DenseReluDense.wo",
           "decoder.block.0.layer.1.EncDecAttention.o"],
}
FAMILIES = list(ROW_INPUTS)
# the compiled checks' default sample (tests/sweep.py), each family in one of the two checks:
# an attention-core fork with learned positions (GPT-2) and whole-layer forks (OPT) kept whole
# without dropout; RoPE with GQA (LLaMA) and an encoder (BERT) replaying dropout
COMPILED_WHOLE = sweep.sample(FAMILIES, ["gpt2", "opt"])
COMPILED_DROPOUT = sweep.sample(FAMILIES, ["llama", "bert"])
# the families whose ready schedule has a sequence-parallel plan (ALBERT and T5 have none)
SP_FAMILIES = ["gpt2", "gpt_neo", "llama", "opt", "bert", "roberta"]


def _batch(family: str) -> dict:
    import models

    return models.batch_for(family if family != "t5" else "t5", batch=2, seq=16)


# ------------------------------------------------------------------------------------------------
# 1. pipelines: masked-LM heads, stage coverage, errors on every rank
# ------------------------------------------------------------------------------------------------

MLM_CASES = runnable_schedules([
    ("GPipe", ["{p}encoder.layer.1"]), ("1F1B", ["{p}encoder.layer.2"]),
    ("Interleaved1F1B", ["{p}encoder.layer.0", "{p}encoder.layer.1", "{p}encoder.layer.2"]),
    ("ZBVZeroBubble", ["{p}encoder.layer.0", "{p}encoder.layer.1", "{p}encoder.layer.2"])])


def job_pp_mlm(family: str):
    """The masked-LM model pipelined over 2 ranks, with its own loss (`outputs.loss`), on the
    four schedules: losses equal one process (rtol 1e-5, 5 AdamW steps); every parameter the
    rank holds equals the one-process model's, the head's included, and the head moved."""
    import slapo
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    prefix = "bert." if family == "bert" else "roberta."
    head = "cls." if family == "bert" else "lm_head."
    out = {}
    for name, cuts in MLM_CASES:
        model = _mlm(family)
        ref = copy.deepcopy(model)
        start = {n: p.detach().clone()
                 for n, p in model.named_parameters(remove_duplicate=False)}
        sch = slapo.create_schedule(model, mesh=mesh)
        for c in cuts:
            sch[c.format(p=prefix)].cut_pipeline_stage()
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                            pipeline=name, num_microbatches=4)
        batches = _mlm_batches(family)
        losses = [tm.train_step(b) for b in batches]
        ref_losses = reference_losses(ref, batches)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m, name=name: f"{name}: {m}")
        ref_params = dict(ref.named_parameters(remove_duplicate=False))
        held, moved = set(), set()
        for stage in tm.stages:
            for n, p in stage.named_parameters(remove_duplicate=False):
                torch.testing.assert_close(p.detach(), ref_params[n].detach(), rtol=1e-4,
                                           atol=1e-5, msg=lambda m, n=n, s=name: f"{s} {n}: {m}")
                held.add(n)
                if n in start and not torch.equal(p.detach(), start[n]):
                    moved.add(n)
        everyone = [None, None]
        torch.distributed.all_gather_object(everyone, (sorted(held), sorted(moved)))
        all_held = set(everyone[0][0]) | set(everyone[1][0])
        all_moved = set(everyone[0][1]) | set(everyone[1][1])
        names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert all_held == names, names - all_held
        head_params = {n for n in names if n.startswith(head)}
        assert len(head_params) >= 6, head_params
        # every head parameter moved (the decoder bias is the head's `bias`, the decoder
        # weight is the tied word embedding: both under their own names too)
        assert head_params <= all_moved, head_params - all_moved
        out[name] = losses
    return out


def job_pp_refuses_orphans():
    """A head class the stages do not cover (sequence classification, pre-training) is refused
    at build, naming the parameters no stage would train; nothing is materialised."""
    import transformers as tf

    import slapo
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, vocab_size=128, max_position_embeddings=64)
    msgs = {}
    for cls, needle in ((tf.BertForSequenceClassification, "classifier.weight"),
                        (tf.BertForPreTraining, "cls.seq_relationship.weight")):
        with slapo.init_empty_weights():
            model = cls(cfg)
        sch = slapo.create_schedule(model, mesh=mesh)
        sch["bert.encoder.layer.0"].cut_pipeline_stage()
        with pytest.raises(slapo.SchedulingError, match="no pipeline stage") as e:
            slapo.build(sch, optimizer=torch.optim.AdamW, pipeline="1F1B", num_microbatches=2)
        assert needle in str(e.value), str(e.value)
        assert all(p.device.type == "meta" for p in model.parameters())
        msgs[cls.__name__] = str(e.value)
    return msgs


class _LossBug(ValueError):
    pass


def _bad_loss(outputs, batch):
    raise _LossBug("loss_fn bug planted by the test")


def job_pp_error_reaches_every_rank():
    """A loss that fails on the last stage's rank (the model's own loss of a model without
    one; a user loss_fn that raises) raises on *every* rank, promptly (no closed connection, no
    collective timeout), without an optimizer step; afterwards the same pipeline trains."""
    import time

    import models

    import slapo
    import slapo.runtime

    rank = torch.distributed.get_rank()
    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    msgs = {}
    # BertModel has no loss of its own
    sch = slapo.create_schedule(models.bert(layers=2), mesh=mesh)
    sch["encoder.layer.0"].cut_pipeline_stage()
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, pipeline="1F1B", num_microbatches=2)
    ids = models.ids(batch=4)
    t0 = time.monotonic()
    with pytest.raises(slapo.SchedulingError) as e:
        tm.train_step({"input_ids": ids, "labels": ids})
    assert time.monotonic() - t0 < 30
    text = str(e.value)
    assert "no loss of its own" in text, text
    if rank == 0:
        assert "failed on rank 1" in text, text
    msgs["own_loss"] = text
    # a user loss_fn bug: its own exception on the failing rank, a SchedulingError elsewhere
    model = _mlm("bert", layers=2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    sch = slapo.create_schedule(model, mesh=mesh)
    sch["bert.encoder.layer.0"].cut_pipeline_stage()
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, pipeline="GPipe", num_microbatches=2,
                        loss_fn=_bad_loss)
    batch = _mlm_batches("bert", batch=4)[0]
    expected = _LossBug if rank == 1 else slapo.SchedulingError
    with pytest.raises(expected) as e:
        tm.train_step(batch)
    assert "loss_fn bug planted" in str(e.value), str(e.value)
    msgs["user_loss"] = str(e.value)
    for n, p in model.named_parameters():  # no optimizer step was taken
        if p.device.type != "meta":
            assert torch.equal(p.detach(), before[n]), n
    # the ranks are still in step: the model's own loss trains
    tm.loss_fn = None
    tm.runner.loss_fn = None
    loss = tm.train_step(batch)
    assert loss == loss
    return {"msgs": msgs, "loss": loss}


@pytest.mark.dist
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_pipeline_mlm_trains_its_head_and_matches_one_process(dist2, family):
    res = dist2.run(job_pp_mlm, family, timeout=300)
    assert res[0] == res[1]
    assert set(res[0]) == {name for name, _ in MLM_CASES}


@pytest.mark.dist
def test_pipeline_refuses_parameters_in_no_stage(dist2):
    res = dist2.run(job_pp_refuses_orphans)
    assert res[0] == res[1]


@pytest.mark.dist
def test_pipeline_error_on_one_rank_raises_on_every_rank(dist2):
    res = dist2.run(job_pp_error_reaches_every_rank, timeout=120)
    assert res[0]["loss"] == res[1]["loss"]
    assert "failed on rank 1" in res[0]["msgs"]["own_loss"]
    assert "_LossBug" in res[0]["msgs"]["user_loss"]


# ------------------------------------------------------------------------------------------------
# 2. TP dropout: per-rank masks inside sharded regions, identical outside
# ------------------------------------------------------------------------------------------------

def _same_local_weights(model) -> None:
    """Give every rank rank 0's local tensors: each rank's heads then compute exactly what rank
    0's do, so any difference between the ranks' sharded activations comes from dropout."""
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_floating_point():
            torch.distributed.broadcast(t.data, src=0)


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    peers = [torch.empty_like(t) for _ in range(2)]
    torch.distributed.all_gather(peers, t.contiguous())
    return peers


def job_tp_dropout_masks(family: str, impl: str):
    """tp=2 with dropout 0.5 everywhere and identical local weights on both ranks: the inputs of
    the row-parallel projections (the sharded attention / FF outputs) differ between the ranks
    in training (per-rank masks) but agree in eval (the control), and the model's outputs agree
    in both (replicated dropouts draw identical masks)."""
    import slapo
    from slapo import model_schedule

    model = dropout_model(family, attn_implementation=impl)
    sch = model_schedule.apply(model, tp=2)
    applied = {h.name for _, h in sch.applied()}
    _same_local_weights(model)
    seen: dict[str, torch.Tensor] = {}
    for path in ROW_INPUTS[family]:
        model.get_submodule(path).register_forward_pre_hook(
            lambda m, args, path=path: seen.__setitem__(path, args[0].detach().clone()))
    batch = _batch(family)
    res = {"applied": sorted(applied)}
    for mode in ("eval", "train"):
        model.train(mode == "train")
        slapo.set_random_seed(7, tp_rank=torch.distributed.get_rank())
        out = model(**batch)
        a, b = _gathered(out.logits.detach())
        torch.testing.assert_close(a, b, rtol=0, atol=0,
                                   msg=lambda m, mode=mode: f"{family} {mode} outputs: {m}")
        for path in ROW_INPUTS[family]:
            x, y = _gathered(seen[path])
            same = torch.equal(x, y)
            if mode == "eval":
                assert same, f"{family} {path}: ranks differ without dropout"
            else:
                assert not same, f"{family} {path}: identical dropout masks on both tp ranks"
                # not roundoff: the masks differ, so the activations differ by O(1)
                res[path] = float((x - y).abs().mean() / x.abs().mean())
    return res


def job_tp_dropout_checkpoint_reproducible(family: str, compile_blocks=False,
                                           sequence_parallel: bool = False,
                                           ckpt_policy: str = "full"):
    """With per-rank masks, a checkpointed TP model recomputes with the masks its forward drew:
    loss and every gradient equal the same model without checkpointing (also with compiled
    blocks, where the forks break the graph and the checkpoint runs eagerly, replaying; and
    with the selective policy, which recomputes the dropouts but keeps the matmuls)."""
    import slapo
    from slapo import model_schedule

    out = {}
    for ratio in (0.0, 1.0):
        torch._dynamo.reset()
        model = dropout_model(family)
        model_schedule.apply(model, tp=2, ckpt_ratio=ratio, compile_blocks=compile_blocks,
                             sequence_parallel=sequence_parallel,
                             ckpt_policy=ckpt_policy if ratio else "full")
        model.train()
        slapo.set_random_seed(11, tp_rank=torch.distributed.get_rank())
        loss = model(**_batch(family)).loss
        loss.backward()
        out[ratio] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                      if p.grad is not None})
    (l0, g0), (l1, g1) = out[0.0], out[1.0]
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        # roundoff only (T5: ~5e-7 at tp=1 too); a mask redrawn in recompute is O(grad) off
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-5, msg=n)
    return float(l0)


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_attention_dropout_draws_per_rank_masks(dist2, family):
    res = dist2.run(job_tp_dropout_masks, family, "eager")
    assert "fork_rng" in res[0]["applied"]
    for path in ROW_INPUTS[family]:
        assert res[0][path] > 0.05, (path, res[0][path])


@pytest.mark.dist
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gpt_neo"])
def test_tp_attention_dropout_per_rank_with_sdpa(dist2, family):
    """The same with HF's SDPA implementation (dropout inside the fused kernel); GPT-Neo has
    no SDPA implementation in transformers."""
    dist2.run(job_tp_dropout_masks, family, "sdpa")


def job_tp_tempo_core_is_forked():
    """With Tempo's attention core (tempo=True) the fork goes to that core: Tempo's core stays,
    no pass-through core replaces it, and the residual dropout stays in the default stream."""
    from slapo import model_schedule, module_patch

    model = dropout_model("gpt2", attn_implementation="eager")  # Tempo replaces eager cores
    model_schedule.apply(model, tp=2, tempo=True)
    attn = model.transformer.h[0].attn
    names = [w.name for w in module_patch.wrappers(attn.attn_core)]
    assert "fork_rng" in names, names
    assert "fork_rng" not in [w.name for w in module_patch.wrappers(attn.resid_dropout)]
    assert "fork_rng" not in [w.name for w in module_patch.wrappers(attn)]
    return type(attn.attn_core).__name__


@pytest.mark.dist
def test_tp_tempo_attention_core_is_the_forked_one(dist2):
    res = dist2.run(job_tp_tempo_core_is_forked)
    assert res[0] == res[1] and res[0].startswith("Tempo"), res


def job_tp_without_dropout_keeps_compiled_blocks_whole(family: str) -> dict:
    """tp=2 with every dropout probability 0, layers compiled (dynamo, eager backend): the
    forked modules cannot drop, so no stream swap runs (`fork_rng(draws="dropout")`) and no
    graph breaks; it verifies against the unsharded model (outputs, every gradient, a step),
    and every gradient equals the uncompiled TP model's (torch 2.11's "eager"
    backend had silently dropped those through forward all-reduces), and the model equals the
    same model with forks that always swap. Then every
    dropout above 0: the forks swap again (dynamo guarded the probabilities). Checkpointed
    layers too compile whole (the RNG replay's Python flag had made every checkpointed TP
    block run eagerly, no graph at all)."""
    from torch._dynamo.utils import counters

    import slapo
    from slapo import model_schedule, module_patch
    from slapo.distributed import rng

    forks = []
    inner = rng.RNGStatesTracker.fork
    rng.RNGStatesTracker.fork = lambda self, *a, **k: (forks.append(1), inner(self, *a, **k))[1]
    try:
        torch._dynamo.reset()
        counters.clear()
        model = dropout_model(family, p=0.0)
        sch = slapo.create_schedule(model)  # compiled TP against the unsharded model too
        with slapo.Verify(sch, example_kwargs=_batch(family), loss_fn=lambda out: out.loss):
            model_schedule.apply(sch, tp=2, compile_blocks=EAGER)
        wrappers = [w for m in model.modules() for w in module_patch.wrappers(m)
                    if w.name == "fork_rng"]
        assert wrappers and all(w.draws == "dropout" for w in wrappers)
        model.train()
        slapo.set_random_seed(3, tp_rank=torch.distributed.get_rank())
        loss = model(**_batch(family)).loss
        loss.backward()
        out = {"forks": len(forks), "breaks": sum(counters["graph_break"].values())}
        plain = dropout_model(family, p=0.0)  # the same TP model uncompiled: same gradients
        model_schedule.apply(plain, tp=2)
        plain(**_batch(family)).loss.backward()
        grads = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
        assert len(grads) > 10
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-6, msg=n)
        for w in wrappers:  # the same model, forking on every call
            w.draws = "any"
        torch._dynamo.reset()
        slapo.set_random_seed(3, tp_rank=torch.distributed.get_rank())
        again = model(**_batch(family)).loss
        torch.testing.assert_close(again, loss, rtol=0, atol=0)
        out["forks_any"] = len(forks)
        for w in wrappers:
            w.draws = "dropout"
        forks.clear()
        for m in model.modules():  # every probability the HF modules hold
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.5
            for name in ("attention_dropout", "dropout"):
                if isinstance(m.__dict__.get(name), float):
                    setattr(m, name, 0.5)
        model(**_batch(family)).loss.backward()
        out["forks_after"] = len(forks)
        torch._dynamo.reset()  # checkpointed too: the recompute needs no replay, one region
        counters.clear()
        model = dropout_model(family, p=0.0)
        model_schedule.apply(model, tp=2, compile_blocks=EAGER, ckpt_ratio=1.0)
        slapo.set_random_seed(3, tp_rank=torch.distributed.get_rank())
        ckpt_loss = model(**_batch(family)).loss
        ckpt_loss.backward()
        torch.testing.assert_close(ckpt_loss, loss, rtol=1e-6, atol=1e-6)
        out["ckpt_breaks"] = sum(counters["graph_break"].values())
        out["ckpt_graphs"] = counters["stats"]["unique_graphs"]
    finally:
        rng.RNGStatesTracker.fork = inner
        torch._dynamo.reset()
    return out


@pytest.mark.dist
@pytest.mark.compile
@pytest.mark.parametrize("family", COMPILED_WHOLE)
def test_tp_without_dropout_keeps_compiled_blocks_whole(dist2, family):
    res = dist2.run(job_tp_without_dropout_keeps_compiled_blocks_whole, family, timeout=300)
    assert res[0]["forks"] == 0 and res[0]["breaks"] == 0, res[0]
    assert res[0]["forks_any"] > 0 and res[0]["forks_after"] > 0, res[0]
    assert res[0]["ckpt_breaks"] == 0 and res[0]["ckpt_graphs"] >= 1, res[0]


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_dropout_reproducible_under_checkpoint(dist2, family):
    res = dist2.run(job_tp_dropout_checkpoint_reproducible, family)
    assert res[0] == res[1]


@pytest.mark.dist
@pytest.mark.parametrize("family", SP_FAMILIES)
def test_sp_dropout_reproducible_under_checkpoint(dist2, family):
    """Under sequence parallelism too (OPT forks whole layers into the per-rank stream, GPT-2
    its attention core; the sequence-sharded dropouts draw per rank): the checkpoint's
    recomputation reuses the forward's masks. Every family with a sequence plan."""
    res = dist2.run(job_tp_dropout_checkpoint_reproducible, family, False, True)
    assert res[0] == res[1]


@pytest.mark.dist
@pytest.mark.parametrize("family", FAMILIES)
def test_tp_dropout_reproducible_under_selective_checkpoint(dist2, family):
    """The selective policy (`ckpt_policy="selective"`: matmul outputs kept, the rest, the
    dropouts included, recomputed) replays each forked dropout's per-rank stream too."""
    res = dist2.run(job_tp_dropout_checkpoint_reproducible, family, False, False, "selective")
    assert res[0] == res[1]


@pytest.mark.dist
@pytest.mark.parametrize("family", SP_FAMILIES)
def test_sp_dropout_reproducible_under_selective_checkpoint(dist2, family):
    res = dist2.run(job_tp_dropout_checkpoint_reproducible, family, False, True, "selective")
    assert res[0] == res[1]


@pytest.mark.dist
@pytest.mark.compile
@pytest.mark.parametrize("family", COMPILED_DROPOUT)
def test_tp_dropout_reproducible_under_checkpoint_in_compiled_blocks(dist2, family):
    res = dist2.run(job_tp_dropout_checkpoint_reproducible, family, EAGER, timeout=300)
    assert res[0] == res[1]


# ------------------------------------------------------------------------------------------------
# 3. apply validates everything before changing anything
# ------------------------------------------------------------------------------------------------

def _state(model, sch) -> tuple:
    """What a rejected call must leave as it was: module classes and paths, tensors, hooks and
    wrappers, the schedule's history."""
    from slapo import module_patch

    mods = [(n, type(m), len(m._forward_hooks), len(m._forward_pre_hooks),
             len(m._backward_hooks), len(module_patch.wrappers(m)))
            for n, m in model.named_modules()]
    tensors = {k: (tuple(v.shape), v.clone()) for k, v in model.state_dict().items()}
    return mods, tensors, [(p, str(h)) for p, h in sch.applied()]


def _assert_unchanged(model, sch, before) -> None:
    mods, tensors, history = _state(model, sch)
    assert mods == before[0]
    assert history == before[2] == []
    assert tensors.keys() == before[1].keys()
    for k, (shape, v) in tensors.items():
        assert shape == before[1][k][0], k
        assert torch.equal(v, before[1][k][1]), k


def _rejected(model, match: str, **kw) -> str:
    import slapo
    from slapo import model_schedule

    sch = slapo.create_schedule(model)
    before = _state(model, sch)
    with pytest.raises(slapo.SchedulingError, match=match) as e:
        model_schedule.apply(sch, **kw)
    _assert_unchanged(model, sch, before)
    return str(e.value)


BAD_KNOBS = [
    ("gpt2", {"attention": "sdpa", "ckpt_ratio": 2}, "ckpt_ratio"),
    ("gpt2", {"attention": "sdpa", "ckpt_ratio": "half"}, "ckpt_ratio"),
    ("llama", {"attention": "sdpa", "pp_stages": 3}, "2 layers cannot make 3 stages"),
    ("gpt2", {"attention": "sdpa", "ckpt_policy": "some"}, "ckpt_policy"),
    ("gpt2", {"attention": "sdpa", "compile_blocks": 3}, "compile_blocks"),
    ("gpt2", {"attention": "sdpa", "sequence_parallel": True, "pp_stages": 2},
     "sequence_parallel"),
    ("gpt2", {"attention": "sdpa", "fuse": True, "compile_blocks": True}, "fuse=True"),
    ("albert", {"ckpt_ratio": 0.5, "fuse": True}, "no fusion plan"),
    ("t5", {"attention": "sdpa", "kernels": True, "ckpt_ratio": 0.5}, "kernel plan"),
    ("bert", {"attention": "nope"}, "unknown attention"),
]


@pytest.mark.parametrize("family,kw,match", BAD_KNOBS)
def test_apply_rejects_before_changing_anything(family, kw, match):
    import models

    from slapo.model_schedule.kernels import PLANS

    if kw.get("kernels") and family in PLANS:
        pytest.skip(f"{family} has a kernel plan now")
    model = {"t5": models.t5, "albert": models.albert}.get(family, getattr(models, family))(
        seed=0)
    _rejected(model, match, **kw)


def test_apply_still_works_after_validation_moved():
    """The moved checks accept what they accepted: ckpt_ratio 0.5 + sdpa + pipeline cuts."""
    import models

    from slapo import model_schedule

    model = models.gpt2(seed=0, layers=4)
    ref = copy.deepcopy(model)
    sch = model_schedule.apply(model, attention="sdpa", ckpt_ratio=0.5, pp_stages=2)
    assert sch.pipeline_cuts == ("transformer.h.1",)
    assert sum(h.name == "checkpoint" for _, h in sch.applied()) == 2
    batch = {"input_ids": models.ids(), "labels": models.ids()}
    torch.testing.assert_close(model(**batch).loss, ref(**batch).loss, rtol=1e-5, atol=1e-6)


HEADS = [("gpt2", {"n_head": 3, "n_embd": 48}, "num_attention_heads=3"),
         ("llama", {"num_key_value_heads": 1}, "num_key_value_heads=1"),
         ("llama", {"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96},
          "num_key_value_heads=3"),
         ("opt", {"num_attention_heads": 1}, "num_attention_heads=1"),
         ("bert", {"num_attention_heads": 1}, "num_attention_heads=1"),
         ("roberta", {"num_attention_heads": 1}, "num_attention_heads=1"),
         ("albert", {"num_attention_heads": 1}, "num_attention_heads=1"),
         ("gpt_neo", {"num_heads": 1}, "num_attention_heads=1"),
         ("t5", {"num_heads": 1}, "num_attention_heads=1"),
         ("bert", {"intermediate_size": 129}, "intermediate_size=129"),
         ("opt", {"ffn_dim": 127}, "ffn_dim=127")]


def job_apply_heads_not_divisible():
    """tp=2 on heads or KV heads not divisible by 2: a clear error naming them and tp, before
    anything changes (also with other knobs that would mutate first)."""
    msgs = []
    for family, over, needle in HEADS:
        model = dropout_model(family, **over)
        msg = _rejected(model, "not divisible", tp=2, attention="sdpa", ckpt_ratio=0.5)
        assert needle in msg and "tp=2" in msg, msg
        msgs.append(msg)
    # the other rejected knobs under tp=2 leave the weights unsharded too
    model = dropout_model("gpt2")
    _rejected(model, "ckpt_ratio", tp=2, attention="sdpa", ckpt_ratio=2)
    return msgs


@pytest.mark.dist
def test_apply_rejects_heads_not_divisible_by_tp(dist2):
    res = dist2.run(job_apply_heads_not_divisible)
    assert res[0] == res[1] and len(res[0]) == len(HEADS)
