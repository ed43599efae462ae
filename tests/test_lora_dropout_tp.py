"""LoRA dropout under tensor parallelism equals PEFT's LoRA on one process with the same masks.

The rule (`model_schedule/lora.py`): a column LoRA's input is whole on every rank, so its
dropout draws one mask for all ranks (the shared stream, also inside a per-rank region such as
LLaMA's `self_attn`); a row LoRA's input holds this rank's features, so its dropout draws the
rank's own mask (the per-rank stream). Then tp=2 computes exactly what one process computes
with the mask that is the concatenation of the ranks' masks.

The check, per family and knob set, on 2 gloo ranks in float64 with dropout 0.5 on every
adapter: record each adapter dropout's mask on every rank during the first training step;
column masks must be identical on both ranks and row masks must differ; then PEFT's model on
one process, its dropouts replaced by those recorded masks (a row mask: the ranks' masks
concatenated along the features), gives the same loss and every adapter gradient. With
checkpointed layers the recomputation must redraw the same masks (its gradients are compared
to the same reference). Mutations: the column dropout left in the per-rank stream, and the row
dropout in the shared one, must fail.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn

pytest.importorskip("peft")

P = 0.5
TOL = 1e-9  # float64: the same masks, only the summation order differs


class _FixedMask(nn.Module):
    """A dropout whose mask is given (one process's reference)."""

    def __init__(self, mask: torch.Tensor, p: float):
        super().__init__()
        self.mask, self.p = mask, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask.to(x.dtype) / (1 - self.p)


def _dropout_paths(model: nn.Module) -> dict[str, nn.Module]:
    """Every adapter dropout of a PEFT model, by its path without PEFT's prefix."""
    return {n.removeprefix("base_model.model."): m for n, m in model.named_modules()
            if n.endswith("lora_dropout.default")}


def _record_masks(model: nn.Module) -> tuple[dict, list]:
    """Forward hooks keeping the first mask each adapter dropout draws (the input is never
    exactly 0, so output != 0 is the mask)."""
    masks: dict[str, torch.Tensor] = {}

    def hook(name):
        def keep(mod, args, out):
            masks.setdefault(name, (out != 0).detach().clone())
        return keep

    handles = [m.register_forward_hook(hook(n)) for n, m in _dropout_paths(model).items()]
    return masks, handles


def _layouts(model: nn.Module) -> dict[str, str]:
    """'column' or 'row' per adapter dropout: the layer's kernel says which (`lora_row`)."""
    from slapo import module_patch

    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "lora_dropout") and "default" in mod.lora_dropout:
            row = getattr(module_patch.kernel(mod), "name", None) == "lora_row"
            out[name.removeprefix("base_model.model.") + ".lora_dropout.default"] = \
                "row" if row else "column"
    return out


@contextmanager
def _mutated(kind: str | None):
    """Break the stream rule: 'column' (its dropout per rank) or 'row' (shared)."""
    from slapo.model_schedule import lora

    if kind is None:
        yield
        return
    orig = lora._dropouts

    def swapped(node):
        return [_Swap(d, kind) for d in orig(node)]

    lora._dropouts = swapped
    try:
        yield
    finally:
        lora._dropouts = orig


class _Swap:
    """A dropout node whose `fork_rng` stream is the wrong one for `kind` layers."""

    def __init__(self, node, kind: str):
        self.node, self.kind = node, kind

    def fork_rng(self, draws: str, stream: str = "tp"):
        layout = "column" if stream == "shared" else "row"
        if layout == self.kind:
            stream = "tp" if stream == "shared" else "shared"
        return self.node.fork_rng(draws=draws, stream=stream)


def job_dropout_equals_peft_with_the_same_masks(cases: list, mutate: str | None = None) -> dict:
    import torch.distributed as dist
    from test_lora import _batch, _full, _rel, peft_model

    import slapo
    from slapo.model_schedule import apply

    out = {}
    for family, knobs in cases:
        slapo.set_random_seed(7, tp_rank=dist.get_rank())
        pm = peft_model(family, torch.float64, lora_dropout=P)
        ref = copy.deepcopy(pm)
        sch = slapo.create_schedule(pm)
        with _mutated(mutate):
            apply(sch, **knobs)
        model, _ = slapo.build(sch, optimizer=torch.optim.AdamW)
        masks, handles = _record_masks(model)
        layouts = _layouts(model)
        batch = _batch(family)
        model.train()
        loss = model(**batch).loss
        loss.backward()
        for h in handles:
            h.remove()
        grads = {n: _full(p.grad, p) for n, p in model.named_parameters() if p.requires_grad}

        # every rank's masks, to build one process's
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v for k, v in masks.items()})
        same = {k: all(torch.equal(g[k], gathered[0][k]) for g in gathered) for k in masks}
        full = {k: gathered[0][k] if layouts[k] == "column" else
                torch.cat([g[k] for g in gathered], dim=-1) for k in masks}

        for name in _dropout_paths(ref):
            parent, _, leaf = name.rpartition(".")
            owner = ref.get_submodule("base_model.model." + parent)
            owner[leaf] = _FixedMask(full[name], P)
        ref.train()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        out[(family, tuple(sorted(knobs)))] = {
            "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad": max(_rel(grads[n], g) for n, g in ref_grads.items()),
            "column_same": all(same[k] for k in masks if layouts[k] == "column"),
            "row_differ": all(not same[k] for k in masks if layouts[k] == "row"),
            "n_column": sum(v == "column" for v in layouts.values()),
            "n_row": sum(v == "row" for v in layouts.values()),
        }
    return out


CASES = [("llama", {}), ("gpt2", {}), ("qwen3", {}), ("mistral", {}), ("opt", {}),
         ("gpt_neo", {}), ("t5", {}), ("llama", {"ckpt_ratio": 1.0}),
         ("gpt2", {"sequence_parallel": True, "ckpt_ratio": 1.0}),
         ("llama", {"ckpt_ratio": 1.0, "ckpt_policy": "selective"})]


@pytest.mark.dist
def test_lora_dropout_under_tp2_equals_peft_with_the_same_masks(dist2):
    for res in dist2.run(job_dropout_equals_peft_with_the_same_masks, CASES, timeout=600):
        for case, r in res.items():
            assert r["n_column"] and r["n_row"], (case, r)
            assert r["column_same"] and r["row_differ"], (case, r)
            assert r["loss"] < TOL and r["grad"] < TOL, (case, r)


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["column", "row"])
def test_a_dropout_in_the_wrong_stream_fails(dist2, kind):
    res = dist2.run(job_dropout_equals_peft_with_the_same_masks, [("llama", {})], kind)
    r = res[0][("llama", ())]
    if kind == "column":  # per-rank masks on a whole input: the ranks disagree
        assert not r["column_same"] and r["grad"] > 1e-3, r
    else:  # one mask for every rank's features: the ranks agree where they must not
        assert not r["row_differ"], r


def test_the_shared_stream_inside_a_fork_is_the_default_stream():
    """`shared()` inside a fork draws what the default stream would draw next, the fork's
    stream continues where it was, and a nested fork of the live stream does not restart it
    (which would draw the same numbers twice)."""
    from slapo.distributed.rng import RNGStatesTracker

    t = RNGStatesTracker()
    t.add("tp", 5)

    def draws(plan):
        torch.manual_seed(0)
        t._states.clear()
        t.add("tp", 5)
        return plan()

    # reference streams, drawn plainly
    torch.manual_seed(0)
    d1, d2 = torch.rand(3), torch.rand(3)
    torch.manual_seed(5)
    s1, s2, s3 = torch.rand(3), torch.rand(3), torch.rand(3)

    def plan():
        with t.fork("tp"):
            a = torch.rand(3)  # tp 1
            with t.shared():
                b = torch.rand(3)  # default 1
                with t.fork("tp"):
                    c = torch.rand(3)  # tp 2
            with t.fork("tp"):  # already live: continues
                d = torch.rand(3)  # tp 3
        e = torch.rand(3)  # default 2: shared() advanced it
        return a, b, c, d, e

    a, b, c, d, e = draws(plan)
    assert torch.equal(a, s1) and torch.equal(c, s2) and torch.equal(d, s3)
    assert torch.equal(b, d1) and torch.equal(e, d2)
    assert t.live() is None and not t._active
    torch.manual_seed(0)
    with t.shared():  # outside any fork: the default stream, nothing swapped
        assert torch.equal(torch.rand(3), d1)
