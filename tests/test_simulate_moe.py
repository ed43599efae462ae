"""The cluster simulator's DeepSeek-V3-shaped preset (`slapo/tune/simulate_moe.py`): its shape
against transformers' DeepseekV3 (parameters counted on the meta device), MLA's analytic costs
against HF's attention module and hand arithmetic, and what the shared expert, the dense first
layers and ep change in a layout's memory and time."""

import dataclasses
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

import torch  # noqa: E402

from slapo.tune import simulate as sim  # noqa: E402
from slapo.tune.memory import model_state_bytes, pipeline_inflight  # noqa: E402
from slapo.tune.simulate import (  # noqa: E402
    DEVICES,
    MOE_MODELS,
    FFNShard,
    MLALayerModel,
    attn_shard,
    layer_model_for,
    roofline_time,
    simulate,
)

DS = MOE_MODELS["deepseek-v3"]
H100 = DEVICES["h100"]


def _count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_preset_is_transformers_deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config()
    assert (DS.layers, DS.hidden, DS.heads, DS.vocab) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size)
    assert (DS.experts, DS.top_k, DS.moe_intermediate, DS.shared_experts) == (
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.n_shared_experts)
    assert (DS.dense_layers, DS.dense_intermediate) == (cfg.first_k_dense_replace, cfg.intermediate_size)
    assert (DS.q_lora_rank, DS.kv_lora_rank, DS.qk_nope_head_dim, DS.qk_rope_head_dim, DS.v_head_dim) == (
        cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
    with torch.device("meta"):  # 671B parameters that take no memory
        model = DeepseekV3ForCausalLM(cfg)
    assert DS.params == pytest.approx(_count(model), rel=0.01)
    dense, moe = model.model.layers[0], model.model.layers[DS.dense_layers]
    assert DS.mla.params == pytest.approx(_count(dense.self_attn), rel=0.01)
    assert DS.dense_layer_params == pytest.approx(_count(dense), rel=0.01)
    assert DS.shared_layer_params == pytest.approx(_count(moe.mlp.shared_experts), rel=0.01)
    assert DS.expert_layer_params == pytest.approx(_count(moe.mlp.experts), rel=0.01)
    assert DS.attention_layer_params + DS.shared_layer_params + DS.expert_layer_params == pytest.approx(
        _count(moe), rel=0.01)
    assert 36e9 < DS.active_params < 38.5e9  # DeepSeek's "37B activated"


def _tiny_mla():
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                           num_hidden_layers=1, vocab_size=128)
    spec = sim.MLAMoESpec("tiny", 1, 64, 4, vocab=128, seq=16, experts=4, top_k=2, moe_intermediate=8,
                          q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=8)
    return cfg, spec


def test_mla_flops_and_params_match_hf_attention():
    """FLOPs of HF's DeepseekV3Attention (meta device, torch's flop counter) against the
    analytic model: forward equal; backward = the counted one (SDPA's math path: dQ, dK, dP, dV)
    + flash attention's recomputed scores (Q K^T), as the traced model counts SDPA."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    cfg, spec = _tiny_mla()
    cfg._attn_implementation = "sdpa"
    b, s = 2, 16
    with torch.device("meta"):
        attn = DeepseekV3Attention(cfg, 0)
        x = torch.empty(b, s, 64, requires_grad=True)
        cos_sin = DeepseekV3RotaryEmbedding(cfg)(x, torch.arange(s)[None].expand(b, s))
    assert spec.mla.params == _count(attn)
    with FlopCounterMode(display=False) as fc:
        out, _ = attn(x, position_embeddings=cos_sin, attention_mask=None)
        fwd = fc.get_total_flops()
        out.sum().backward()
        bwd = fc.get_total_flops() - fwd
    lm = MLALayerModel(spec)
    assert lm("fwd_flops", b, 1) == fwd
    assert lm("bwd_flops", b, 1) == bwd + 2 * b * s * s * 4 * 12  # + Q K^T: 4 heads, q/k dim 12


def test_mla_split_saved_and_exchanges_match_hand_arithmetic():
    """H 64, 4 heads, r_q 32, r_kv 16, d_n 8, d_r 4 (q/k head dim 12), d_v 8."""
    _, spec = _tiny_mla()
    m, lm = spec.mla, MLALayerModel(spec)
    assert m.replicated_params == 64 * 32 + 32 + 64 * (16 + 4) + 16  # q_a, kv_a and their norms
    assert m.split_params == 32 * 4 * 12 + 16 * 4 * (8 + 8) + 4 * 8 * 64  # q_b, kv_b, o_proj
    assert lm.rank_params(2) == m.replicated_params + m.split_params / 2 + 2 * 64
    # saved per token: norms' in/out (4H + 2r_q + 2r_kv), SDPA's q, k (12 each), v, out (8
    # each) and fp32 lse per head, o_proj's input (8 per head), 4 fp32 inverse RMS
    assert lm.saved_elements(1) == (256 + 64 + 32) + 4 * (12 + 12 + 8 + 8 + 2) + 4 * 8 + 8
    assert lm.saved_elements(2) == (256 + 64 + 32) + 2 * (12 + 12 + 8 + 8 + 2) + 2 * 8 + 8
    assert lm("saved", 2, 2, 16, 2) == 2 * 16 / 2 * lm.saved_elements(2) * 2
    assert lm("input_bytes", 2, 2, 16, 2) == 16 * 64 * 2
    # tp all-reduces: o_proj's output; backward the latents' and the rotary key's gradients
    assert lm.all_reduces(2, 16, 2) == ([16 * 64 * 2], [16 * (32 + 16 + 4) * 2])
    # cp moves per head (12 + 8) / 2 = 10 of q/out and of k/v, so q + out and k + v are exact
    a = attn_shard(spec, 1, 1, 2)
    assert (a.heads, a.kv_heads, a.head_dim) == (4, 4, 10) and 2 * a.kv == 8 * 4 * (12 + 8) * 2
    assert attn_shard(DS, 1, 8, 2).head_dim == 160
    # the layer model must be MLA's for an MLA spec
    assert isinstance(layer_model_for(DS), MLALayerModel)
    with pytest.raises(ValueError, match="MLA layer"):
        simulate(MOE_MODELS["qwen3-30b-a3b"], 8, 8, H100, layer_model_for(spec))


def _layout(spec=DS, ep=8, zero=1, dp=32, pp=8, tp=1, b=1):
    return sim._Layout(spec, H100, MLALayerModel(spec), tp, pp, dp, b, 4096 // (dp * b), zero, 1, None, ep)


def test_shared_expert_adds_its_memory_and_time():
    with_, without = _layout(), _layout(dataclasses.replace(DS, shared_experts=0))
    h, i_s = DS.hidden, DS.moe_intermediate
    # states: 3HI per MoE layer, 2 + 2 + 12/32 B each under ZeRO-1 over dp 32 (tp 1)
    for stage, moe_layers in ((0, 5), (1, 8)):  # stage 0 holds the 3 dense layers
        extra = with_.stage_states(stage, 8) - without.stage_states(stage, 8)
        assert extra == pytest.approx(moe_layers * 3 * h * i_s * (4 + 12 / 32))
    # activations: its gate, up, silu(gate), product for every token of every micro-batch held
    x = FFNShard(4096, h, i_s)
    assert x.saved == 4 * 4096 * i_s * 2
    extra = with_.stage_activation(1, 8, 0) - without.stage_activation(1, 8, 0)
    assert extra == pytest.approx(pipeline_inflight(1, 8, with_.g) * 8 * x.saved)
    # time: its roofline forward and backward (tp 1: no all-reduce), forward again if recomputed
    t_f, t_b = roofline_time(x.fwd_flops, x.fwd_bytes, H100), roofline_time(x.bwd_flops, x.bwd_bytes, H100)
    assert with_.t_layer - without.t_layer == pytest.approx(t_f + t_b)
    assert with_.t_recompute - without.t_recompute == pytest.approx(t_f)
    assert with_.t_dense == without.t_dense
    # tp splits it (Megatron) and adds its two all-reduces
    tp2, tp2_without = _layout(tp=2, dp=16), _layout(dataclasses.replace(DS, shared_experts=0), tp=2, dp=16)
    ar = H100.intra.alpha + H100.intra.beta * 4096 * h * 2 * 2 * (2 - 1) / 2  # ring all-reduce of 2
    split = FFNShard(4096, h, i_s, tp=2)
    assert tp2.t_layer - tp2_without.t_layer == pytest.approx(
        roofline_time(split.fwd_flops + split.bwd_flops, split.fwd_bytes + split.bwd_bytes, H100) + 2 * ar)
    assert tp2.layer_params - tp2_without.layer_params == 3 * h * i_s / 2


def test_dense_first_layers_are_lighter_and_stay_in_stage_0():
    """DeepSeek-V3's dense MLP (width 18432 = 9 x 2048) computes what 8 routed + 1 shared
    expert do per token, without the experts' weights, router, all-to-alls and routed rows;
    as MoE layers, stage 0 holds more and takes longer."""
    lay, all_moe = _layout(), _layout(dataclasses.replace(DS, dense_layers=0))
    assert lay.t_dense < lay.t_layer and lay.dense_saved < lay.saved
    assert lay.dense_layer_params < lay.layer_params + lay.expert_layer_params
    t, mem = lay.stage_cost(0, 8, 0)
    t_moe, mem_moe = all_moe.stage_cost(0, 8, 0)
    assert t == pytest.approx(5 * lay.t_layer + 3 * lay.t_dense + 2 * lay.p2p)
    assert t_moe == pytest.approx(8 * lay.t_layer + 2 * lay.p2p) and t_moe > t and mem_moe > mem
    assert lay.stage_cost(1, 8, 0) == all_moe.stage_cost(1, 8, 0)  # no dense layer past stage 0
    # stage 0 must hold all 3 dense layers: fewer are refused (pp > 1)
    assert lay.stage_kinds(0, 2) is None and lay.stage_cost(0, 2, 0) == (float("inf"), float("inf"))
    assert lay.stage_kinds(1, 2) == (0, 2) and lay.stage_kinds(0, 3) == (3, 0)
    # checkpointing takes first the kind freeing more bytes per second of recompute
    moe_rate = (lay.saved - lay.inp) / lay.t_recompute
    dense_rate = (lay.dense_saved - lay.inp) / lay.t_dense_recompute
    first = (0, 1) if moe_rate >= dense_rate else (1, 0)
    assert lay.ckpt_kinds(3, 5, 1) == first and lay.ckpt_kinds(3, 5, 8) == (3, 5)
    inflight = pipeline_inflight(0, 8, lay.g)
    assert lay.stage_activation(0, 8, 8) == pytest.approx(
        inflight * 8 * lay.inp + max(lay.saved, lay.dense_saved) + lay.transient)


def test_ep_divides_the_experts_memory():
    layouts = {ep: _layout(ep=ep, zero=0) for ep in (1, 2, 4, 8, 16, 32)}
    experts = {ep: lay.stage_states(1, 8) - model_state_bytes(lay.stage_params(1, 8), dp=32, zero=0,
                                                              param_bytes=2).total
               for ep, lay in layouts.items()}
    assert experts[1] == pytest.approx(8 * DS.expert_layer_params * 16)  # bf16 + grad + fp32 Adam
    assert {ep: experts[ep] / experts[1] for ep in experts} == pytest.approx({ep: 1 / ep for ep in experts})
    assert layouts[8].stage_expert_params(0, 8) == 5 * DS.expert_layer_params / 8  # 3 of 8 dense
    # ZeRO-3's gathered unit is an MoE layer with its E/ep experts: 4 B (weight, grad) each
    z3 = _layout(ep=1, zero=3)
    assert z3.zero3_buffer(1, 8) == pytest.approx(4 * (z3.layer_params + DS.expert_layer_params))
    assert _layout(ep=8, zero=3).zero3_buffer(1, 8) == pytest.approx(
        4 * (z3.layer_params + DS.expert_layer_params / 8))


def test_deepseek_v3_on_h100s_needs_256_gpus_and_ep():
    """671B x 16 B is 168 GB per GPU on 64 GPUs even fully sharded; on 256 it fits only with
    ep (ZeRO-3 without ep gathers a whole 256-expert layer, 11.5B x 4 B, while it runs)."""
    lm = layer_model_for(DS)
    assert DS.params * 16 / 64 > H100.memory_bytes
    grid = dict(tps=(1,), pps=(8,), micro_batches=(1,), cps=(1,), zeros=(1, 2, 3))
    assert simulate(DS, 64, 1024, H100, lm, top=1, eps=(1, 8, 64), **grid) == []
    assert simulate(DS, 256, 4096, H100, lm, top=1, eps=(1,), **grid) == []
    best = simulate(DS, 256, 4096, H100, lm, top=1, eps=(1, 8, 32), **grid)[0]
    assert best.ep > 1 and best.experts == 256 and f" ep{best.ep} " in best.row()
    assert best.dp * best.tp * best.pp == 256 and sum(best.layers) == 61 and best.layers[0] >= 3
    assert max(best.stage_memory) <= 0.9 * H100.memory_bytes - 2e9
    assert best.breakdown["ep_per_layer"] > 0 and 0 < best.mfu < 1
