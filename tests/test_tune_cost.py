"""Cost model vs ground truth: predicted saved-activation bytes equal a real eager forward's."""

import itertools
import os
import time

import numpy as np
import pytest
import sweep
import sympy
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from transformers import BertConfig, GPT2Config  # noqa: E402
from transformers.models.bert.modeling_bert import BertLayer  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from slapo.errors import SchedulingError  # noqa: E402
from slapo.model_schedule.plan_block import shard_block  # noqa: E402
from slapo.tune.capture import measure_saved_bytes  # noqa: E402
from slapo.tune.cost import BATCH, CKPT, SEQ, TP, block_cost, saved_activation_bytes  # noqa: E402


def gpt2_block(hidden, impl, dropout):
    cfg = GPT2Config(n_embd=hidden, n_head=8, n_layer=1, vocab_size=64, bos_token_id=0,
                     eos_token_id=0, attn_pdrop=dropout, resid_pdrop=dropout, embd_pdrop=dropout)
    cfg._attn_implementation = impl
    return GPT2Block(cfg).train()


def bert_layer(hidden, impl, dropout):
    cfg = BertConfig(hidden_size=hidden, num_attention_heads=8, intermediate_size=4 * hidden,
                     num_hidden_layers=1, vocab_size=64, hidden_dropout_prob=dropout,
                     attention_probs_dropout_prob=dropout)
    cfg._attn_implementation = impl
    return BertLayer(cfg).train()


ALL_BLOCKS = [
    (make, hidden, impl, dropout)
    for make in (gpt2_block, bert_layer)
    for hidden in (64, 256)
    for impl, dropout in (("eager", 0.1), ("sdpa", 0.1), ("sdpa", 0.0))
]
# CI's default sample (tests/sweep.py): each block under each attention once, GPT-2 at width 64
# and BERT at 256; both widths of both with SLAPO_SWEEP=all
BLOCKS = sweep.sample(ALL_BLOCKS, [b for b in ALL_BLOCKS if (b[0] is gpt2_block) == (b[1] == 64)])


@pytest.mark.parametrize("make,hidden,impl,dropout", BLOCKS,
                         ids=[f"{m.__name__}-h{h}-{i}-p{d}" for m, h, i, d in BLOCKS])
def test_saved_bytes_match_eager_over_grid(make, hidden, impl, dropout):
    torch.manual_seed(0)
    block = make(hidden, impl, dropout)
    example = (torch.randn(2, 16, hidden, requires_grad=True),)
    shards = {tp: shard_block(block, tp) for tp in (1, 2)}  # the runtime's plan, one rank
    worst = 0.0
    for batch, seq, tp, ckpt in itertools.product((1, 4), (16, 48, 128), (1, 2), (False, True)):
        x = torch.randn(batch, seq, hidden, requires_grad=True)
        for include in (False, True):
            measured = measure_saved_bytes(shards[tp], (x,), checkpoint=ckpt, include_inputs=include)
            predicted = saved_activation_bytes(block, example, batch=batch, seq=seq, tp=tp,
                                               checkpoint=ckpt, include_inputs=include)
            if measured == 0:
                assert predicted == 0, (batch, seq, tp, ckpt, include)
            else:
                worst = max(worst, abs(predicted - measured) / measured)
        if ckpt:  # a checkpointed block keeps exactly its input
            assert measured == x.numel() * 4
    assert worst <= 0.01, worst


def test_symbolic_form_and_vectorised_evaluation():
    block = gpt2_block(64, "eager", 0.0)
    cost = block_cost(block, (torch.randn(2, 16, 64, requires_grad=True),), tp=True)
    expr = cost.saved(include_inputs=True)
    assert expr.free_symbols <= {BATCH, SEQ, TP, CKPT}
    # attention scores are quadratic in seq and divided by tp; the block input is not sharded
    assert sympy.degree(expr, SEQ) == 2
    assert cost.exprs["input_bytes"] == 64 * 4 * BATCH * SEQ
    f = cost.lambdify("saved", expr)
    n = 1_000_000
    rng = np.random.default_rng(0)
    b, s = rng.integers(1, 64, n), rng.integers(1, 4096, n)
    tp, ck = rng.choice([1, 2], n), rng.integers(0, 2, n)
    t0 = time.perf_counter()
    vals = f(b, s, tp, ck)
    took = time.perf_counter() - t0
    assert vals.shape == (n,) and took < 2.0
    i = 12345
    assert vals[i] == pytest.approx(cost.saved_bytes(int(b[i]), int(s[i]), int(tp[i]), bool(ck[i]), True))


def test_params_and_flops_scale_with_tp():
    block = gpt2_block(64, "eager", 0.0)
    cost = block_cost(block, (torch.randn(2, 16, 64, requires_grad=True),), tp=True, backward=True)
    n_params = sum(p.numel() for p in block.parameters())
    assert cost.value("param_bytes", 2, 16, 1) == n_params * 4
    shard = shard_block(block, 2)
    assert cost.value("param_bytes", 2, 16, 2) == sum(p.numel() for p in shard.parameters()) * 4
    # forward matmul FLOPs: 2*b*s*(3h*h + h*h + 8h*h) + attention 4*b*s^2*h
    b, s, h = 3, 32, 64
    want = 2 * b * s * 12 * h * h + 4 * b * s * s * h
    assert cost.value("fwd_flops", b, s, 1) == want
    assert cost.value("fwd_flops", b, s, 2) == want // 2
    assert cost.value("bwd_flops", b, s, 1) == pytest.approx(2 * want, rel=0.01)


@pytest.mark.parametrize("make", [gpt2_block, bert_layer])
def test_tp_shard_computes_megatron_partial_sums(make):
    torch.manual_seed(0)
    block = make(64, "eager", 0.0).eval()
    h = torch.randn(2, 8, 64)
    if make is gpt2_block:
        full = block.attn(h)[0]
        parts = [shard_block(block, 2, rank=r).attn(h)[0] for r in range(2)]
        bias = block.attn.c_proj.bias
        mlp = block.mlp(h)
        mlp_parts = [shard_block(block, 2, rank=r).mlp(h) for r in range(2)]
        torch.testing.assert_close(sum(mlp_parts) - block.mlp.c_proj.bias, mlp, atol=1e-5, rtol=1e-5)
    else:
        full = block.attention.self(h)[0]
        parts = [shard_block(block, 2, rank=r).attention.self(h)[0] for r in range(2)]
        full, parts, bias = full, [torch.cat(parts, -1)], 0.0
    # row-parallel outputs are partial sums (bias added once after the all-reduce)
    torch.testing.assert_close(sum(parts) - (len(parts) - 1) * bias, full, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_clear_errors():
    block = gpt2_block(64, "eager", 0.0)
    with pytest.raises(SchedulingError, match="no tensor-parallel plan"):
        shard_block(torch.nn.Linear(4, 4), 2)
    with pytest.raises(SchedulingError, match="not divisible"):
        shard_block(block, 3)
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        saved_activation_bytes(block, (torch.randn(2, 16, 64),), tp=0)
    with pytest.raises(SchedulingError, match=r"\(batch, seq"):
        saved_activation_bytes(block, (torch.randn(64),))


class SizeDependent(torch.nn.Module):
    """Saves an extra tensor only for long sequences: not a polynomial in seq."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * y if x.shape[1] >= 64 else y


def test_non_polynomial_costs_are_rejected_not_extrapolated():
    from slapo.errors import TraceError

    with pytest.raises(TraceError, match="not a polynomial"):
        block_cost(SizeDependent(), (torch.randn(2, 16, 8, requires_grad=True),))


def test_inputs_fn_for_blocks_with_masks():
    block = bert_layer(64, "eager", 0.0)

    def inputs(b, s):
        return {"hidden_states": torch.randn(b, s, 64, requires_grad=True),
                "attention_mask": torch.zeros(b, 1, s, s)}

    pred = saved_activation_bytes(block, inputs, batch=3, seq=32)
    x = inputs(3, 32)
    measured = measure_saved_bytes(block, x)
    assert pred == measured > 0


# ---- the cost model runs the runtime's plan: LLaMA (GQA, SwiGLU, no biases) at tp=2 ----------

def _llama_inputs(model):
    """inputs_fn(batch, seq) of one LLaMA decoder layer: hidden states and the rotary tables."""
    def inputs(b, s):
        g = torch.Generator().manual_seed(b * 1000 + s)
        hidden = torch.randn(b, s, model.config.hidden_size, generator=g, requires_grad=True)
        pos = torch.arange(s).unsqueeze(0)
        return {"hidden_states": hidden,
                "position_embeddings": model.model.rotary_emb(hidden, position_ids=pos)}

    return inputs


LLAMA_SIZES = ((2, 16), (3, 32))


def job_llama_runtime_layer():
    """One rank of `model_schedule.apply(llama, tp=2)`: its first layer's saved bytes and
    parameter bytes per size (the ground truth the cost model must predict)."""
    import models

    import slapo
    from slapo import model_schedule

    model = models.llama(seed=0, layers=1)
    sch = slapo.create_schedule(model)
    model_schedule.apply(sch, tp=2)
    layer, inputs = model.model.layers[0], _llama_inputs(model)
    return {"saved": [measure_saved_bytes(layer, inputs(b, s)) for b, s in LLAMA_SIZES],
            "params": sum(p.numel() * p.element_size() for p in layer.parameters())}


@pytest.mark.dist
def test_llama_tp2_cost_matches_the_runtime_sharded_layer(dist2):
    import models

    runtime = dist2.run(job_llama_runtime_layer)
    assert runtime[0] == runtime[1]  # both ranks hold the same shapes
    model = models.llama(seed=0, layers=1)
    block, inputs = model.model.layers[0], _llama_inputs(model)
    cost = block_cost(block, inputs_fn=inputs, seq=16, tp=True)  # symbolic in batch, seq, tp
    predicted = [cost.saved_bytes(b, s, tp=2) for b, s in LLAMA_SIZES]
    assert predicted == runtime[0]["saved"]
    assert saved_activation_bytes(block, inputs, batch=2, seq=16, tp=2) == predicted[0]
    unsharded = [cost.saved_bytes(b, s, tp=1) for b, s in LLAMA_SIZES]
    assert unsharded[0] == measure_saved_bytes(block, inputs(2, 16))
    assert all(p < u for p, u in zip(predicted, unsharded))  # the plan did shard something
    assert cost.value("param_bytes", 2, 16, 2) == runtime[0]["params"]
