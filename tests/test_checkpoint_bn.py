"""The `checkpoint` primitive keeps BatchNorm running statistics through recomputation.

A checkpointed module's forward runs twice in a training step (the real forward, then the
recomputation in backward); a training-mode BatchNorm in it would update its running
statistics on both runs. Checked on a real Hugging Face ResNet (built from a config), with
plain BatchNorm2d and with SyncBatchNorm, for full and selective checkpointing and for nested
checkpoints: after 3 SGD steps the outputs, every gradient and every buffer (running mean/var,
num_batches_tracked) equal the unscheduled model's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import slapo

STEPS = 3
# the real forward and the recomputation of a nested checkpoint: every BN inside is guarded
CUTS = ["resnet.embedder", "resnet.encoder.stages.0", "resnet.encoder.stages.1",
        "resnet.encoder.stages.1.layers.0.layer"]


def resnet(sync: bool = False) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    cfg = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       layer_type="basic", num_labels=5)
    model = ResNetForImageClassification(cfg)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if sync else model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4, 3, 16, 16, generator=g), torch.randint(0, 5, (4,), generator=g)


def train(model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """STEPS SGD steps; per step the logits and every gradient, then every buffer."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.train()
    seen = []
    for step in range(STEPS):
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        logits = model(x).logits
        F.cross_entropy(logits, y).backward()
        seen.append({"logits": logits.detach().clone(),
                     **{f"grad {n}": p.grad.clone() for n, p in model.named_parameters()}})
        opt.step()
    seen.append({f"buffer {n}": b.clone() for n, b in model.named_buffers()})
    return seen


def assert_same(got: list[dict], ref: list[dict]) -> None:
    assert len(got) == len(ref)
    for step, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert g.keys() == r.keys()
        for name, value in r.items():
            torch.testing.assert_close(g[name], value, rtol=1e-6, atol=1e-7,
                                       msg=lambda m, s=step, n=name: f"step {s}, {n}: {m}")


@pytest.mark.parametrize("sync", [False, True], ids=["BatchNorm2d", "SyncBatchNorm"])
@pytest.mark.parametrize("policy", [None, "selective"], ids=["full", "selective"])
def test_checkpointed_batchnorm_updates_statistics_once(one_thread, sync, policy):
    model = resnet(sync)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    for path in CUTS:
        sch[path].checkpoint(policy=policy)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    assert len(norms) >= 5 and all(isinstance(m, nn.SyncBatchNorm) == sync for m in norms)
    got, want = train(model), train(ref)
    assert_same(got, want)
    counts = {n: int(b) for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert set(counts.values()) == {STEPS}, counts


def test_plain_torch_checkpoint_counts_twice_and_eval_mode_is_untouched(one_thread):
    """The trap is real in this torch (so the test above can fail): torch.utils.checkpoint
    alone updates a BN twice per step. And a checkpointed model in eval mode with grad on
    leaves every statistic as it was."""
    model = resnet()
    stage = model.resnet.encoder.stages[0]
    x, _ = batch(0)
    h = model.resnet.embedder(x)
    torch.utils.checkpoint.checkpoint(stage, h, use_reentrant=False).sum().backward()
    bn = stage.layers[0].layer[0].normalization
    assert int(bn.num_batches_tracked) == 2

    model, ref = resnet(), resnet()
    sch = slapo.create_schedule(model)
    sch["resnet.encoder"].checkpoint()
    model.eval()
    ref.eval()
    out, ref_out = model(x).logits, ref(x).logits
    out.sum().backward()
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    for (n, b), rb in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, rb), n


@pytest.mark.compile
@pytest.mark.parametrize("policy", [None, "selective"], ids=["full", "selective"])
def test_compiled_checkpointed_batchnorm_updates_statistics_once(one_thread, policy):
    """Under torch.compile the primitive adds no guard (the compiled graph applies the buffer
    update once); checked, so a torch change that recomputes it is caught."""
    model = resnet()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["resnet.encoder.stages.0"].checkpoint(policy=policy)
    stage = model.resnet.encoder.stages[0]
    compiled = torch.compile(stage, backend="aot_eager", fullgraph=False)
    x, _ = batch(0)
    h = model.resnet.embedder(x).detach()
    compiled(h).sum().backward()
    ref.resnet.encoder.stages[0](h).sum().backward()
    bn, ref_bn = stage.layers[0].layer[0].normalization, \
        ref.resnet.encoder.stages[0].layers[0].layer[0].normalization
    assert int(bn.num_batches_tracked) == 1
    torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
    torch.testing.assert_close(bn.running_var, ref_bn.running_var)
