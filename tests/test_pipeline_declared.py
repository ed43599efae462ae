"""Every text decoder the installed transformers declares a pipeline plan for
(`config.base_model_pp_plan`), pipelined from that declaration (`runtime/stages_declared.py`):
pp=2 on 2 gloo ranks (1F1B, 2 micro-batches) against one process.

Per architecture: the losses of two steps, every gradient of the first (on the rank whose stage
holds the parameter; tied ones summed over the stages that hold them) and every parameter after
2 AdamW steps (lr 1e-2), rel <= 1e-5, in float64; together the two ranks hold every parameter.
The tiny configs turn on what a stage must reproduce between the layers: every scale or
multiplier left at 1.0 becomes 2.0 and every logit soft-cap 2.0 (Gemma 3's final cap is off by
default), so a forgotten scale or cap cannot hide behind an identity. A refusal must be a
`SchedulingError`; any other exception, or a mismatch, fails. The printed table is the one in
docs/model_schedule.md. By default a sample covering each code path runs (CI budget);
`SLAPO_SWEEP=all` runs every architecture (tests/sweep.py).
"""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest
import sweep
import torch

import slapo
from slapo import model_schedule
from slapo.runtime import stages_declared

LR = 1e-2
RTOL = 1e-5
ATOL = 1e-8  # the denominator's floor (a gradient zero in exact arithmetic)
# The default sample: sliding + full layer types with a rotary embedding per type and the
# final soft-cap (Gemma 3); the embedding multiplier, the logit divisor and a rotary embedding
# per base theta with a NoPE layer (Granite-SWA); a plan with a dropout module after the
# embedding and other names (GPT-NeoX); indexed sparse attention's materialised mask (AXK2:
# the same path as DeepSeek-V3.2, 3x cheaper); and a named refusal (Gemma 4 unified's shared
# key/value states). The other rules are proven in one process below (MUTATIONS).
EQUIVALENT = ("gemma3_text", "granite_swa", "gpt_neox", "axk2")
REFUSED = ("gemma4_unified_text",)
_SCALE = re.compile(r"multiplier|scaling|scale|softcap")
# config values the tiny defaults leave at a case a wrong rule would pass: Granite-SWA's two
# layers at one theta (the global rotary's: a stage using `rotary_emb` would pass) become
# another theta and a NoPE layer; DOGE's unset window becomes one shorter than the sequence
EXERCISE = {"granite_swa": {"layer_rope_theta": [500000.0, 0.0]},
            "doge": {"sliding_window": 4}}


def _config(model_type: str, over: dict | None = None):
    """The tiny config, its identity scales made non-trivial (see the module docstring);
    `over`: more config values to set."""
    import hf_tiny

    cfg = hf_tiny.tiny_config(model_type)
    for name, v in list(vars(cfg).items()):
        if not _SCALE.search(name) or isinstance(v, bool) or name.startswith("_"):
            continue
        if "softcap" in name:
            setattr(cfg, name, 2.0)
        elif isinstance(v, float) and v == 1.0:
            setattr(cfg, name, 2.0)
    for name, v in {**EXERCISE.get(model_type, {}), **(over or {})}.items():
        setattr(cfg, name, v)
    return cfg


def _rel(a, b) -> float:
    return float((a - b).norm() / max(float(b.norm()), ATOL))


def _unit_loss(model, batch: dict, units: int) -> torch.Tensor:
    """The step's loss over `units` micro-batches (rows split as the pipeline splits them),
    each unit's loss weighted by its share of the supervised (shifted) tokens: one forward
    for 1. A mixture of experts' load-balancing loss is per unit (HF's statistics of each
    micro-batch), so its reference must split as the pipeline does."""
    if units == 1:
        return model(**batch).loss
    rows = batch["input_ids"].shape[0] // units
    counted = (batch["labels"][:, 1:] != -100).sum()
    total = 0.0
    for u in range(units):
        mb = {k: v[u * rows:(u + 1) * rows] for k, v in batch.items()}
        total = total + model(**mb).loss * ((mb["labels"][:, 1:] != -100).sum() / counted)
    return total


def _reference(model, batch, units: int = 1) -> tuple[list[float], dict, dict]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for i in range(2):
        opt.zero_grad()
        loss = _unit_loss(model, batch, units)
        loss.backward()
        if i == 0:
            grads = {k: p.grad.clone() for k, p in model.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        opt.step()
        losses.append(loss.item())
    return losses, grads, {k: p.detach() for k, p in
                           model.named_parameters(remove_duplicate=False)}


def _full(t, p):
    from slapo.sharding import gather_full, shard_spec

    return gather_full(t, shard_spec(p))


def _padded(batch: dict) -> dict:
    """The batch with its first row left-padded by 3 tokens (mask 0, label -100): a recurrent
    layer must not carry padding into its state (`create_recurrent_attention_mask`)."""
    mask = torch.ones_like(batch["input_ids"])
    mask[0, :3] = 0
    labels = batch["labels"].clone()
    labels[0, :3] = -100
    return {**batch, "attention_mask": mask, "labels": labels}


def _compare(model_type: str, cls_name: str, mesh, tp: int = 1, padded: bool = False,
             over: dict | None = None) -> tuple[str, list[str]]:
    """(result, the parameter names this rank's stages hold); with `tp` > 1 the stages are
    also split by the tensor-parallel plan the config declares (shards gathered to compare);
    `padded`: a left-padded batch; `over`: config values to set (`_config`)."""
    import hf_tiny

    try:
        model = hf_tiny.build(model_type, cls_name, config=_config(model_type, over))
    except hf_tiny.CannotBuild as e:
        return f"cannot build tiny config: {e}", []
    batch = {k: v for k, v in hf_tiny.batch().items() if k != "use_cache"}
    batch = _padded(batch) if padded else batch
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    try:
        model_schedule.apply(sch, tp=tp, pp_stages=2)
    except slapo.SchedulingError as e:
        assert not sch.pipeline_cuts  # refused before any change
        return f"refused: {e.problem}", []
    try:  # the unscheduled model must run: else the tiny config is at fault, not Slapo
        copy.deepcopy(ref)(**batch).loss.backward()
    except Exception as e:  # noqa: BLE001
        return f"cannot build tiny config: forward: {type(e).__name__}: {str(e)[:120]}", []
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        pipeline="1F1B", num_microbatches=2)
    held = {n: p for st in tm.stages for n, p in st.named_parameters(remove_duplicate=False)}
    if tp > 1 and not any(getattr(p, "_slapo_shard", None) for p in held.values()):
        return "MISMATCH: tp split no parameter", []
    losses, grads = [], {}
    for i in range(2):
        losses.append(tm.train_step(batch))
        if i == 0:
            grads = {n: p.grad.clone() for n, p in held.items() if p.grad is not None}
    # the router's aux loss is per micro-batch (2): the reference splits as the pipeline does
    units = 2 if (over or {}).get("output_router_logits") else 1
    ref_losses, ref_grads, ref_params = _reference(ref, batch, units)
    if set(grads) != {n for n in held if n in ref_grads}:
        return f"MISMATCH: gradients of {sorted(set(grads) ^ (set(ref_grads) & set(held)))}", []
    worst = [(abs(a - b) / abs(b), f"loss {i}") for i, (a, b) in
             enumerate(zip(losses, ref_losses, strict=True))]
    worst += [(_rel(_full(g, held[n]), ref_grads[n]), f"grad {n}") for n, g in grads.items()]
    if padded:  # the first step only: the recurrent layers run in float32 inside (HF's gated
        # delta rule), whose roundoff (rel ~1e-6 in their gradients) AdamW amplifies in the
        # parameters; a wrong mask is off by far more
        worst = [w for w in worst if w[1].startswith("grad") or w[1] == "loss 0"]
    else:
        worst += [(_rel(_full(p.detach(), p), ref_params[n]), f"param {n}")
                  for n, p in held.items()]
    err, where = max(worst)
    return ("equivalent" if err <= RTOL else f"MISMATCH: {where} rel {err:.2e}"), sorted(held)


def job_pp_sweep(archs: list[tuple[str, str]], tp: int = 1, padded: bool = False,
                 over: dict | None = None) -> dict[str, tuple[str, list[str]]]:
    """Every architecture in `archs` on this rank (pp=2, times `tp`); a crash is reported with
    its last lines (the test fails on it)."""
    import traceback
    import warnings

    import slapo.runtime

    torch.set_num_threads(1)
    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=tp)
    out = {}
    for model_type, cls_name in archs:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                out[model_type] = _compare(model_type, cls_name, mesh, tp, padded, over)
            except Exception as e:  # noqa: BLE001 - a crash is a result the test fails on
                tb = traceback.format_exc().strip().splitlines()
                out[model_type] = (f"CRASH: {type(e).__name__}: {str(e)[:200]} @ {tb[-3:]}", [])
    return out


def _archs() -> list[tuple[str, str]]:
    import hf_tiny

    every = hf_tiny.decoders("base_model_pp_plan")
    return sweep.sample(every, [a for a in every if a[0] in EQUIVALENT + REFUSED])


def table(results: dict[str, str]) -> str:
    rows = ["| architecture | pp=2 |", "|---|---|"]
    rows += [f"| {k} | {v} |" for k, v in sorted(results.items())]
    return "\n".join(rows)


@pytest.mark.dist
@pytest.mark.timeout(1800)  # the full sweep (SLAPO_SWEEP=all); the default sample takes ~5 s
def test_declared_pipeline_plans_pp2_equal_one_process(dist2):
    import transformers

    per_rank = dist2.run(job_pp_sweep, _archs(), timeout=1500)
    results = {k: v for k, (v, _) in per_rank[0].items()}
    print("\n" + table(results))
    assert {k: v for k, (v, _) in per_rank[1].items()} == results  # both ranks agree
    bad = {k: v for k, v in results.items() if v.startswith(("MISMATCH", "CRASH"))}
    assert not bad, bad
    for k, v in results.items():  # the two ranks' stages hold every parameter, once
        if v == "equivalent":
            cls = dict(_archs())[k]
            with torch.device("meta"):
                names = {n for n, _ in getattr(transformers, cls)(_config(k))
                         .named_parameters(remove_duplicate=False)}
            assert sorted(per_rank[0][k][1] + per_rank[1][k][1]) == sorted(names), k
    for k, v in results.items():  # equivalent exactly where the table says proven
        assert (v == "equivalent") == (k in stages_declared.BETWEEN), (k, v)
    if sweep.full():  # every proven model type was swept (and, above, is equivalent)
        assert set(stages_declared.BETWEEN) <= set(results), set(stages_declared.BETWEEN) - set(results)
    else:
        assert all(results[k] == "equivalent" for k in EQUIVALENT), results
        assert all(results[k].startswith("refused: ") for k in REFUSED), results


TP_PP = ("gemma3_text", "olmo2", "phi3", "gpt_oss")  # issue 31: tp x pp, both declared plans


@pytest.mark.dist
def test_declared_tp_and_pp_plans_together_equal_one_process(dist4):
    """tp=2 x pp=2 on 4 ranks: each stage's layers split by the tensor-parallel plan the config
    declares (`model_schedule/hf_plan.py`), the stages from its pipeline plan; Gemma 3 (sliding
    and full layers, their own rotary embeddings, the soft-cap, a scaled embedding) and OLMo 2
    (q/k projections gathered for its full-width q/k norms, the output projection splitting its
    input) and Phi-3 (packed q|k|v and gate|up split per block) equal one process like the pp=2
    sweep, with at least one parameter split; GPT-OSS (its attention with biases and per-head
    sinks split by Slapo's supplement to a plan that declares only the embedding,
    `plan_supplements.py`; sliding and full layers; its biased experts split by expert TP)."""
    import hf_tiny
    import transformers

    archs = [a for a in hf_tiny.decoders("base_model_pp_plan") if a[0] in TP_PP]
    per_rank = dist4.run(job_pp_sweep, archs, 2, timeout=600)
    for k, cls in archs:
        assert all(r[k][0] == "equivalent" for r in per_rank), [r[k][0] for r in per_rank]
        with torch.device("meta"):
            names = {n for n, _ in getattr(transformers, cls)(_config(k))
                     .named_parameters(remove_duplicate=False)}
        assert set().union(*(r[k][1] for r in per_rank)) == names, k


HYBRIDS = ("olmo_hybrid",)  # linear (recurrent) and full attention layers (Qwen3-Next: slower)


@pytest.mark.dist
def test_hybrid_stages_mask_padding_as_the_model_does(dist2):
    """pp=2 of linear-attention hybrids on a left-padded batch: each recurrent layer gets the
    2-D padding mask the model gives it (`LAYER_MASKS["linear_attention"]`), each full layer the
    causal mask; without padding both masks are None, so the sweep alone would not see a wrong
    one (a stage that gave the recurrent layers the causal mask fails here)."""
    import hf_tiny

    archs = [a for a in hf_tiny.decoders("base_model_pp_plan") if a[0] in HYBRIDS]
    per_rank = dist2.run(job_pp_sweep, archs, 1, True, timeout=600)
    assert {k: v for k, (v, _) in per_rank[0].items()} == dict.fromkeys(HYBRIDS, "equivalent")


# ---- a stage that forgets what the forward does between the layers is caught ------------------

# (Gemma 3's per-type rope made shared fails loudly: its rotary module needs the layer type;
# Granite-SWA's per-theta rule made another is refused: its rope modules are not that rule's.)
# (model type, the change to its row, config values its tiny config needs for the step to
# matter, the dtype it runs in): DOGE's materialised mask matters without a window (the
# causal mask would be skipped, and its dynamic mask added onto nothing). Dots3's float32
# rotary embedding differs in bfloat16 only: `test_a_float32_rotary_embedding_is_the_forwards`
MUTATIONS = [("gemma3_text", {"softcap": None}), ("gemma3_text", {"masks": "causal"}),
             ("granite", {"embed_scale": None}), ("granite", {"logit_scale": None}),
             ("cohere_compass_text", {"logit_scale": None}),
             ("granite_swa", {"logit_scale": None}),
             ("lara_mini", {"rope_types": None}), ("beam", {"nope_scaling": None}),
             ("beam", {"softcap_float32": False}), ("doge", {"masks": "causal"}),
             ("doge", {"materialise": False}, {"sliding_window": None})]
MUTATIONS = [m + ({}, torch.float64)[len(m) - 2:] for m in MUTATIONS]

# float64 models, so a float32 cast the forward makes (a soft-cap, a rotary embedding: rel
# ~1e-7) is a difference Verify's default rtol (1e-5) would pass
TIGHT = {"rtol": 1e-10, "atol": 1e-12}


@pytest.mark.parametrize("model_type,change,over,dtype", MUTATIONS,
                         ids=[f"{m}-{next(iter(c))}" for m, c, _, _ in MUTATIONS])
def test_a_table_entry_that_forgets_a_step_is_caught(monkeypatch, model_type, change, over,
                                                      dtype):
    """Dropping the soft-cap (or its float32 cast), the sliding masks (or their always
    materialised form), the embedding multiplier, the logit divisor or multiplier, the rope
    rule's NoPE layers, a NoPE layer's attention scaling or a float32 rotary embedding from a
    model's `Between` makes its stages differ from its forward: the same comparison as the
    sweep's, here in one process (Verify runs the stages against the model's forward when the
    cut is made; in float64 its floor is float64's). The table as it is passes first, Cohere
    Compass's full layers without a rotary embedding (NoPE) included."""

    import hf_tiny

    cls = dict(hf_tiny.decoders("base_model_pp_plan"))[model_type]
    batch = {"input_ids": hf_tiny.batch()["input_ids"]}

    def schedule():
        cfg = _config(model_type)
        for k, v in over.items():
            setattr(cfg, k, v)
        return slapo.create_schedule(hf_tiny.build(model_type, cls, config=cfg).to(dtype))

    sch = schedule()
    with slapo.Verify(sch, example_kwargs=batch, **TIGHT):  # the table as it is: the forward
        sch["model.layers.0"].cut_pipeline_stage()
    wrong = dataclasses.replace(stages_declared.BETWEEN[model_type], **change)
    monkeypatch.setitem(stages_declared.BETWEEN, model_type, wrong)
    sch = schedule()
    with pytest.raises(slapo.VerificationError, match="do not compute the model's"):
        with slapo.Verify(sch, example_kwargs=batch, **TIGHT):
            sch["model.layers.0"].cut_pipeline_stage()


def test_a_float32_rotary_embedding_is_the_forwards():
    """Dots3's indexed layers take a rotary embedding computed from the hidden state cast to
    float32 (`rope_float32`): in bfloat16 the stage's position embeddings for its layer 0 (an
    indexed layer) are the ones the model's forward gives that layer, dtype and values, and
    without the rule they are bfloat16. Forward only: Verify's stage comparison in bfloat16
    costs 20 s on this CPU (its backward), and float64 holds float32 exactly, so the sweep
    cannot see the rule."""
    import types

    import hf_tiny

    model_type = "dots3_note_text"
    cls = dict(hf_tiny.decoders("base_model_pp_plan"))[model_type]
    model = hf_tiny.build(model_type, cls, config=_config(model_type)).to(torch.bfloat16)
    ids = hf_tiny.batch()["input_ids"]
    seen = {}
    model.model.layers[0].register_forward_pre_hook(
        lambda m, a, kw: seen.update(pe=kw["position_embeddings"]), with_kwargs=True)
    with torch.no_grad():
        model(input_ids=ids)
        kind = model.config.layer_types[0]
        h = model.model.embed_tokens(ids)
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        stage = types.SimpleNamespace(config=model.config)
        row = stages_declared.BETWEEN[model_type]
        got = {}
        for name, between in (("row", row), ("without", dataclasses.replace(row,
                                                                           rope_float32=()))):
            got[name] = stages_declared.rotary(stage, between,
                                               {"rotary_emb": model.model.rotary_emb}, h, pos,
                                               {kind})[kind]
    assert kind == "indexed_attention"
    for g, w in zip(got["row"], seen["pe"], strict=True):
        assert g.dtype == w.dtype == torch.float32 and torch.equal(g, w)
    assert all(g.dtype == torch.bfloat16 for g in got["without"])


# ---- bad input: a clear error, nothing changed ------------------------------------------------

def _tiny(model_type: str, **over):
    import hf_tiny

    cfg = _config(model_type)
    for k, v in over.items():
        setattr(cfg, k, v)
    return hf_tiny.build(model_type, dict(hf_tiny.decoders("base_model_pp_plan"))[model_type],
                         config=cfg)


def _renamed(model, model_type: str):
    """`model` under a model type no table names (a user's own, its plan copied from LLaMA)."""
    model.config.model_type = model_type
    return model


def _without(model, child: str):
    """`model` whose base model lost `child` (a layout the rope rule does not expect)."""
    delattr(model.model, child)
    return model


def _base_model():
    import transformers as tf

    return tf.LlamaModel(tf.LlamaConfig(hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, intermediate_size=128,
                                        vocab_size=128))


def _no_pp_plan():
    import transformers as tf

    return tf.BloomForCausalLM(tf.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                              vocab_size=128))


BAD = {
    "unproven model type": (lambda: _renamed(_tiny("llama"), "my_llama"),
                            "proven .* for \\d+ model types only"),
    "named refusal": (lambda: _tiny("gemma4_unified_text"), "share key/value states"),
    "rope rule without its modules": (lambda: _without(_tiny("granite_swa"), "rotary_embs"),
                                      "its rope rule \\('per_theta'\\) runs"),
    "bidirectional gemma3": (lambda: _tiny("gemma3_text", use_bidirectional_attention=True),
                             "use_bidirectional_attention"),
    "router loss of its own": (lambda: _tiny("doge", output_router_logits=True),
                               "load-balancing loss of its own"),
    "mup afmoe": (lambda: _tiny("afmoe", mup_enabled=True), "sqrt\\(hidden_size\\)"),
    "pruned head": (lambda: _tiny("apertus1p5_text", output_vocab_size=64), "output_vocab_size"),
    "no head": (_base_model, "not a decoder LM with a head"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_models_the_declared_stages_do_not_cover_are_refused_unchanged(case):
    make, needle = BAD[case]
    model = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match=needle) as e:
        model_schedule.apply(sch, pp_stages=2)
    assert "without pp_stages" in str(e.value)
    assert not sch.pipeline_cuts and not list(sch.applied())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_decoder_without_a_pipeline_plan_or_layout_is_refused():
    """Bloom declares no pipeline plan and is not laid out like GPT-2 or OPT: `apply` has no
    schedule for it, and the stages refuse it on their own too."""
    from slapo.runtime.partition import check_partitionable

    model = _no_pp_plan()
    with pytest.raises(slapo.SchedulingError, match="is neither"):
        check_partitionable(model)
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match="no ready schedule"):
        model_schedule.apply(sch, pp_stages=2)
    assert not sch.pipeline_cuts
