"""Single-process references the runtime tests compare against (one copy for every test file)."""

from __future__ import annotations

import torch

STEPS = 5
LR = 1e-3


def reference_losses(model, batches, *, grad_accum=1, grad_clip=None, loss_fn=None):
    """Single-process AdamW training on the same global batches (the accumulation split too)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        opt.zero_grad()
        total = 0.0
        n = batch["input_ids"].shape[0] // grad_accum
        for i in range(grad_accum):
            part = {k: v[i * n:(i + 1) * n] for k, v in batch.items()}
            out = model(**part)
            loss = loss_fn(out, part) if loss_fn else out.loss
            (loss / grad_accum).backward()
            total += loss.item() / grad_accum
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(total)
    return losses


def hidden_loss(hidden: torch.Tensor) -> torch.Tensor:
    """A loss on an encoder's last hidden state (tests' BERT is a `BertModel`, no head) whose
    gradient reaches every layer. `hidden.pow(2).mean()` does not: after BERT's final LayerNorm
    at its initial weight 1 and bias 0 it is 1 for any input, so every gradient upstream of that
    norm is roundoff (2e-8 against 0.9 here), and AdamW's first step turns roundoff signs into
    full-size updates: multi-step comparisons then compare roundoff, and pass or fail by the
    order of summation."""
    target = torch.linspace(-1, 1, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)
    return (hidden - target).pow(2).mean()


def make_batches(batch=8, seq=16, seed=10):
    import models

    # one batch repeated, so the loss must fall; a second seed adds a different batch
    ids = models.ids(batch=batch, seq=seq, seed=seed)
    other = models.ids(batch=batch, seq=seq, seed=seed + 1)
    return [{"input_ids": x, "labels": x} for x in (ids, other, ids, other, ids)][:STEPS]


def runnable_schedules(cases: list[tuple]) -> list[tuple]:
    """The (schedule name, ...) cases this torch trains: the zero-bubble schedules are refused
    before torch 2.13 (its split backward double-counts a weight used twice on one path,
    pytorch issue 180952; `tests/test_pipeline_runtime.py` checks the refusal)."""
    from slapo.runtime.split_backward import SPLIT_BACKWARD, split_backward_is_exact

    exact = split_backward_is_exact()
    return [c for c in cases if exact or c[0] not in SPLIT_BACKWARD]
