"""Vocab-parallel embedding / LM head / cross-entropy on two real gloo ranks (one spawn)."""

from __future__ import annotations

import copy
import socket
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from slapo.op import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    vocab_parallel_cross_entropy,
    vocab_range,
)

V, H, B, S = 12, 6, 2, 5


def reference_step(seed: int):
    """Unsharded embedding -> tanh -> LM head -> cross-entropy, with its gradients."""
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    head = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[0, 0] = -100
    hidden = torch.tanh(F.embedding(ids, emb))
    logits = hidden @ head.T
    loss = F.cross_entropy(logits.view(-1, V), labels.view(-1))
    loss.backward()
    return emb, head, ids, labels, hidden.detach(), logits.detach(), loss.detach()


def sharded_step(seed: int, group=None):
    emb, head, ids, labels, hidden_ref, logits_ref, loss_ref = reference_step(seed)
    pemb = VocabParallelEmbedding(V, H, group, weight=emb)
    phead = VocabParallelLMHead(H, V, group, weight=head)
    start, end = vocab_range(V, group)
    hidden = torch.tanh(pemb(ids))
    local_logits = phead(hidden)
    loss = vocab_parallel_cross_entropy(local_logits, labels, group)
    loss.backward()
    checks = {
        "hidden": torch.allclose(hidden, hidden_ref, atol=1e-12),
        "logits": torch.allclose(local_logits, logits_ref[..., start:end], atol=1e-12),
        "loss": torch.allclose(loss, loss_ref, atol=1e-12),
        "emb_grad": torch.allclose(pemb.weight.grad, emb.grad[start:end], atol=1e-12),
        "head_grad": torch.allclose(phead.weight.grad, head.grad[start:end], atol=1e-12),
        "none_reduction": torch.allclose(
            vocab_parallel_cross_entropy(local_logits.detach(), labels, group, reduction="none"),
            F.cross_entropy(logits_ref.view(-1, V), labels.view(-1), reduction="none").view(B, S),
            atol=1e-12,
        ),
    }
    return checks, (start, end)


def _worker(rank: int, port: int, queue) -> None:
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=2,
            timeout=timedelta(seconds=60),
        )
        torch.set_num_threads(1)
        checks, rng = sharded_step(seed=3)
        # A second seed with different labels, to make sure agreement is not an accident.
        checks2, _ = sharded_step(seed=4)
        checks.update({k + "_2": v for k, v in checks2.items()})
        queue.put((rank, checks, rng, None))
    except Exception:
        queue.put((rank, None, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_single_process_is_world_of_one():
    checks, rng = sharded_step(seed=3)
    assert rng == (0, V)
    assert all(checks.values()), checks


def test_wrong_shapes_raise():
    with pytest.raises(ValueError, match="neither the full"):
        VocabParallelEmbedding(V, H, weight=torch.zeros(V + 1, H))
    with pytest.raises(ValueError, match="agree"):
        vocab_parallel_cross_entropy(torch.zeros(3, V), torch.zeros(4, dtype=torch.long))


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_two_gloo_ranks_match_unsharded():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=150) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    ranges = {}
    for rank, checks, rng, err in results:
        assert err is None, f"rank {rank} failed:\n{err}"
        assert all(checks.values()), (rank, checks)
        ranges[rank] = rng
    assert ranges == {0: (0, V // 2), 1: (V // 2, V)}


# --- scale_grad_by_freq (issue 29 item 5) ----------------------------------------------------
# Each row's gradient is divided by how often its id occurs in the batch. A vocabulary shard
# counts over the global ids it receives (every rank of the group sees the same ids), never
# over its local indices, where every foreign id used to land on local row 0.

FREQ_IDS = torch.tensor([[0, 1, 1, 6, 6, 6, 7], [0, 11, 1, 6, 3, 11, 9]])  # both halves repeat


def _freq_reference(seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    emb = torch.nn.Embedding(V, H, scale_grad_by_freq=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(V, H, generator=g, dtype=torch.float64))
    out_grad = torch.randn(*FREQ_IDS.shape, H, generator=g, dtype=torch.float64)
    return emb, out_grad


def job_scale_grad_by_freq() -> dict:
    """On each rank: `VocabParallelEmbedding.from_embedding` and `Schedule.shard` of an
    `nn.Embedding(scale_grad_by_freq=True)` against the unsharded module in one process; and
    GPT-2 / LLaMA (padding_idx 0) with the flag under `model_schedule.apply(tp=2)`, `Verify`."""
    import models

    import slapo
    from slapo import model_schedule

    emb, out_grad = _freq_reference()
    ref = copy.deepcopy(emb)
    ref(FREQ_IDS).backward(out_grad)
    start, end = vocab_range(V, None)
    pemb = VocabParallelEmbedding.from_embedding(emb)
    pemb(FREQ_IDS).backward(out_grad)
    res = {"op": (pemb.weight.grad - ref.weight.grad[start:end]).abs().max().item()}

    model = torch.nn.Sequential(copy.deepcopy(emb))
    sch = slapo.create_schedule(model)
    sch["0"].shard("weight", axis=0)
    sch["0"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    model(FREQ_IDS).backward(out_grad)
    res["shard"] = (model[0].weight.grad - ref.weight.grad[start:end]).abs().max().item()

    ids = torch.tensor([0, 1, 1, 2, 64, 64, 65, 127, 127, 127, 3, 0, 64, 1, 5, 70])
    batch = {"input_ids": torch.stack([ids, ids.flip(0)]), "labels": torch.stack([ids, ids])}
    for family in ("gpt2", "llama"):
        net = getattr(models, family)(seed=0)
        net.get_input_embeddings().scale_grad_by_freq = True
        sch = slapo.create_schedule(net)
        with slapo.Verify(sch, example_kwargs=batch, loss_fn=lambda out: out.loss):
            model_schedule.apply(sch, tp=2)
        res[family] = "verified"
    return res


@pytest.mark.dist
def test_scale_grad_by_freq_shards_match_one_process(dist2):
    for res in dist2.run(job_scale_grad_by_freq, timeout=300):
        assert res["op"] < 1e-12 and res["shard"] < 1e-12, res
        assert res["gpt2"] == res["llama"] == "verified"
