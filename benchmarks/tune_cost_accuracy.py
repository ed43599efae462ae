"""Predicted vs measured saved-activation bytes over a grid of HF blocks (CPU, a few minutes).

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 python benchmarks/tune_cost_accuracy.py
"""

from __future__ import annotations

import itertools
import time

import torch
from transformers import BertConfig, GPT2Config
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from slapo.model_schedule.plan_block import shard_block
from slapo.tune.capture import measure_saved_bytes
from slapo.tune.cost import block_cost, saved_activation_bytes


def build(kind: str, hidden: int, impl: str, p: float) -> torch.nn.Module:
    if kind == "gpt2":
        cfg = GPT2Config(n_embd=hidden, n_head=8, n_layer=1, vocab_size=64, bos_token_id=0,
                         eos_token_id=0, attn_pdrop=p, resid_pdrop=p)
        cfg._attn_implementation = impl
        return GPT2Block(cfg).train()
    cfg = BertConfig(hidden_size=hidden, num_attention_heads=8, intermediate_size=4 * hidden,
                     hidden_dropout_prob=p, attention_probs_dropout_prob=p, vocab_size=64)
    cfg._attn_implementation = impl
    return BertLayer(cfg).train()


def main() -> None:
    torch.manual_seed(0)
    rows, worst, n = [], 0.0, 0
    t_fit = 0.0
    for kind, hidden, (impl, p) in itertools.product(
        ("gpt2", "bert"), (64, 256, 512), (("eager", 0.1), ("sdpa", 0.1), ("sdpa", 0.0))
    ):
        block = build(kind, hidden, impl, p)
        ex = (torch.randn(2, 16, hidden, requires_grad=True),)
        t0 = time.perf_counter()
        block_cost(block, ex, tp=True)
        t_fit += time.perf_counter() - t0
        shards = {tp: shard_block(block, tp) for tp in (1, 2)}
        local = 0.0
        for b, s, tp, ck in itertools.product((1, 2, 4, 8), (16, 64, 128, 256), (1, 2), (False, True)):
            x = torch.randn(b, s, hidden, requires_grad=True)
            m = measure_saved_bytes(shards[tp], (x,), checkpoint=ck, include_inputs=True)
            pr = saved_activation_bytes(block, ex, batch=b, seq=s, tp=tp, checkpoint=ck, include_inputs=True)
            err = abs(pr - m) / m
            local, n = max(local, err), n + 1
        worst = max(worst, local)
        rows.append(f"{kind:5s} h={hidden:<4d} {impl:5s} p={p}: max rel. error {local:.2e}")
    print("\n".join(rows))
    print(f"{n} grid points, worst relative error {worst:.2e}, symbolic fits took {t_fit:.1f} s in total")


if __name__ == "__main__":
    main()
