"""Delayed init applies a parent module's init of its children's tensors (silent-wrong fix).

Hugging Face runs `_init_weights` over `model.modules()` children first, parent last, and some
parents write their children's tensors: GPT-2's attention/MLP rescale `c_proj.weight` by
1/sqrt(2 * n_layer), T5's attention and feed-forward set each projection's std from the config,
T5's root re-draws the shared embedding. A delayed build used to drop those writes (the child's
tensor was still meta when the parent's init ran): T5's projections came out with std 1.0
instead of ~0.03. Here every family's delayed build is compared with an eager `Model(config)`:
deterministic parts exactly, random tensors' std within 15%; the named parent cases are checked
against the config's formulas; TP shards and pipeline stages against the tp=1/pp=1 build.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import models
import pytest
import torch
import torch.nn as nn
import vision_models

import slapo
from slapo import sharding
from slapo.distributed.group import VirtualGroup
from slapo.init import InitFallbackWarning, materialize, reset_init_warnings

SEED = 11


def mistral(seed: int = 0, layers: int = 2):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(
        hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0))


def llama_tied(seed: int = 0, layers: int = 2):
    """LLaMA with its LM head tied to an embedding that has a padding row."""
    return models.llama(seed=seed, layers=layers, tie_word_embeddings=True)


BUILDERS = {"gpt2": models.gpt2, "gpt_neo": models.gpt_neo, "opt": models.opt,
            "llama": models.llama, "llama_tied": llama_tied, "mistral": mistral,
            "bert": models.bert_mlm, "roberta": models.roberta, "t5": models.t5,
            "t5_gated": models.t5_gated, "albert": models.albert}


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict([*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)])


def _tie_groups(model: nn.Module) -> set[frozenset[str]]:
    """Names sharing one tensor (tied weights), as sets of two or more."""
    groups: dict[int, set[str]] = {}
    for name, t in _tensors(model).items():
        groups.setdefault(id(t), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}


def _delayed(build, **kw) -> nn.Module:
    """The real `slapo.build` of a meta model (what `slapo train --model config.json` does)."""
    with slapo.init_empty_weights():
        meta = build(seed=0, **kw)
    model, _ = slapo.build(slapo.create_schedule(meta), seed=SEED, device="cpu")
    return model


def _std_tolerance(n: int) -> float | None:
    """Relative std tolerance at `n` elements (None: too few to say): ~5 standard errors of
    the two std estimates, far below the 2x-30x errors of a dropped parent init."""
    return 0.15 if n >= 1024 else 0.4 if n >= 96 else None


def _compare(name: str, ours: torch.Tensor, want: torch.Tensor, counts: Counter) -> None:
    """Deterministic tensors equal, random ones alike: same zero pattern (padding rows),
    std within `_std_tolerance`, mean near 0 where the eager one is."""
    ours, want = ours.detach(), want.detach()
    assert ours.shape == want.shape and ours.dtype == want.dtype, name
    if not want.is_floating_point() or want.numel() < 2 or (want == want.flatten()[0]).all():
        assert torch.equal(ours, want), name
        counts["exact"] += 1
        return
    zeros = want == 0
    if zeros.any():  # a padding row, or a deterministic buffer (a causal mask, inv_freq)
        assert torch.equal(ours == 0, zeros), name
    rest_o, rest_w = ours[~zeros].double(), want[~zeros].double()
    tol = _std_tolerance(rest_w.numel())
    if rest_w.std() == 0 or tol is None:
        assert torch.equal(ours, want) or tol is None, name
        counts["exact" if tol else "small"] += 1
        return
    std_o, std_w = rest_o.std().item(), rest_w.std().item()
    assert abs(std_o / std_w - 1) < tol, (name, std_o, std_w)
    if abs(rest_w.mean()) < 3 * std_w / math.sqrt(rest_w.numel()):
        assert abs(rest_o.mean()) < 6 * std_w / math.sqrt(rest_w.numel()), name
    counts["random"] += 1


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_delayed_build_has_the_eager_models_init(family):
    eager = BUILDERS[family](seed=0)
    model = _delayed(BUILDERS[family])
    want, ours = _tensors(eager), _tensors(model)
    assert set(ours) == set(want)
    assert _tie_groups(model) == _tie_groups(eager)  # tied weights stay tied
    counts: Counter = Counter()
    for name, w in want.items():
        _compare(name, ours[name], w, counts)
    assert counts["random"] >= 8 and counts["exact"] >= 2, counts


def _gpt2_block_stds(model: nn.Module, layers: int) -> None:
    scaled = 0.02 / math.sqrt(2 * layers)  # GPT2Attention / GPT2MLP rescale their c_proj
    for block in model.transformer.h:
        for m, std in ((block.attn.c_attn, 0.02), (block.attn.c_proj, scaled),
                       (block.mlp.c_fc, 0.02), (block.mlp.c_proj, scaled)):
            assert abs(m.weight.detach().std().item() / std - 1) < 0.15, (m, std)


def _t5_stds(model: nn.Module) -> dict[str, float]:
    """Name -> the std `T5PreTrainedModel._init_weights` sets from a parent's init."""
    c = model.config
    f = c.initializer_factor
    attn = {"q": (c.d_model * c.d_kv) ** -0.5, "k": c.d_model ** -0.5, "v": c.d_model ** -0.5,
            "o": (c.num_heads * c.d_kv) ** -0.5, "relative_attention_bias": c.d_model ** -0.5}
    ff = {"wi": c.d_model ** -0.5, "wi_0": c.d_model ** -0.5, "wi_1": c.d_model ** -0.5,
          "wo": c.d_ff ** -0.5}
    out = {"shared.weight": f * 1.0}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = f * 1.0  # written by the root T5ForConditionalGeneration
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if len(parts) > 2 and parts[-1] == "weight":
            table = attn if "Attention" in parts[-3] else ff if "Dense" in parts[-3] else {}
            if parts[-2] in table:
                out[name] = f * table[parts[-2]]
    return out


@pytest.mark.parametrize("family", ["t5", "t5_gated"])
def test_t5_parent_inits_set_each_projection_std(family):
    model = _delayed(BUILDERS[family])
    stds = _t5_stds(model)
    assert sum(".q.weight" in n for n in stds) == 6 and sum(".wo." in n for n in stds) == 4
    params = dict(model.named_parameters())
    for name, std in stds.items():
        got = params[name].detach().std().item()
        tol = _std_tolerance(params[name].numel())
        assert abs(got / std - 1) < tol, (name, got, std)


def test_gpt2_residual_projections_are_scaled_by_depth():
    _gpt2_block_stds(_delayed(models.gpt2, layers=4), layers=4)


def _shards(family: str, tp: int) -> list[dict]:
    out = []
    for rank in range(tp):
        with slapo.init_empty_weights():
            model = BUILDERS[family](seed=0)
        slapo.model_schedule.apply(model, tp=tp, group=VirtualGroup(tp, rank))
        out.append(_tensors(materialize(model, "cpu", seed=SEED)))
    return out


@pytest.mark.parametrize("family", ["t5_gated", "gpt2"])
def test_tp2_shards_with_parent_inits_merge_to_the_tp1_build(family):
    with slapo.init_empty_weights():
        ref = BUILDERS[family](seed=0)
    materialize(ref, "cpu", seed=SEED)
    shards = _shards(family, 2)
    n_sharded = 0
    for name, want in _tensors(ref).items():
        spec = sharding.shard_spec(shards[0][name])
        n_sharded += spec is not None
        got = shards[0][name].detach() if spec is None else sharding.assemble(
            [s[name].detach() for s in shards], spec.axis, spec.blocks)
        assert torch.equal(got, want.detach()), name
    assert n_sharded >= 8
    if family == "gpt2":
        _gpt2_block_stds(ref, layers=2)
    else:
        params = dict(ref.named_parameters())
        for name, std in _t5_stds(ref).items():
            assert abs(params[name].std().item() / std - 1) < 0.4, name


# ------------------------------------------------------------------------------ pipelines
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pipeline_stage_gets_the_whole_models_values(family):
    """What `build` does on each pp rank (`_place_stage_weights`), for both stages of a pp=2
    cut: the stage's tensors equal the pp=1 delayed build's (parent writes, the tied LM head
    on the rank without the embedding), the other stage's stay on meta."""
    from slapo.runtime.build import _place_stage_weights

    with slapo.init_empty_weights():
        ref = BUILDERS[family](seed=0, layers=4)
    materialize(ref, "cpu", seed=SEED)
    want = _tensors(ref)
    layers = "transformer.h" if family == "gpt2" else "model.layers"
    for stage in range(2):
        with slapo.init_empty_weights():
            model = BUILDERS[family](seed=0, layers=4)
        sch = slapo.create_schedule(model)
        sch[f"{layers}.1"].cut_pipeline_stage()
        stages = slapo.pipeline.partition(sch)
        _place_stage_weights(sch, [stages[stage]], "cpu", None, None, SEED)
        held = dict([*stages[stage].named_parameters(), *stages[stage].named_buffers()])
        assert held and all(t.device.type == "cpu" for t in held.values())
        for name, t in held.items():
            assert torch.equal(t.detach(), want[name].detach()), (stage, name)
        other = model.get_submodule(layers)[3 if stage == 0 else 0]
        assert all(p.device.type == "meta" for p in other.parameters()), stage
    if family == "gpt2":
        _gpt2_block_stds(ref, layers=4)


# ----------------------------------------------------- the order rules, on plain modules
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 32)


def parent_init(mod: nn.Module, path: str) -> None:
    """Children fill constants, a block rescales its child's weight and replaces its bias,
    the root re-draws the head: post-order makes each parent's write land last."""
    if isinstance(mod, nn.Linear):
        mod.weight.fill_(1.0)
        mod.bias.fill_(2.0)
    elif isinstance(mod, nn.LayerNorm):
        mod.weight.fill_(3.0)
        mod.bias.zero_()
    elif isinstance(mod, Block):
        mod.fc.weight.mul_(0.5)                        # composes with the child's fill
        nn.init.normal_(mod.fc.bias, std=0.1)          # replaces the child's fill
        mod.norm.weight[:4].add_(1.0)
    elif path == "":
        nn.init.orthogonal_(mod.head.weight)           # unreplayable: the full-size fallback
        mod.head.weight.mul_(2.0)


def _net(group=None) -> nn.Module:
    with slapo.init_empty_weights():
        net = Net()
    sch = slapo.create_schedule(net, group=group)
    if group is not None:
        for i in range(2):
            sch[f"blocks.{i}.fc"].shard("weight", axis=0)
            sch[f"blocks.{i}.fc"].shard("bias", axis=0)
        sch["head"].shard("weight", axis=1)
    return net


def test_parent_writes_compose_in_post_order_and_shard_exactly():
    calls = []
    reset_init_warnings()
    with pytest.warns(InitFallbackWarning, match=r"head\.weight"):
        ref = materialize(_net(), "cpu", seed=SEED,
                          init_fn=lambda m, p: (calls.append(p), parent_init(m, p)))
    assert calls == ["blocks.0.fc", "blocks.0.norm", "blocks.0", "blocks.1.fc",
                     "blocks.1.norm", "blocks.1", "blocks", "head", "",
                     "head", ""]  # the fallback reruns head.weight's owner and ancestors
    for block in ref.blocks:
        assert (block.fc.weight == 0.5).all()
        assert 0.05 < block.fc.bias.std() < 0.2 and (block.fc.bias != 2.0).all()
        assert (block.norm.weight[:4] == 4.0).all() and (block.norm.weight[4:] == 3.0).all()
    w = ref.head.weight.detach()
    torch.testing.assert_close(w.T @ w, 4 * torch.eye(8), atol=1e-5, rtol=0)  # orthogonal, x2
    assert (ref.head.bias == 2.0).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InitFallbackWarning)
        shards = [_tensors(materialize(_net(VirtualGroup(2, r)), "cpu", seed=SEED,
                                       init_fn=parent_init)) for r in range(2)]
    for name, value in _tensors(ref).items():
        spec = sharding.shard_spec(shards[0][name])
        got = shards[0][name].detach() if spec is None else sharding.assemble(
            [s[name].detach() for s in shards], spec.axis, spec.blocks)
        assert torch.equal(got, value.detach()), name


def test_a_parent_never_touches_materialised_child_weights():
    net = _net()
    loaded = nn.Parameter(torch.full((32, 16), 7.0))
    net.blocks[0].fc.weight = loaded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", InitFallbackWarning)
        materialize(net, "cpu", seed=SEED, init_fn=parent_init)
    assert net.blocks[0].fc.weight is loaded and (loaded == 7.0).all()  # no 0.5x from Block
    assert (net.blocks[1].fc.weight == 0.5).all()
    assert 0.05 < net.blocks[0].fc.bias.std() < 0.2


def test_wideresnet_root_init_through_init_weights():
    """The ResNet initialises its convolutions from the root, in its constructor (which on
    meta does nothing): `init_weights` calling the root's `_init` gets the eager statistics,
    because the root's init now runs last, over every child's stand-in."""
    def init(mod: nn.Module, path: str) -> None:
        if path == "":
            mod._init()
        elif hasattr(mod, "reset_parameters"):
            mod.reset_parameters()

    eager = vision_models.tiny(seed=0)
    with slapo.init_empty_weights():
        meta = vision_models.tiny(seed=0)
    model, _ = slapo.build(slapo.create_schedule(meta), seed=SEED, device="cpu",
                           init_weights=init)
    want, ours = _tensors(eager), _tensors(model)
    counts: Counter = Counter()
    for name, w in want.items():
        _compare(name, ours[name], w, counts)
    assert counts["random"] >= 8, counts


def test_materialize_inside_init_empty_weights_still_initialises():
    """The inits' own temporaries (LLaMA's rotary table) are made on the target device, not
    on the enclosing context's meta device (which used to force a fallback, then fail)."""
    want = _tensors(models.llama(seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", InitFallbackWarning)
        reset_init_warnings()
        with slapo.init_empty_weights():
            model = materialize(models.llama(seed=0), "cpu", seed=SEED)
    ours = _tensors(model)
    assert all(t.device.type == "cpu" for t in ours.values())
    assert torch.equal(ours["model.rotary_emb.inv_freq"], want["model.rotary_emb.inv_freq"])


def reading_init(mod: nn.Module, path: str) -> None:
    """The root reads a value in Python (impossible on a stand-in): every tensor below it
    takes the full-size path, where the same post-order reruns on real tensors."""
    if path:
        parent_init(mod, path)
    else:
        scale = 1.0 + float(mod.blocks[0].norm.weight[0])  # 4.0 + 1
        mod.blocks[1].fc.weight.mul_(scale)


def test_a_parent_init_that_raises_on_stand_ins_falls_back_for_its_subtree():
    reset_init_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = materialize(_net(), "cpu", seed=SEED, init_fn=reading_init)
        shards = [_tensors(materialize(_net(VirtualGroup(2, r)), "cpu", seed=SEED,
                                       init_fn=reading_init)) for r in range(2)]
    assert any("raised on stand-in" in str(w.message) for w in caught)
    assert (ref.blocks[1].fc.weight == 0.5 * 5.0).all() and (ref.blocks[0].fc.weight == 0.5).all()
    for name, value in _tensors(ref).items():
        spec = sharding.shard_spec(shards[0][name])
        got = shards[0][name].detach() if spec is None else sharding.assemble(
            [s[name].detach() for s in shards], spec.axis, spec.blocks)
        assert torch.equal(got, value.detach()), name
