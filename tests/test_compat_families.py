"""Slapo 2023's `apply_schedule(model, key, group=..., ...)` under tensor parallelism on 2 gloo
ranks, for every transformer family of its registry (and the HF classes each key covers), not
the first two: each 2023 key a user of that time passed reaches the ready schedule, and the
scheduled model computes what the original did (outputs, gradients and one optimizer step,
`Verify`, gathered over the shards).

Keys exercised: `group` (the world), `attn_op_name`, `ckpt_ratio` + `checkpoint_method`,
`sequence_parallel` (the families that have it), `disable_shard_embedding` both ways,
`bcast_input` (ranks handed different batches compute rank 0's) and the whole-model
`bf16`/`fp16` cast (against the same cast in one process, at low-precision tolerance).
Mutations checked by hand: without the backward all-reduce every test fails; without the
broadcast hook every `bcast_input` test fails."""

from __future__ import annotations

import pytest
import torch

import slapo
from slapo.model_schedule import apply_schedule

pytestmark = pytest.mark.dist

# test model -> (2023 schedule key, has sequence parallelism)
FAMILIES = {"gpt2": ("gpt2", True), "gpt_neo": ("gpt_neo", True), "llama": ("llama", True),
            "qwen2": ("llama", False), "mistral": ("llama", False),
            "bert_mlm": ("bert", True), "roberta": ("roberta", True), "opt": ("opt", True),
            "albert": ("albert", False), "t5": ("t5", False), "mt5": ("t5", False)}


def _family_model(name: str):
    import models

    return getattr(models, name)(seed=0)


def _ckpt_count(sch) -> int:
    return sum(1 for _, h in sch.applied() if h.name == "checkpoint")


def job_apply_schedule_verified(name: str, shard_embedding: bool):
    """`apply_schedule` with the 2023 keys inside `Verify`; then `bcast_input`: each rank is
    handed its own batch and both compute the original model on rank 0's."""
    import models
    import torch.distributed as dist

    key, has_sp = FAMILIES[name]
    kw = models.batch_for(name)
    model = _family_model(name)
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, example_kwargs=kw, loss_fn=lambda out: out.loss) as v:
        sch = apply_schedule(model, key, model_config=model.config, group=dist.group.WORLD,
                             attn_op_name="cuda", ckpt_ratio=0.5, checkpoint_method="uniform",
                             sequence_parallel=has_sp, bcast_input=True,
                             disable_shard_embedding=not shard_embedding)
    assert sch.tp_size == 2
    reference = v.reference.eval()
    rank = dist.get_rank()
    mine = models.batch_for(name, seed=1 + 10 * rank)  # rank 1's batch differs from rank 0's
    mine = {k: t.clone() for k, t in mine.items()}
    rank0 = models.batch_for(name, seed=1)
    model.eval()
    with torch.no_grad():
        got, want = model(**mine).loss, reference(**rank0).loss
    sharded = sorted({n.split(".")[-2] for n, p in model.named_parameters()
                      if getattr(p, "_slapo_shard", None) is not None})
    return {"checked": len(v.report), "bcast": (float(got), float(want)),
            "ckpt": _ckpt_count(sch), "sharded": sharded,
            "embedding_sharded": _embedding_sharded(model)}


def _embedding_sharded(model) -> bool:
    emb = model.get_input_embeddings()
    return getattr(emb.weight, "_slapo_shard", None) is not None


@pytest.mark.parametrize("shard_embedding", [True, False], ids=["vocab_parallel", "disabled"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_apply_schedule_2023_keys_under_tp_compute_the_original(dist2, name, shard_embedding):
    ranks = dist2.run(job_apply_schedule_verified, name, shard_embedding)
    r = ranks[0]
    assert {k: v for k, v in ranks[1].items() if k != "bcast"} == \
        {k: v for k, v in r.items() if k != "bcast"}
    assert r["checked"] > 0 and r["sharded"], r  # compared something; TP sharded something
    assert r["ckpt"] >= 1, r  # ckpt_ratio=0.5 reached the layers
    assert r["embedding_sharded"] is shard_embedding, r
    for got, want in (x["bcast"] for x in ranks):  # both ranks: rank 0's batch's loss
        assert got == pytest.approx(want, rel=1e-5), (name, got, want)


def job_cast(name: str, dtype_key: str):
    """The whole-model cast of 2023 (`bf16=True` / `fp16=True`) under TP against the same cast
    model in one process: loss and every gradient, relative to how far the cast itself moves
    them from fp32 (a TP bug lands far outside that)."""
    import models
    import torch.distributed as dist

    from slapo import sharding

    key, _ = FAMILIES[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_key]
    kw = models.batch_for(name)
    fp32 = _family_model(name)
    cast_one = sharding.deepcopy_model(fp32).to(dtype)
    model = sharding.deepcopy_model(fp32)
    apply_schedule(model, key, group=dist.group.WORLD, **{dtype_key: True})
    assert {p.dtype for p in model.parameters()} == {dtype}
    losses, grads = {}, {}
    for tag, m in (("fp32", fp32), ("one", cast_one), ("tp", model)):
        out = m(**kw)
        out.loss.float().backward()
        losses[tag] = float(out.loss)
        grads[tag] = {n: sharding.gather_full(p.grad, sharding.shard_spec(p)).float()
                      for n, p in m.named_parameters() if p.grad is not None}
    assert grads["tp"].keys() == grads["one"].keys()
    # one scalar's cast distance can land near 0 by chance: at least the dtype's resolution
    cast_moves = max(abs(losses["one"] - losses["fp32"]),
                     torch.finfo(dtype).eps * abs(losses["fp32"]))
    ratios = {"loss": abs(losses["tp"] - losses["one"]) / cast_moves}
    for n, g in grads["one"].items():
        scale = (g - grads["fp32"][n]).abs().max().item() + 1e-6
        ratios[n] = (grads["tp"][n] - g).abs().max().item() / scale
    return ratios


CAST_TOLERANCE = 4.0  # x the cast's own distance from fp32 (test_train_families_gpu's factor)


@pytest.mark.parametrize("dtype_key", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["albert", "bert_mlm", "gpt2", "gpt_neo", "llama", "opt",
                                  "roberta", "t5"])
def test_apply_schedule_whole_model_cast_under_tp(dist2, name, dtype_key):
    ratios = dist2.run(job_cast, name, dtype_key)[0]
    print(name, dtype_key, sorted(ratios.items(), key=lambda kv: -kv[1])[:3])
    worst = max(ratios, key=ratios.get)
    assert ratios[worst] <= CAST_TOLERANCE, (worst, ratios[worst])
