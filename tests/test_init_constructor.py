"""Delayed init of a plain `nn.Module` gives the init its constructor wrote.

Under `init_empty_weights()` a constructor's init runs on meta tensors and computes nothing;
before `slapo.init.construct`, `materialize` then gave each module its `reset_parameters()`, so
a torchvision-style ResNet (Kaiming-normal fan-out convolutions) or a nanoGPT-style model (its
own `_init_weights` and scaled `c_proj`) trained from another init than its author's, silently.
Now the constructor's writes are recorded and replayed (sharded too).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import vision_models

import slapo
from slapo import sharding
from slapo.distributed.group import VirtualGroup
from slapo.init import InitFallbackWarning, materialize, reset_init_warnings


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.c_proj(torch.relu(self.c_fc(x)))


class NanoGPTish(nn.Module):
    """nanoGPT's init: `apply(_init_weights)` (normal 0.02, zero biases), then every
    `c_proj.weight` at 0.02 / sqrt(2 * n_layer), and a padding row written through a view."""

    def __init__(self, vocab: int = 96, d: int = 64, n_layer: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.head = nn.Linear(d, vocab, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        with torch.no_grad():
            self.wte.weight[0].zero_()

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.head(x)


def _delayed(make, **kw):
    with slapo.init_empty_weights():
        model = make(**kw)
    return model


def test_nanogpt_style_constructor_init_is_replayed():
    model = materialize(_delayed(NanoGPTish), seed=3)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        elif name.endswith("c_proj.weight"):
            assert p.std().item() == pytest.approx(0.02 / math.sqrt(6), rel=0.1), name
        else:
            assert p[1:].std().item() == pytest.approx(0.02, rel=0.1), name
    assert torch.equal(model.wte.weight[0], torch.zeros(64))  # the view write, exactly
    # what reset_parameters would have given instead (Kaiming-uniform Linear, N(0, 1) Embedding)
    assert model.wte.weight.std().item() < 0.05 and model.head.weight.std().item() < 0.03


def test_resnet_constructor_init_is_replayed_not_reset_parameters():
    torch.manual_seed(0)
    model = materialize(_delayed(vision_models.tiny), seed=0)
    conv = model.conv1.weight  # Kaiming-normal, fan_out, ReLU gain: sqrt(2 / (8 * 7 * 7))
    assert conv.std().item() == pytest.approx(math.sqrt(2 / (8 * 49)), rel=0.1)
    reset_std = 1 / math.sqrt(3 * 3 * 49)  # Conv2d.reset_parameters: Kaiming-uniform, a=sqrt(5)
    assert abs(conv.std().item() - reset_std) > 0.3 * reset_std
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            assert torch.equal(m.weight, torch.ones_like(m.weight))
            assert torch.equal(m.bias, torch.zeros_like(m.bias))
            assert torch.equal(m.running_var, torch.ones_like(m.running_var))


@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_constructor_init_merges_to_the_unsharded_one(tp):
    """Each TP rank replays only its shard; the shards merged equal the tp=1 delayed build bit
    for bit (the record travels with `shard`)."""
    whole = materialize(_delayed(NanoGPTish), seed=5)
    shards = []
    for rank in range(tp):
        model = _delayed(NanoGPTish)
        sch = slapo.create_schedule(model, group=VirtualGroup(tp, rank))
        for i in range(3):
            sch[f"h.{i}.c_fc"].shard(["weight", "bias"], axis=0)
            sch[f"h.{i}.c_proj"].shard("weight", axis=1)
        materialize(model, seed=5)
        shards.append(dict(model.named_parameters()))
    for name, ref in whole.named_parameters():
        spec = sharding.shard_spec(shards[0][name])
        got = shards[0][name].detach() if spec is None else \
            sharding.assemble([s[name].detach() for s in shards], spec.axis, spec.blocks)
        assert torch.equal(got, ref.detach()), name


class Orthogonal(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        nn.init.orthogonal_(self.proj.weight)  # does nothing on meta: cannot be recorded


def test_an_unrecordable_constructor_init_warns_and_falls_back():
    reset_init_warnings()
    with pytest.warns(InitFallbackWarning, match="orthogonal_"):
        model = materialize(_delayed(Orthogonal), seed=0)
    bound = 1 / math.sqrt(16)  # reset_parameters: uniform(-1/sqrt(fan_in), ...)
    assert model.proj.weight.abs().max().item() <= bound


def test_init_fn_wins_over_the_constructor():
    def init_fn(module):
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)

    model = materialize(_delayed(NanoGPTish), seed=0, init_fn=init_fn)
    assert torch.equal(model.head.weight, torch.full_like(model.head.weight, 0.5))


def test_hugging_face_models_keep_their_own_init_path():
    """An HF model's `_init_weights` runs at materialise, as before (its constructor's
    writes on meta are not used): the values equal a delayed build made without recording."""
    import models

    from slapo.init import construct

    with slapo.init_empty_weights():
        recorded = models.gpt2(seed=0)
    with torch.device("meta"):
        plain = models.gpt2(seed=0)
    assert any(construct.constructor_init(p) is not None for p in recorded.parameters())
    materialize(recorded, seed=1)
    materialize(plain, seed=1)
    for (name, a), (_, b) in zip(recorded.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_the_record_survives_deepcopy_and_changes_nothing_eager():
    model = _delayed(NanoGPTish)
    copied = sharding.deepcopy_model(model)
    assert all(hasattr(p, "_slapo_init") for p in copied.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eager = NanoGPTish()  # outside the scope nothing is recorded
    assert not any(hasattr(p, "_slapo_init") for p in eager.parameters())
    assert torch.nn.init.orthogonal_.__name__ == "orthogonal_"  # restored after the scope
