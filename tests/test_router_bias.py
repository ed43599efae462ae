"""DeepSeek-V3's auxiliary-loss-free balancing (`slapo/runtime/router_bias.py`): after each optimizer
step every router's `e_score_correction_bias` moves by `rate * sign(mean load - load)`
(centred), the loads counted over the step's global batch.

The reference is written from HF's router outputs (the (tokens, k) indices it returns), not
from the balancer: one process, each sequence a micro-batch. Exact (the biases are sums of
+-rate): DDP on 2 ranks and ep=2 equal one process bit for bit; without the sum over the ranks
(a mutation) they do not; the sign is the one that balances (a rigged router's imbalance
falls); bad input is refused before anything is hooked."""

from __future__ import annotations

import copy

import models
import pytest
import torch

import slapo
from slapo.errors import SchedulingError
from slapo.runtime.router_bias import BIAS, RouterBiasBalance, bias_routers

RATE = 0.01
LR = 1e-2


def _batches(rows: int = 2) -> list[dict]:
    return [{"input_ids": x, "labels": x} for x in (models.ids(rows, 16, seed=1),
                                                    models.ids(rows, 16, seed=2))]


def _reference(model, batches):
    """One process, AdamW, each row a micro-batch; after each step the biases moved by the
    rule from the counts HF's routers returned. Returns (losses, biases after each step)."""
    routers = [m for _, m in bias_routers(model)]
    counts = torch.zeros(len(routers), routers[0]._buffers[BIAS].numel(), dtype=torch.float64)
    def count(i: int):
        def hook(module, args, out) -> None:
            counts[i] += torch.bincount(out[2].reshape(-1), minlength=counts.shape[1]).double()
        return hook

    hooks = [r.register_forward_hook(count(i)) for i, r in enumerate(routers)]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, biases = [], []
    for batch in batches:
        opt.zero_grad()
        rows, total = batch["input_ids"].shape[0], 0.0
        for r in range(rows):
            out = model(**{k: v[r:r + 1] for k, v in batch.items()})
            (out.loss / rows).backward()
            total += out.loss.item() / rows
        opt.step()
        with torch.no_grad():
            sign = torch.sign(counts.mean(dim=1, keepdim=True) - counts)
            delta = RATE * (sign - sign.mean(dim=1, keepdim=True))
            for router, d in zip(routers, delta, strict=True):
                router._buffers[BIAS] += d.float()
        counts.zero_()
        losses.append(total)
        biases.append([r._buffers[BIAS].clone() for r in routers])
    for h in hooks:
        h.remove()
    return losses, biases


def _run(model, batches, group=None, **build_kw):
    """`slapo.build` with the balancer on its optimizer: (losses, biases after each step)."""
    sch = slapo.create_schedule(model, mesh=build_kw.pop("mesh", None))
    if sch.mesh is not None:
        slapo.model_schedule.apply(sch)
    tm, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                          **build_kw)
    balance = RouterBiasBalance(model, RATE, group).attach(opt)
    losses, biases = [], []
    for batch in batches:
        losses.append(tm.train_step(batch))
        biases.append([m._buffers[BIAS].clone() for m in balance.routers])
    balance.remove()
    return losses, biases


def test_one_process_equals_the_rule_on_hfs_router_outputs(one_thread):
    model = models.deepseek_v3(seed=0)
    ref = copy.deepcopy(model)
    losses, biases = _run(model, _batches(), grad_accum=2)
    ref_losses, ref_biases = _reference(ref, _batches())
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) < 1e-6
    assert all(torch.equal(a, b) for s, t in zip(biases, ref_biases) for a, b in zip(s, t))
    assert any(b.abs().max() > 0 for b in biases[0])  # it moved
    # step 2 routed with step 1's biases: the losses differ from a run without the update
    plain = copy.deepcopy(models.deepseek_v3(seed=0))
    sch = slapo.create_schedule(plain)
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        grad_accum=2)
    assert [tm.train_step(b) for b in _batches()][1] != losses[1]


def test_the_update_balances_a_rigged_router(one_thread):
    """Expert 0 made the favourite of every token (its router row along the tokens' mean
    input), routing not group-limited (one group: with two groups every token of this tiny
    batch flips group together, which no per-expert bias can balance); 40 updates at lr 0:
    the max/mean load falls from its start. A flipped sign would raise it."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        vocab_size=128, max_position_embeddings=64, experts_implementation="eager"))
    gate = model.model.layers[1].mlp.gate
    seen = []
    h = gate.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(input_ids=models.ids(4, 16))
        gate.weight[0] = 5 * seen[0].reshape(-1, seen[0].shape[-1]).mean(0)
    h.remove()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    balance = RouterBiasBalance(model, 0.01).attach(opt)
    imbalance = []
    for _ in range(40):
        model(input_ids=models.ids(4, 16), labels=models.ids(4, 16)).loss.backward()
        counts = balance.counts[0].clone()
        imbalance.append((counts.max() / counts.mean()).item())
        opt.step()
    assert imbalance[0] > 1.5 and max(imbalance[-5:]) < 0.8 * imbalance[0], imbalance


def job_dp2_equals_one_process(ep: int, sum_counts: bool = True) -> dict:
    from slapo.runtime.mesh import MeshInfo, ParallelDims, init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dims=ParallelDims(dp_replicate=2, ep=ep, device="cpu")) if ep > 1 else \
        init_mesh(dp=2)
    group = MeshInfo.of(mesh).replica_group() if sum_counts else None
    batches = _batches(2)  # the global batch: each rank trains on its row
    model = models.deepseek_v3(seed=0)
    ref = copy.deepcopy(model)
    losses, biases = _run(model, batches, group, mesh=mesh, data_parallel="ddp")
    ref_losses, ref_biases = _reference(ref, batches)
    return {"loss": max(abs(a - b) / b for a, b in zip(losses, ref_losses)),
            "bias_equal": all(torch.equal(a, b) for s, t in zip(biases, ref_biases)
                              for a, b in zip(s, t))}


@pytest.mark.dist
@pytest.mark.parametrize("ep", [1, 2])
def test_dp2_and_ep2_equal_one_process(dist2, ep):
    for r in dist2.run(job_dp2_equals_one_process, ep):
        assert r["loss"] < 1e-5 and r["bias_equal"], r


@pytest.mark.dist
def test_counts_not_summed_over_the_ranks_fail(dist2):
    assert not any(r["bias_equal"] for r in dist2.run(job_dp2_equals_one_process, 1, False))


def test_bad_input_is_refused_before_anything_is_hooked():
    model = models.deepseek_v3(seed=0)
    for rate in (0, -1e-3, True, "0.001"):
        with pytest.raises(SchedulingError, match="must be a positive number"):
            RouterBiasBalance(model, rate)
    assert not any(m._forward_hooks for _, m in bias_routers(model))
    with pytest.raises(SchedulingError, match="no router with an `e_score_correction_bias`"):
        RouterBiasBalance(models.mixtral(seed=0), 1e-3)


def test_slapo_train_router_bias_rate_updates_after_each_step(one_thread):
    """`slapo train --model deepseek_v3 --router-bias-rate R`: after the first step every
    sparse layer's bias moved by one step of the rule (nonzero, centred, within 2R); 0 (the
    default) leaves HF's zeros. (The rule itself, and its sum over ranks: the tests above.)"""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import train_one_step
    from slapo.train.setup import setup

    biases = {}
    for rate in (0.0, 0.05):
        cfg = TrainConfig(model="deepseek_v3", hidden_size=64, num_layers=2, num_heads=4,
                          seq_len=16, batch_size=4, steps=1, progress=False, plot=False,
                          eval_batches=0, router_bias_rate=rate)
        cfg.check()
        run = build(cfg, setup(cfg), log=lambda *a, **k: None)
        train_one_step(run)
        biases[rate] = [m._buffers[BIAS].clone() for _, m in bias_routers(run.model)]
    assert biases[0.0] and all(b.abs().max() == 0 for b in biases[0.0])
    for b in biases[0.05]:
        assert b.abs().max() > 0 and abs(b.sum().item()) < 1e-6, b  # moved, centred
        assert b.abs().max() <= 2 * 0.05 + 1e-6, b  # one step of +-rate, minus the mean
