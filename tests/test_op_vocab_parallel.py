"""Vocab-parallel embedding / LM head / cross-entropy on two real gloo ranks (one spawn)."""

from __future__ import annotations

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
