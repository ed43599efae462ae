"""Delayed init that never holds a whole sharded tensor (issue 15, item 7).

A TP rank allocates and initialises only its shard during a delayed `build`; the shards merged
across ranks equal the unsharded delayed build bit for bit, for any TP degree and rank, and every
tensor still gets its module's own init. Single-process checks play each rank on a
`VirtualGroup` and call `slapo.init.materialize` (what `build` calls); one gloo job runs the real
`slapo.build` on two ranks.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter

import models
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import slapo
from slapo import sharding
from slapo.distributed.group import VirtualGroup
from slapo.init import InitFallbackWarning, materialize, reset_init_warnings

FAMILIES = ["gpt2", "llama", "bert", "t5"]
ALL_FAMILIES = ["gpt2", "gpt_neo", "llama", "bert", "roberta", "opt", "t5", "albert"]
SEED = 7


class Allocations(TorchDispatchMode):
    """Counts the shapes of the real (non-meta) tensors created while active: every output
    that the op's schema says is fresh (no alias of an input), so views and in-place results
    do not count."""

    def __init__(self):
        super().__init__()
        self.shapes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        for value, ret in zip(outs, func._schema.returns):
            if ret.alias_info is None and isinstance(value, torch.Tensor) \
                    and value.device.type != "meta":
                self.shapes[tuple(value.shape)] += 1
        return out


def _llama4(seed: int = 0):
    """LLaMA with 4 KV heads, so it also splits over 4 ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


def _meta(family: str) -> nn.Module:
    with slapo.init_empty_weights():
        return _llama4() if family == "llama" else getattr(models, family)(seed=0)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Name -> tensor (not detached: a detached tensor loses its shard spec)."""
    return dict([*model.named_parameters(), *model.named_buffers()])


def _shard_all_ranks(family: str, tp: int, alloc: Allocations | None = None) -> list[dict]:
    """Each rank's materialised tensors under the family's ready TP schedule."""
    out = []
    for rank in range(tp):
        model = _meta(family)
        slapo.model_schedule.apply(model, tp=tp, group=VirtualGroup(tp, rank))
        if alloc is not None and rank == 0:
            with alloc:
                materialize(model, "cpu", seed=SEED)
        else:
            materialize(model, "cpu", seed=SEED)
        out.append(_tensors(model))
    return out


def _merged(shards: list[dict], name: str) -> torch.Tensor:
    spec = sharding.shard_spec(shards[0][name])
    if spec is None:
        return shards[0][name].detach()
    return sharding.assemble([s[name].detach() for s in shards], spec.axis, spec.blocks)


def _shapes(tensors: dict) -> tuple[Counter, Counter, Counter]:
    """(full shapes of sharded tensors, their local shapes, shapes of unsharded tensors),
    each tensor counted once."""
    full, local, whole = Counter(), Counter(), Counter()
    for t in {id(t): t for t in tensors.values()}.values():
        spec = sharding.shard_spec(t)
        if spec is None:
            whole[tuple(t.shape)] += 1
        else:
            full[tuple(spec.orig_shape)] += 1
            local[tuple(t.shape)] += 1
    return full, local, whole


# --------------------------------------------------------------------------- (b), (c): values
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_shards_equal_unsharded_build_for_tp2_and_tp4(family):
    ref = materialize(_meta(family), "cpu", seed=SEED)
    want = _tensors(ref)
    for tp in (2, 4):
        shards = _shard_all_ranks(family, tp)
        n_sharded = 0
        for name, value in want.items():
            n_sharded += sharding.shard_spec(shards[0][name]) is not None
            for rank, s in enumerate(shards):  # every rank's piece is the slice of the same values
                spec = sharding.shard_spec(s[name])
                piece = value if spec is None else sharding.local_slice(
                    value, spec.axis, spec.world_size, spec.rank, spec.blocks)
                assert spec is None or spec.rank == rank
                assert torch.equal(s[name].detach(), piece.detach()), (family, tp, rank, name)
            assert torch.equal(_merged(shards, name), value.detach()), (family, tp, name)
        assert n_sharded >= 8, (family, tp, n_sharded)


# --------------------------------------------------------------------- (a): allocations
def _assert_no_full_shape_allocated(tp1: Counter, tp2: Counter, tensors: dict) -> None:
    """Each sharded tensor of full shape S removes one allocation of S.

    Shapes coincide in small models (a shard of a 128x64 weight is 64x64, the full shape of
    an attention projection), so the check counts: the tp=1 build allocates S once per tensor
    of shape S, plus whatever the inits allocate themselves and the random-block buffers (which
    only shrink under sharding); the tp=2 build may allocate S once per unsharded tensor of
    shape S and once per shard whose local shape is S, never for a sharded tensor's full
    shape. Allocating the full tensor first (then slicing) breaks the bound by `full[S]`."""
    full, local, _ = _shapes(tensors)
    for shape, k in full.items():
        bound = tp1[shape] - k + local[shape]
        assert tp2[shape] <= bound, (shape, tp1[shape], tp2[shape], k, local[shape])


@pytest.mark.parametrize("family", FAMILIES)
def test_no_tensor_of_a_sharded_full_shape_is_allocated(family):
    tp1 = Allocations()
    with tp1:
        materialize(_meta(family), "cpu", seed=SEED)
    tp2 = Allocations()
    shards = _shard_all_ranks(family, 2, tp2)
    _assert_no_full_shape_allocated(tp1.shapes, tp2.shapes, shards[0])
    # the largest sharded tensor (the vocabulary) has a shape no other tensor or shard has
    full, local, whole = _shapes(shards[0])
    biggest = max(full, key=math.prod)
    assert biggest not in local and biggest not in whole, biggest
    assert tp2.shapes[biggest] == 0 < tp1.shapes[biggest], (biggest, tp2.shapes[biggest])


# ------------------------------------------------------------------- (d): the model's own init
@pytest.mark.parametrize("family", FAMILIES)
def test_init_is_the_models_own(family):
    """Each merged tensor has the eager `Model(config)`'s deterministic parts exactly and its
    random tensors' std within 10% (parents' writes included: GPT-2's scaled `c_proj`, T5's
    per-projection stds; tests/test_init_parent_order.py checks them by name)."""
    shards = _shard_all_ranks(family, 2)
    model = _meta(family)
    eager = _tensors(getattr(models, family)(seed=0) if family != "llama" else _llama4())
    checked = Counter()
    for name, want in eager.items():
        ours, want = _merged(shards, name), want.detach()
        if not want.is_floating_point() or (want == want.flatten()[0]).all():
            assert torch.equal(ours, want), name  # zero biases, ones in norms, position ids
            checked["exact"] += 1
            continue
        if name.endswith("inv_freq"):  # rotary buffers: a deterministic function of config
            assert torch.equal(ours, want), name
            continue
        pad = getattr(_owner(model, name), "padding_idx", None)
        if pad is not None:
            assert not ours[pad].any() and not want[pad].any(), name
            ours, want = (torch.cat([t[:pad], t[pad + 1:]]) for t in (ours, want))
            checked["padding"] += 1
        if ours.numel() >= 2048:
            std = want.float().std().item()
            assert abs(ours.float().std().item() / std - 1) < 0.1, (name, ours.std(), std)
            assert abs(ours.float().mean().item()) < 0.1 * std, name
            checked["normal"] += 1
    assert checked["exact"] >= 4 and checked["normal"] >= 8, checked
    if family in ("llama", "bert"):
        assert checked["padding"] == 1, checked


def _owner(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name.rpartition(".")[0])


# -------------------------------------------------------------- fallback hit by no HF family
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_no_hf_family_falls_back_to_full_size(family):
    reset_init_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rank in range(2):
            with slapo.init_empty_weights():
                model = getattr(models, family)(seed=0)
            slapo.model_schedule.apply(model, tp=2, group=VirtualGroup(2, rank))
            materialize(model, "cpu", seed=SEED)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, InitFallbackWarning)]
    assert not fallbacks, fallbacks


# ----------------------------------------------- torch.nn.init functions and view writes
class Toy(nn.Module):
    """Layers whose inits exercise each kind of recorded op (sharded in `_toy`)."""

    def __init__(self):
        super().__init__()
        self.kaiming = nn.Linear(24, 40)           # reset_parameters: kaiming_uniform_ + uniform_
        self.trunc = nn.Linear(24, 40, bias=False)
        self.xavier = nn.Linear(24, 36)
        self.emb = nn.Embedding(48, 12, padding_idx=5)
        self.register_buffer("table", torch.empty(36, 8))


def toy_init(mod: nn.Module, path: str) -> None:
    if path == "trunc":  # the inverse-CDF truncated normal (torch <= 2.11's trunc_normal_)
        lo, hi = (1 + math.erf(-0.6 / 0.5 / math.sqrt(2))) / 2, (1 + math.erf(0.6 / 0.5 / 2**0.5)) / 2
        mod.weight.uniform_(2 * lo - 1, 2 * hi - 1).erfinv_().mul_(0.5 * math.sqrt(2))
        mod.weight.add_(0.0).clamp_(min=-0.6, max=0.6)
        mod.weight[:, 3].fill_(2.0)                        # a column, through a view
        mod.weight.index_fill_(0, torch.tensor([1, 38]), -1.0)
    elif path == "xavier":
        nn.init.xavier_normal_(mod.weight, gain=2.0)
        mod.bias.copy_(torch.arange(36.0))                 # a constant source, cut to the shard
        mod.weight.t()[2].mul_(0.0)                        # column 2, through a transpose
    elif path == "emb":
        nn.init.normal_(mod.weight, std=0.3)
        mod.weight[mod.padding_idx].zero_()
    elif path == "":
        mod.table.copy_(torch.arange(36 * 8.0).view(36, 8))
        mod.table[1::3, ::2].neg_()                        # a strided box
        mod.table.view(-1).add_(0.5)                       # the whole tensor, reshaped
    elif hasattr(mod, "reset_parameters"):
        mod.reset_parameters()


def _toy(group=None, shard: bool = True) -> nn.Module:
    with slapo.init_empty_weights():
        model = Toy()
    sch = slapo.create_schedule(model, group=group)
    if shard:
        sch["kaiming"].shard("weight", axis=0)
        sch["kaiming"].shard("bias", axis=0)
        sch["trunc"].shard("weight", axis=1)
        sch["xavier"].shard("weight", axis=0, blocks=3)   # fused q|k|v layout
        sch["xavier"].shard("bias", axis=0, blocks=3)
        sch["emb"].shard("weight", axis=0)
    return model


@pytest.mark.parametrize("tp", [2, 4])
def test_nn_init_functions_and_view_writes_replay_exactly(tp):
    with warnings.catch_warnings():
        warnings.simplefilter("error", InitFallbackWarning)
        reset_init_warnings()
        ref = _tensors(materialize(_toy(shard=False), "cpu", init_fn=toy_init, seed=SEED))
        shards = [_tensors(materialize(_toy(VirtualGroup(tp, r)), "cpu", init_fn=toy_init,
                                       seed=SEED)) for r in range(tp)]
    ref = {n: t.detach() for n, t in ref.items()}
    for name, want in ref.items():
        assert torch.equal(_merged(shards, name), want), name
    w = ref["trunc.weight"]
    assert (w[2:38, 3] == 2).all() and (w[[1, 38]] == -1).all()
    rest = torch.cat([w[2:38, :3], w[2:38, 4:]], 1)
    assert rest.abs().max() <= 0.6 and rest.std() > 0.25
    bound = 1 / math.sqrt(24)  # Linear.reset_parameters: kaiming_uniform_(a=sqrt(5))
    assert ref["kaiming.weight"].abs().max() <= bound and ref["kaiming.weight"].std() > bound / 2
    assert torch.equal(ref["xavier.bias"], torch.arange(36.0))
    assert not ref["xavier.weight"][:, 2].any()
    assert not ref["emb.weight"][5].any()
    table = torch.arange(36 * 8.0).view(36, 8)
    table[1::3, ::2].neg_()
    assert torch.equal(ref["table"], table + 0.5)


def fragile_init(mod: nn.Module, path: str) -> None:
    """`orthogonal_` computes from a second tensor: the recorder cannot replay it; torch 2.13's
    `trunc_normal_` samples by rejection (data-dependent), torch 2.11's by inverse CDF
    (replayed): exact either way."""
    if path == "kaiming":
        nn.init.orthogonal_(mod.weight)
        nn.init.zeros_(mod.bias)
    elif path == "trunc":
        nn.init.trunc_normal_(mod.weight, std=0.5, a=-0.6, b=0.6)
    elif hasattr(mod, "reset_parameters"):
        mod.reset_parameters()


def test_unreplayable_init_falls_back_for_that_tensor_only_with_a_warning():
    reset_init_warnings()
    with pytest.warns(InitFallbackWarning):
        ref = _tensors(materialize(_toy(shard=False), "cpu", init_fn=fragile_init, seed=SEED))
    reset_init_warnings()  # the unsharded build fell back too (same values): warn again
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shards = [_tensors(materialize(_toy(VirtualGroup(2, r)), "cpu", init_fn=fragile_init,
                                       seed=SEED)) for r in range(2)]
    named = [str(w.message) for w in caught if issubclass(w.category, InitFallbackWarning)]
    assert any(re.search(r"kaiming\.weight \(40, 24\).*another tensor", m) for m in named), named
    assert not any("emb.weight" in m or "xavier" in m for m in named), named  # only those
    assert len([m for m in named if "kaiming.weight" in m]) == 1, named  # once, not per rank
    for name, want in ref.items():
        assert torch.equal(_merged(shards, name), want.detach()), name
    w = ref["kaiming.weight"].detach()
    torch.testing.assert_close(w.T @ w, torch.eye(24), atol=1e-5, rtol=0)  # still orthogonal
    assert not ref["kaiming.bias"].any()
    t = ref["trunc.weight"].detach()
    assert t.abs().max() <= 0.6 and t.std() > 0.25


# ------------------------------------------------------------- two gloo ranks, real build
def job_build_sharded_init():
    """Per family: the real `slapo.build` of the ready tp=2 schedule allocates no full-shape
    copy of a sharded tensor, and its gathered shards equal the tp=1 delayed build."""
    out = {}
    for family in FAMILIES:
        with slapo.init_empty_weights():
            meta = getattr(models, family)(seed=0)
        sch = slapo.model_schedule.apply(meta, tp=2)
        tp2 = Allocations()
        with tp2:
            model, _ = slapo.build(sch, seed=SEED, device="cpu")
        with slapo.init_empty_weights():
            meta1 = getattr(models, family)(seed=0)
        tp1 = Allocations()
        with tp1:
            ref, _ = slapo.build(slapo.create_schedule(meta1), seed=SEED, device="cpu")
        mine = _tensors(model)
        _assert_no_full_shape_allocated(tp1.shapes, tp2.shapes, mine)
        want = _tensors(ref)
        for name, t in mine.items():
            assert torch.equal(sharding.gather_full(t), want[name].detach()), (family, name)
        out[family] = sum(sharding.shard_spec(t) is not None for t in mine.values())
    return out


def test_real_build_on_two_ranks(dist2):
    res = dist2.run(job_build_sharded_init, timeout=300)
    assert res[0] == res[1] and all(n >= 8 for n in res[0].values()), res


def test_materialised_weights_are_never_touched():
    """A weight loaded while its module's bias is still meta keeps its values (the init runs
    with a stand-in in its slot); the bias gets its init."""
    model = _toy(shard=False)
    loaded = nn.Parameter(torch.ones(40, 24))
    model.kaiming.weight = loaded
    materialize(model, "cpu", seed=SEED)
    assert model.kaiming.weight is loaded and torch.equal(loaded, torch.ones(40, 24))
    bias = model.kaiming.bias.detach()
    assert bias.abs().max() <= 1 / math.sqrt(24) and bias.std() > 0


def test_inplace_rule_without_the_tag_agrees_with_the_tag(monkeypatch):
    """torch 2.11 has no `Tag.inplace`; the schema rule that replaces it there names the same
    aten ops as the tag does here, but for a few untagged overloads no init writes with."""
    from slapo.init import record

    aten = torch.ops.aten
    packets = [getattr(aten, n) for n in dir(aten)]
    ops = [getattr(p, o) for p in packets if hasattr(p, "overloads") for o in p.overloads()]
    tagged = {f for f in ops if record._inplace(f)}
    monkeypatch.delattr(torch.Tag, "inplace", raising=False)
    assert not hasattr(torch.Tag, "inplace")
    by_schema = {f for f in ops if record._inplace(f)}
    assert len(tagged) > 300 and aten.normal_.default in by_schema
    assert tagged <= by_schema
    assert {str(f) for f in by_schema - tagged} <= {
        "aten.add_.t", "aten.mul_.t", "aten.copy_.Tensor", "aten.copy_.int",
        "aten.copy_.float", "aten.index_put_.hacked_twin", "aten._index_put_impl_.hacked_twin"}
