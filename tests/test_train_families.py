"""`slapo train` on 2 gloo ranks for every model of its registry, not the first two: each
parallel layout the model supports trains to the losses of one process (dropout off, so the
only difference is the summation order), and a layout it does not support stops with the
reason before anything trains."""

from __future__ import annotations

import functools

import pytest
import sweep
import torch

from slapo.train import MODELS

pytestmark = pytest.mark.dist

# lr 1e-2: a step moves the losses enough that a wrong gradient shows within 3 steps. The layouts
# agree with one process to 1.7e-7 relative (79 comparisons, torch 2.13), so `rel=1e-5` has 60x
# headroom; at 1e-4 an attention output 10% off on BERT's tiny init passed (6.6e-5 off).
TINY = dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=32, batch_size=8, steps=3,
            progress=False, plot=False, eval_batches=0, dropout=0.0, lr=1e-2)
REL, ABS = 1e-5, 1e-6
# "ddp": two ranks and no other layout is plain DDP (`slapo.train.setup`), each rank half the batch
LAYOUTS = {"tp": {"tp": 2}, "dp_shard": {"dp_shard": True}, "pp": {"pp_stages": 2}, "ddp": {}}
# what each layout cannot do, and the words its refusal uses
REFUSED = {("albert", "pp"): "one shared layer"}


def job_losses(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


@functools.cache
def one_process(model: str) -> tuple[float, ...]:
    """The one-process losses, once per model in this worker (three layouts compare to it)."""
    return tuple(job_losses({**TINY, "model": model}))


@functools.cache
def one_process_8_heads(model: str) -> tuple[float, ...]:
    return tuple(job_losses({**TINY, "model": model, "num_heads": 8}))


def job_refusal(options: dict) -> str:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    with pytest.raises(Exception) as e:
        train(TrainConfig(**options))
    return str(e.value)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_and_layout_trains_like_one_process(dist2, model, layout):
    opts = {**TINY, "model": model, **LAYOUTS[layout]}
    if (model, layout) in REFUSED:
        msgs = dist2.run(job_refusal, opts)
        assert all(REFUSED[model, layout] in m for m in msgs), msgs
        return
    ranks = dist2.run(job_losses_and_evals, {**opts, **EVALS})
    one, one_evals = one_process_with_evals(model)
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == pytest.approx(list(one), rel=REL, abs=ABS), (ranks[0][0], one)
    assert len(one_evals) == 2, one_evals  # the val loss too, at steps 2 and 4
    assert ranks[0][1] == pytest.approx(list(one_evals), rel=REL, abs=ABS), (ranks[0], one_evals)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_tp_inside_fsdp2_trains_like_one_process(dist4, model):
    """--tp 2 --dp-shard on 4 ranks: FSDP2 shards each TP rank's slices over the 2
    data-parallel ranks (a 2-D mesh); all four ranks log the one-process losses."""
    opts = {**TINY, "model": model, "tp": 2, "dp_shard": True}
    ranks = dist4.run(job_losses, opts)
    one = list(one_process(model))
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


PIPELINED = sorted(set(MODELS) - {m for m, lay in REFUSED if lay == "pp"})


@pytest.mark.parametrize("model", PIPELINED)
def test_every_model_pipelined_with_the_fused_loss_trains_like_one_process(dist2, model):
    """--pp-stages 2 --fused-loss: the last stage takes the labels and returns the fused
    head + cross-entropy (no logits) instead of the logits; the losses are one process's
    without the fused loss (GPT-2's tied head, BERT's and RoBERTa's MLM transforms, T5's
    scaled decoder output)."""
    ranks = dist2.run(job_losses, {**TINY, "model": model, "pp_stages": 2, "fused_loss": True})
    one = list(one_process(model))
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


@pytest.mark.parametrize("model", PIPELINED)
def test_every_model_pipelined_with_the_fused_loss_inside_fsdp2(dist4, model):
    """--pp-stages 2 --dp-shard --fused-loss on 4 ranks: the last stage reads its head's
    weight inside its own forward, where FSDP2 has gathered it; the losses are one
    process's. (T5 gets 4 blocks: its cut falls between encoder and decoder.)"""
    opts = {**TINY, "model": model}
    if model == "t5":
        opts["num_layers"] = 4
    ranks = dist4.run(job_losses, {**opts, "pp_stages": 2, "dp_shard": True,
                                   "fused_loss": True})
    one = job_losses(opts) if model == "t5" else list(one_process(model))
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


# a sample by default (tests/sweep.py): each layout on 4 models, every model under one layout
@pytest.mark.parametrize(("model", "layout"), sweep.spread(sorted(MODELS), ["tp", "dp_shard", "pp"],
                                                          4, skip=REFUSED))
def test_every_model_with_tempo_under_each_layout(dist2, model, layout):
    """--tempo --attention eager (Tempo's memory-saving layers and its attention core, which
    replaces eager attention) under TP, FSDP2 and a pipeline: one process's losses without
    Tempo (its layers recompute what they drop, exactly)."""
    if (model, layout) in REFUSED:
        pytest.skip("refused: test_every_model_and_layout_trains_like_one_process")
    opts = {**TINY, "model": model, "tempo": True, "attention": "eager", **LAYOUTS[layout]}
    ranks = dist2.run(job_losses, opts)
    one = list(one_process(model))
    assert ranks[0] == ranks[1]
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


def job_losses_and_evals(options: dict) -> tuple[list[float], list[float]]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    m = train(TrainConfig(**options))
    return m["losses"], [e["val_loss"] for e in m["evals"]]


# the layout test also evaluates (eval_step: forward only, eval mode, token-weighted over ranks,
# slices and micro-batches) at steps 2 and 4
EVALS = {"steps": 4, "eval_every": 2, "eval_batches": 2}


@functools.cache
def one_process_with_evals(model: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    losses, evals = job_losses_and_evals({**TINY, **EVALS, "model": model})
    return tuple(losses), tuple(evals)


SP_MODELS = ["bert", "gpt2", "gpt_neo", "llama", "opt", "roberta"]  # with a sequence plan


# a sample by default (tests/sweep.py): each data-parallel kind with 3 models, every model once
@pytest.mark.parametrize(("model", "data_parallel"), sweep.spread(SP_MODELS, ["ddp", "dp_shard"], 3))
def test_every_sequence_parallel_model_inside_data_parallel(dist4, model, data_parallel):
    """--tp 2 --sequence-parallel on 4 ranks, so 2 data-parallel replicas (DDP, or FSDP2 with
    --dp-shard, which also manages the parameters the sequence plan swaps): the norms'
    gradients, summed over the TP group, are then averaged over the replicas once; all four
    ranks log one process's losses."""
    opts = {**TINY, "model": model, "tp": 2, "sequence_parallel": True,
            "dp_shard": data_parallel == "dp_shard"}
    ranks = dist4.run(job_losses, opts)
    one = list(one_process(model))
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


# tp=4, with the sequence split in 4 too or not: a sample by default (tests/sweep.py) that
# puts every model but RoBERTa (BERT's layout) at tp=4 once; every model both ways with
# SLAPO_SWEEP=all (every one runs SP at tp=2 above)
@pytest.mark.parametrize("model, sequence_parallel", [
    (m, False) for m in sweep.sample(sorted(MODELS), ["albert", "bert", "gpt_neo", "llama", "t5"])
] + [(m, True) for m in sweep.sample(sorted(MODELS), ["gpt2", "opt"])])
def test_every_model_at_tp4_trains_like_one_process(dist4, model, sequence_parallel):
    """--tp 4 (8 heads: 2 per rank, LLaMA's 4 key/value heads 1 per rank; the vocabulary,
    the shard layouts and, with --sequence-parallel, the sequence in 4 pieces): every other
    test runs tp=2, where code that mixes up a shard's index and the degree can still pass."""
    if sequence_parallel and model not in SP_MODELS:
        pytest.skip(f"{model} has no sequence plan")
    opts = {**TINY, "model": model, "num_heads": 8}
    ranks = dist4.run(job_losses, {**opts, "tp": 4, "sequence_parallel": sequence_parallel})
    one = list(one_process_8_heads(model))
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)


RESUMED = {"pp": {"pp_stages": 2}, "tp": {"tp": 2}, "dp_shard": {"dp_shard": True}}


def _resumes_bit_for_bit(pool, tmp_path, opts: dict) -> None:
    """A run saved at step 2 and resumed gives the uninterrupted run's losses, dropout on."""
    opts = {**TINY, **opts, "steps": 4, "dropout": 0.1}
    straight = pool.run(job_losses, {**opts, "out": str(tmp_path / "a"), "save_every": 2})
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = pool.run(job_losses, {**opts, "out": str(tmp_path / "b"), "resume": str(step2)})
    assert all(r == resumed[0] for r in resumed), resumed
    assert resumed[0][2:] == straight[0][2:], (straight[0], resumed[0])


# a sample by default (tests/sweep.py): each layout on 4 models, every model under one layout
# (each family's shards, pipeline stages and tied weights are read back exactly in
# test_every_model_resumes_on_another_layout and test_shard_layout)
@pytest.mark.parametrize(("model", "layout"), sweep.spread(sorted(MODELS), sorted(RESUMED), 4,
                                                          skip=REFUSED))
def test_every_model_and_layout_resumes_bit_for_bit(dist2, tmp_path, model, layout):
    """Each rank saves what it holds and reloads it: its pipeline stage (OPT's optional
    projections, BERT's and RoBERTa's MLM heads, T5's encoder on one rank and decoder on the
    other), its TP shards (LLaMA's grouped k/v, T5's head-sharded position bias, ALBERT's one
    shared layer, the tied MLM decoders saved under two names) or its FSDP2 shards; with the
    optimizer moments and the random streams, the resumed run's losses are the uninterrupted
    run's bit for bit."""
    if (model, layout) in REFUSED:
        pytest.skip("refused: test_every_model_and_layout_trains_like_one_process")
    _resumes_bit_for_bit(dist2, tmp_path, {"model": model, **RESUMED[layout]})


# a sample by default (tests/sweep.py): every family's 2-D checkpoint is read back exactly and
# resumes its AdamW step in test_shard_layout; the whole run (dropout streams, data order) on
# a decoder and T5 (encoder and decoder) here, every model with SLAPO_SWEEP=all
@pytest.mark.parametrize("model", sweep.sample(sorted(MODELS), ["gpt2", "t5"]))
def test_every_model_tp_inside_fsdp2_resumes_bit_for_bit(dist4, tmp_path, model):
    """--tp 2 --dp-shard on 4 ranks (FSDP2 shards of TP shards, a 2-D layout per tensor)."""
    _resumes_bit_for_bit(dist4, tmp_path, {"model": model, "tp": 2, "dp_shard": True})


def _resumes_on(pool_a, pool_b, tmp_path, opts: dict, a: dict, b: dict) -> None:
    """Saved at step 2 under layout `a`, resumed under `b` (another --tp, --pp-stages or
    number of processes; a pool of None: this process): dropout off, the losses continue the
    uninterrupted run's to roundoff (the random streams restart, weights and moments do not)."""
    def on(pool, options):
        return pool.run(job_losses, options)[0] if pool else job_losses(options)

    opts = {**TINY, **opts, "steps": 4}
    straight = on(pool_a, {**opts, **a, "out": str(tmp_path / "a"), "save_every": 2})
    step2 = str(tmp_path / "a" / "checkpoints" / "step_000002")
    resumed = on(pool_b, {**opts, **b, "out": str(tmp_path / "b"), "resume": step2})
    assert resumed[2:] == pytest.approx(straight[2:], rel=REL, abs=ABS), (straight, resumed)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_every_model_resumes_on_another_layout(dist2, tmp_path, model, one_thread):
    """A --tp 2 checkpoint resumed as a 2-stage pipeline (ALBERT, which no pipeline takes: in
    one process), and a one-process checkpoint resumed under --tp 2: each tensor is read into
    the other layout (GPT-2's fused q|k|v saved as (.., 3, rest) under TP and as HF's shape
    without it, LLaMA's grouped k/v, T5's head-sharded position bias, the tied MLM decoders,
    the vocabulary-parallel embeddings)."""
    other = ({"pp_stages": 2}, dist2) if model != "albert" else ({}, None)
    _resumes_on(dist2, other[1], tmp_path / "tp", {"model": model}, {"tp": 2}, other[0])
    _resumes_on(None, dist2, tmp_path / "one", {"model": model}, {}, {"tp": 2})


@pytest.mark.parametrize("model", PIPELINED)
def test_every_model_tp_inside_pipeline_trains_like_one_process(dist4, model):
    """--tp 2 --pp-stages 2 on 4 ranks, for every model a pipeline takes: each TP rank's
    stages send their own slice across the stage boundary (T5 also its heads' slice of the
    position bias, the relative-bias embedding being sharded over heads); the last stage's
    head (GPT-2's tied LM head, BERT's and RoBERTa's MLM heads) is sharded too. All four
    ranks log the losses of one process."""
    opts = {**TINY, "model": model}
    if model == "t5":
        opts["num_layers"] = 4  # 2 encoder + 2 decoder blocks: the cut falls between them
    ranks = dist4.run(job_losses, {**opts, "tp": 2, "pp_stages": 2})
    one = job_losses(opts) if model == "t5" else list(one_process(model))
    assert all(r == ranks[0] for r in ranks), ranks
    assert ranks[0] == pytest.approx(one, rel=REL, abs=ABS), (ranks[0], one)
