import dataclasses
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from slapo.tune import simulate as sim  # noqa: E402
from slapo.tune.memory import model_state_bytes  # noqa: E402
from slapo.tune.simulate import (  # noqa: E402
    CP_ATTENTION,
    DEVICES,
    GPT_MODELS,
    MOE_MODELS,
    AttnShard,
    ExpertShard,
    GPTSpec,
    LayerModel,
    MoESpec,
    cp_attention_memory,
    cp_attention_messages,
    expert_shard,
    main,
    message_time,
    moe_messages,
    sent_bytes,
    simulate,
)
from slapo.tune.timing import AlphaBeta, collective_time  # noqa: E402


@pytest.fixture(scope="module")
def gpt7b():
    return LayerModel(GPT_MODELS["gpt-7b"])


def check_plan(p, spec, gpus, global_batch, dev):
    assert p.dp * p.tp * p.pp * p.cp == gpus
    assert (p.cp == 1) == (p.cp_attention is None) and p.seq == spec.seq
    assert p.dp * p.micro_batch * p.num_microbatches == global_batch
    assert sum(p.layers) == spec.layers and len(p.layers) == p.pp
    assert all(0 <= c <= j for c, j in zip(p.ckpt, p.layers))
    assert max(p.stage_memory) <= 0.9 * dev.memory_bytes - 2e9


def test_h100_plans_are_valid_and_pruning_is_exact(gpt7b):
    spec, dev = GPT_MODELS["gpt-7b"], DEVICES["h100"]
    grid = dict(tps=(1, 2), pps=(1, 2, 4), micro_batches=(1, 2), zeros=(0, 1, 3), cps=(1, 2),
                cp_attentions=("ring",))  # every cp choice would cost 5 s more of exhaustive MILPs
    plans = simulate(spec, 16, 256, dev, gpt7b, top=3, **grid)
    assert len(plans) == 3 and plans[0].step_time <= plans[1].step_time <= plans[2].step_time
    for p in plans:
        check_plan(p, spec, 16, 256, dev)
    everything = simulate(spec, 16, 256, dev, gpt7b, top=10_000, **grid)
    assert len(everything) > 20
    assert everything[0].step_time == pytest.approx(plans[0].step_time)


def test_memory_pressure_on_small_gpus_forces_sharding_and_uneven_ckpt(gpt7b):
    """7B on 8 x 24 GB: 7B x 16 B of states cannot sit on one GPU, so the plan must shard it,
    and under 1F1B the first stages (more micro-batches in flight) checkpoint more (as Mist's)."""
    spec, dev = GPT_MODELS["gpt-7b"], DEVICES["l4"]
    best = simulate(spec, 8, 128, dev, gpt7b, top=1)[0]
    check_plan(best, spec, 8, 128, dev)
    assert best.pp * best.tp > 1
    assert sum(best.ckpt) > 0 and best.ckpt[0] >= best.ckpt[-1]
    # the same model on 80 GB devices needs no checkpointing at all
    assert sum(simulate(spec, 8, 128, DEVICES["h100"], gpt7b, top=1)[0].ckpt) == 0


def test_cli_prints_a_plan(capsys):
    main(["--device", "h100", "--models", "gpt-1.3b", "--gpus", "8", "--top", "1"])
    out = capsys.readouterr().out
    assert "gpt-1.3b" in out and "samples/s" in out and "layers=[" in out and " cp1 " in out


def test_bad_arguments(gpt7b):
    with pytest.raises(ValueError, match="gpus"):
        simulate(GPT_MODELS["gpt-1.3b"], 0, 8, DEVICES["h100"], layer_model=object())
    with pytest.raises(ValueError, match="cp attention"):
        simulate(GPT_MODELS["gpt-7b"], 8, 8, DEVICES["h100"], gpt7b, cp_attentions=("zigzag",))
    with pytest.raises(ValueError, match="built for gpt-7b"):
        simulate(GPT_MODELS["gpt-1.3b"], 8, 8, DEVICES["h100"], gpt7b)


# ---- context parallelism ----

LONG = 131072


def test_cp_attention_choices_are_the_runtimes():
    from slapo.op.context_parallel import CP_ATTENTION as RUNTIME

    assert CP_ATTENTION == RUNTIME


def test_cp_bytes_per_choice_match_hand_arithmetic():
    """1 sample of 16 tokens, 4 query heads, 2 KV heads of dim 8, bf16."""
    a = AttnShard(batch=1, seq=16, cp=2, heads=4, kv_heads=2, head_dim=8)
    assert (a.q, a.kv) == (8 * 4 * 8 * 2, 8 * 2 * 8 * 2) == (512, 256)
    sent = {m: {k: sent_bytes(v, 2) for k, v in cp_attention_messages(m, a).items()}
            for m in CP_ATTENTION}
    # allgather: K and V of all 16 tokens (512 B each) gathered, half of each received; the
    # backward reduce-scatters dK, dV the same way
    assert sent["allgather"] == {"fwd": 2 * 512 / 2, "bwd": 2 * 512 / 2}
    # ring: cp-1 = 1 step with the local K+V; backward: K, V, dK, dV once, then dK, dV home
    assert sent["ring"] == {"fwd": 512, "bwd": 1024 + 512}
    # ulysses: q, k, v, o, half of each sent (2 KV heads divide over cp=2: no repeat)
    assert sent["ulysses"] == {"fwd": (512 + 256 + 256 + 512) / 2, "bwd": 768}

    b = AttnShard(batch=1, seq=16, cp=4, heads=4, kv_heads=2, head_dim=8)  # 4 tokens per rank
    assert (b.q, b.kv) == (256, 128)
    assert sent_bytes(cp_attention_messages("allgather", b)["fwd"], 4) == 2 * 512 * 3 / 4
    ring = cp_attention_messages("ring", b)
    assert sent_bytes(ring["fwd"], 4) == 3 * 256 and sent_bytes(ring["bwd"], 4) == 3 * 512 + 256
    # 2 KV heads over cp=4: repeated to the 4 query heads, so k and v travel query-sized
    assert sent_bytes(cp_attention_messages("ulysses", b)["fwd"], 4) == 4 * 256 * 3 / 4
    with pytest.raises(ValueError, match="query heads"):
        cp_attention_messages("ulysses", AttnShard(1, 16, 4, 6, 6, 8))
    with pytest.raises(ValueError, match="unknown"):
        cp_attention_messages("zigzag", a)
    assert cp_attention_messages("ring", AttnShard(1, 16, 1, 4, 4, 8)) == {"fwd": [], "bwd": []}

    # latency: every call (every ring step) pays alpha once
    calls = AlphaBeta(alpha=1.0, beta=0.0)
    n_calls = {m: [sum(message_time(x, 4, calls) for x in cp_attention_messages(m, b)[k])
                   for k in ("fwd", "bwd")] for m in CP_ATTENTION}
    assert n_calls == {"allgather": [2, 2], "ring": [3, 4], "ulysses": [4, 4]}

    # memory (saved, transient): whole-sequence K+V; 3 local K/V pairs; q, k, v receive buffers
    assert cp_attention_memory("allgather", a) == (2 * 512, 2 * 512)
    assert cp_attention_memory("ring", a) == (0, 3 * 2 * 256)
    assert cp_attention_memory("ulysses", a) == (0, 512 + 2 * 256)
    assert cp_attention_memory("ulysses", b) == (2 * (256 - 128), 256 + 2 * 256)


def _layout(lm, seq, cp, mode, tp=1):
    spec = dataclasses.replace(GPT_MODELS["gpt-7b"], seq=seq)
    return sim._Layout(spec, DEVICES["h100"], lm, tp, 1, 1, 1, 1, 0, cp, mode)


def test_cp_divides_per_rank_compute_and_activations(gpt7b):
    """The issue's bar: at cp=4 a rank's activation memory is <= 0.30x of cp=1's for the same
    layer config, asserted as ratios so that a model ignoring cp in them fails."""
    one = _layout(gpt7b, LONG, 1, None)
    for f in ("fwd_flops", "bwd_flops"):  # attention 1/cp (zig-zag), GEMMs at seq/cp
        assert gpt7b(f, 1, 1, LONG, 4) == pytest.approx(gpt7b(f, 1, 1, LONG, 1) / 4)
    assert gpt7b("saved", 1, 1, LONG, 4) == pytest.approx(gpt7b("saved", 1, 1, LONG, 1) / 4)
    for mode in ("ring", "ulysses"):
        four = _layout(gpt7b, LONG, 4, mode)
        assert four.saved / one.saved == pytest.approx(0.25)
        for ckpt in (0, 16, 32):
            ratio = four.stage_activation(0, 32, ckpt) / one.stage_activation(0, 32, ckpt)
            assert ratio <= 0.30, (mode, ckpt, ratio)
    # allgather saves the layer's whole-sequence K and V on top, 2 x 131072 x 4096 x 2 B: at
    # tp=1 that is 0.07x of the cp=1 layer's saved set, so allgather misses the bar per layer
    ag = _layout(gpt7b, LONG, 4, "allgather")
    assert ag.saved == pytest.approx(one.saved / 4 + 2 * LONG * 4096 * 2)
    assert 0.30 < ag.saved / one.saved < 0.33
    # with tp=8 the K/V are 1/8 as large and allgather meets the bar too
    ag8, one8 = _layout(gpt7b, LONG, 4, "allgather", tp=8), _layout(gpt7b, LONG, 1, None, tp=8)
    assert ag8.stage_activation(0, 32, 0) / one8.stage_activation(0, 32, 0) <= 0.30

    class IgnoresCP:  # the mutation: per-rank costs that forget the sequence is split
        spec = gpt7b.spec
        all_reduces, rank_params = gpt7b.all_reduces, gpt7b.rank_params

        def __call__(self, name, batch, tp, seq=None, cp=1):
            return gpt7b(name, batch, tp, seq, 1)

    broken = _layout(IgnoresCP(), LONG, 4, "ring")
    assert broken.stage_activation(0, 32, 0) / one.stage_activation(0, 32, 0) > 0.30


def test_short_sequence_plans_no_cp(gpt7b):
    """At 2048 tokens cp only adds communication: the same per-rank work as dp, plus exchanges."""
    small = GPTSpec("gpt-4x4096", 4, 4096, 32)  # the 7B's block shape, 4 layers
    dev = DEVICES["h100"]
    best = simulate(small, 8, 128, dev, gpt7b, top=1)[0]
    check_plan(best, small, 8, 128, dev)
    assert best.cp == 1 and best.cp_attention is None
    with_cp = simulate(small, 8, 128, dev, gpt7b, top=1, cps=(2,))[0]
    assert with_cp.cp == 2 and with_cp.step_time > best.step_time


def test_long_sequence_needs_cp(gpt7b):
    """A 7B-shaped GPT at 131072 tokens on 8 x 40 GB: no layout without cp fits, nor with cp 2
    or 4; cp=8 does and is chosen, with ring or ulysses: allgather's whole-sequence K/V beside
    ZeRO-3's gathered embedding and position table (182k x 4096 x 4 B) exceed the cap."""
    spec, dev = dataclasses.replace(GPT_MODELS["gpt-7b"], seq=LONG), DEVICES["a100-40gb"]
    grid = dict(micro_batches=(1,), zeros=(0, 3))
    assert simulate(spec, 8, 8, dev, gpt7b, top=1, cps=(1, 2, 4), **grid) == []
    plans = simulate(spec, 8, 8, dev, gpt7b, top=3, **grid)
    assert plans and all(p.cp == 8 for p in plans)
    for p in plans:
        check_plan(p, spec, 8, 8, dev)
    assert {p.cp_attention for p in plans} == {"ring", "ulysses"}


def test_cli_long_sequence_prints_cp(gpt7b, monkeypatch, capsys):
    monkeypatch.setattr(sim, "LayerModel", lambda spec: gpt7b)
    main(["--device", "a100-40gb", "--models", "gpt-7b", "--gpus", "8", "--samples-per-gpu", "1",
          "--seq", str(LONG), "--cp", "8", "--cp-attention", "ring", "--top", "1"])
    out = capsys.readouterr().out
    assert f"seq{LONG}" in out and "cp8 ring" in out and "layers=[32]" in out


# ---- mixture of experts: expert parallelism ----


@pytest.fixture(scope="module")
def qwen():
    return LayerModel(MOE_MODELS["qwen3-30b-a3b"])


def test_moe_presets_are_shaped_like_the_models():
    q, m = MOE_MODELS["qwen3-30b-a3b"], MOE_MODELS["mixtral-8x7b"]
    assert q.expert_layer_params == 128 * 3 * 2048 * 768 and m.expert_layer_params == 8 * 3 * 4096 * 14336
    assert 30.0e9 < q.params < 31e9 and 3.0e9 < q.active_params < 3.5e9  # "30B-A3B"
    assert 46e9 < m.params < 48e9 and 12.5e9 < m.active_params < 14e9  # 46.7B, 12.9B active
    assert GPT_MODELS["gpt-7b"].active_params == GPT_MODELS["gpt-7b"].params


def test_ep_exchange_bytes_and_expert_costs_match_hand_arithmetic():
    """16 tokens, top-2 of 4 experts, hidden 8, expert width 4, bf16."""
    x = ExpertShard(tokens=16, hidden=8, intermediate=4, experts=4, top_k=2, ep=2)
    assert (x.rows, x.routed) == (32, 32 * 8 * 2) == (32, 512)
    msgs = moe_messages(x)  # dispatch + combine, and their reverses in backward
    assert msgs == {"fwd": [("all_to_all", 512)] * 2, "bwd": [("all_to_all", 512)] * 2}
    # each rank keeps 1/ep of its routed rows: sends half of the 512 B, twice each way
    assert sent_bytes(msgs["fwd"], 2) == sent_bytes(msgs["bwd"], 2) == 2 * 512 / 2
    x4 = dataclasses.replace(x, ep=4)
    assert sent_bytes(moe_messages(x4)["fwd"], 4) == 2 * 512 * 3 / 4
    assert [sum(message_time(m, 4, AlphaBeta(1.0, 0.0)) for m in moe_messages(x4)[k])
            for k in ("fwd", "bwd")] == [2, 2]  # one latency per all-to-all
    assert moe_messages(dataclasses.replace(x, ep=1)) == {"fwd": [], "bwd": []}
    # FLOPs: router 2 x 16 x 8 x 4, experts 32 rows x 3 GEMMs x 2 x 8 x 4; backward twice
    assert (x.fwd_flops, x.bwd_flops) == (1024 + 6144, 2 * 7168)
    assert (x.local_params, x4.local_params) == (2 * 3 * 8 * 4, 1 * 3 * 8 * 4)
    # saved: per row 2 H-rows + 4 I-rows in bf16, fp32 router logits
    assert x.saved == 32 * (2 * 8 + 4 * 4) * 2 + 16 * 4 * 4 == x4.saved
    q = MOE_MODELS["qwen3-30b-a3b"]
    assert expert_shard(q, 2, 4, 8).tokens == 2 * 4096 // 4


def _moe_layout(lm, ep, zero=0, dp=8, pp=1):
    spec = MOE_MODELS["qwen3-30b-a3b"]
    return sim._Layout(spec, DEVICES["h100"], lm, 1, pp, dp, 1, 16, zero, 1, None, ep)


def test_ep_layer_time_adds_the_all_to_alls_and_sheds_weight_traffic(qwen):
    dev = DEVICES["h100"]
    one, two = _moe_layout(qwen, 1), _moe_layout(qwen, 2)
    routed = 4096 * 8 * 2048 * 2
    a2a = dev.intra.alpha + dev.intra.beta * routed / 2  # ep group of 2 ranks: NVLink
    assert one.t_ep == 0 and two.t_ep == pytest.approx(4 * a2a)
    # the rest differs by the expert weights streamed: 2W forward, 6W backward, W halved
    shed = (one.expert_layer_params - two.expert_layer_params) * 2 / dev.mem_bandwidth
    assert two.t_layer - one.t_layer == pytest.approx(4 * a2a - 4 * shed)
    assert two.t_recompute - one.t_recompute == pytest.approx(2 * a2a - shed)  # forward again
    assert two.saved == one.saved  # balanced routing: a rank computes T x k rows whatever ep


def _expert_state_ratios(lm, zero):
    layouts = {ep: _moe_layout(lm, ep, zero) for ep in (1, 2, 4, 8)}
    experts = {ep: lay.stage_states(0, 48) - model_state_bytes(lay.stage_params(0, 48), dp=8, zero=zero,
                                                               param_bytes=2).total
               for ep, lay in layouts.items()}
    return {ep: experts[ep] / experts[1] for ep in layouts}, experts


def test_expert_memory_per_rank_scales_one_over_ep(qwen, monkeypatch):
    spec = MOE_MODELS["qwen3-30b-a3b"]
    ratios, experts = _expert_state_ratios(qwen, zero=0)
    assert experts[1] == pytest.approx(48 * spec.expert_layer_params * 16)  # bf16 + grad + fp32 Adam
    assert ratios == pytest.approx({1: 1, 2: 1 / 2, 4: 1 / 4, 8: 1 / 8})
    # ZeRO shards the experts over dp_rest = dp / ep only: at ep 8 of dp 8 nothing shards them
    ratios3, experts3 = _expert_state_ratios(qwen, zero=3)
    assert experts3[8] == pytest.approx(experts[8])
    assert experts3[2] == pytest.approx(experts[2] / 4)  # over dp_rest = 4
    # gradient sync: non-experts over dp, experts over dp_rest
    lay, link = _moe_layout(qwen, 2), DEVICES["h100"].intra
    t_dp, _ = lay.after_pipeline([48])
    assert t_dp == pytest.approx(collective_time("all_reduce", lay.stage_params(0, 48) * 2, 8, link)
                                 + collective_time("all_reduce", lay.stage_expert_params(0, 48) * 2, 4, link))

    # the mutation: expert weights that forget they are split over ep
    monkeypatch.setattr(sim.ExpertShard, "local_params",
                        property(lambda x: x.experts * 3 * x.hidden * x.intermediate))
    with pytest.raises(AssertionError):
        assert _expert_state_ratios(qwen, zero=0)[0] == pytest.approx({1: 1, 2: 1 / 2, 4: 1 / 4, 8: 1 / 8})


def test_qwen3_moe_on_8_h100_needs_ep(qwen):
    """30.4B parameters x 16 B (bf16 weights and grads, fp32 master and Adam) = 487 GB: without
    ZeRO-3 not even one 8th fits in 80 GB beside the replicated weights, so ep=1 needs ZeRO-3
    (and the planner adds pp to shrink its per-micro-batch weight gathers); ep 8 holds 1/8 of
    the experts whole and only exchanges tokens."""
    spec, dev = MOE_MODELS["qwen3-30b-a3b"], DEVICES["h100"]
    assert spec.seq == 4096 and spec.params * (2 + 14 / 8) > 0.9 * dev.memory_bytes  # ZeRO-2, dp 8
    grid = dict(tps=(1,), micro_batches=(1,), cps=(1,), zeros=(2, 3))
    # tp does not help: the experts are not split by tp
    assert simulate(spec, 8, 64, dev, qwen, top=1, eps=(1,), pps=(1,), tps=(1, 8), micro_batches=(1,),
                    cps=(1,), zeros=(0, 1, 2)) == []
    best = simulate(spec, 8, 64, dev, qwen, top=1, eps=(1, 2, 4, 8), **grid)[0]
    check_plan(best, spec, 8, 64, dev)
    assert best.ep > 1 and best.experts == 128 and f" ep{best.ep} " in best.row()
    assert best.breakdown["ep_per_layer"] > 0
    no_ep = simulate(spec, 8, 64, dev, qwen, top=1, eps=(1,), **grid)
    assert no_ep, "ep=1 fits with ZeRO-3 and pp"
    assert no_ep[0].zero == 3 and no_ep[0].step_time > 1.15 * best.step_time


def test_dense_specs_keep_ep_1(gpt7b, monkeypatch, capsys):
    spec, dev = GPT_MODELS["gpt-7b"], DEVICES["h100"]
    plans = simulate(spec, 8, 128, dev, gpt7b, top=3, tps=(1,), pps=(1, 2), eps=(2, 4, 8))
    assert plans and all(p.ep == 1 and p.experts == 0 and " ep" not in p.row() for p in plans)
    with pytest.raises(ValueError, match="dense block"):
        simulate(MoESpec("moe-7b", 32, 4096, 32, experts=8, top_k=2, moe_intermediate=1024), 8, 8,
                 dev, gpt7b)
    with pytest.raises(ValueError, match="ep degrees"):
        simulate(spec, 8, 8, dev, gpt7b, eps=(0,))
    with pytest.raises(SystemExit):
        main(["--models", "gpt-13b"])


def test_cli_prints_ep(qwen, monkeypatch, capsys):
    monkeypatch.setattr(sim, "LayerModel", lambda spec: qwen)
    main(["--models", "qwen3-30b-a3b", "--gpus", "8", "--samples-per-gpu", "4", "--ep", "8",
          "--cp", "1", "--top", "1"])
    out = capsys.readouterr().out
    assert "qwen3-30b-a3b" in out and "seq4096" in out and " cp1 ep8 " in out
