"""`slapo train --model mixtral|qwen3_moe` (issue 33, item 7): the registry's mixtures of experts
train on HF's own loss *with* the auxiliary load-balancing loss, computed per unit (a
micro-batch on one rank) from that unit's routing statistics and averaged like the LM loss
(docs/train.md "Mixtures of experts").

The reference is computed from HF's pieces, not from the run's model: the shifted cross
entropy of the logits plus 0.001 (HF's `router_aux_loss_coef`) times HF's
`load_balancing_loss_func` of the router logits, per half of the batch. A registry that drops
the auxiliary loss (`output_router_logits=False`) or a step that computed it over the whole
batch fails here.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, seq_len=16, batch_size=4,
            progress=False, plot=False, eval_batches=0)
AUX_COEF = 0.001  # HF's router_aux_loss_coef default (Mixtral, Qwen3-MoE)

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_loss(model, ids: torch.Tensor, whole_batch_aux: bool = False) -> torch.Tensor:
    """LM loss + AUX_COEF x HF's load-balancing loss, from HF's functions."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    out = model(input_ids=ids, output_router_logits=True)
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]),
                         ids[:, 1:].reshape(-1))
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    aux = load_balancing_loss_func(out.router_logits, experts, cfg.num_experts_per_tok)
    return lm + AUX_COEF * aux, lm


def _first_step(model_name: str, grad_accum: int):
    """(the run's first-step loss, its model before the step, the global batch)."""
    from slapo.train import TrainConfig
    from slapo.train.assemble import build
    from slapo.train.loop import train_one_step
    from slapo.train.setup import setup

    cfg = TrainConfig(model=model_name, steps=1, grad_accum=grad_accum, **TINY)
    cfg.check()
    run = build(cfg, setup(cfg), log=lambda *a, **k: None)
    before = copy.deepcopy(run.model)
    state = run.data.state_dict()
    batch = run.data.next_batch(cfg.batch_size)
    run.data.load_state_dict(state)
    return train_one_step(run), before, batch["input_ids"]


@pytest.mark.parametrize("model_name", ["mixtral", "qwen3_moe"])
def test_moe_registry_trains_on_hfs_loss_with_the_aux_loss_per_micro_batch(model_name):
    loss, model, ids = _first_step(model_name, grad_accum=2)
    experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
    assert experts.gate_up_proj.shape[0] == 4 and model.config.num_experts_per_tok == 2
    with torch.no_grad():
        halves = [_hf_loss(model, ids[i:i + 2]) for i in (0, 2)]
        want = sum(h[0] for h in halves).item() / 2
        lm_only = sum(h[1] for h in halves).item() / 2
        whole = _hf_loss(model, ids)[0].item()
    assert abs(loss - want) / want < 1e-6, (loss, want)
    # the aux loss is in it (not only the LM loss), per half: not the whole batch's statistics
    assert abs(loss - lm_only) > 1e-4 and abs(whole - want) > 1e-6, (loss, lm_only, whole)
