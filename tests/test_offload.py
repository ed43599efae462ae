"""Activation offloading (`offload` primitive, `offload_ratio` knob; issue 36 item 2).

On CPU there is no device memory to free, so the tests force the CPU path (`devices=("cpu",)`,
`min_bytes=0`): every saved activation is copied out in forward and read back in backward
through the same hooks the CUDA path uses. The numbers must be exactly the model's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slapo
from slapo import model_schedule
from slapo.errors import SchedulingError
from slapo.primitives import offload as offload_mod
from slapo.primitives.offload import offload_wrapper


def _llama(layers: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    return LlamaForCausalLM(cfg)


def _force_cpu_path(model: nn.Module) -> list[offload_mod.OffloadWrapper]:
    found = [w for m in model.modules() if (w := offload_wrapper(m)) is not None]
    for w in found:
        w.devices, w.min_bytes = ("cpu",), 0
    return found


def _loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def test_offload_ratio_offloads_the_layers_after_the_checkpointed_ones_exactly():
    ref = _llama()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    model_schedule.apply(sch, ckpt_ratio=0.25, offload_ratio=0.5)
    layers = model.model.layers
    assert [i for i, layer in enumerate(layers) if offload_wrapper(layer)] == [1, 2]
    wrappers = _force_cpu_path(model)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for w in wrappers:  # activations went out and came back; the weights stayed
        assert w.stats.tensors > 10 and w.stats.bytes > 0 and w.stats.kept > 0, w.stats


def test_a_corrupted_copy_changes_the_gradients(monkeypatch):
    """The mutation the equality test above must catch: a host copy that is not the tensor."""
    ref = _llama(layers=2)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    _force_cpu_path(model)
    real = offload_mod._unpack
    monkeypatch.setattr(offload_mod, "_unpack", lambda packed: real(packed) * 1.001
                        if isinstance(packed, offload_mod._OnHost) else packed)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert got[0] == want[0]  # the forward is untouched: only what backward reads changed
    assert any(not torch.equal(g, w) for g, w in zip(got[1], want[1]))


def test_weights_and_small_tensors_stay():
    lin = nn.Linear(8, 8)
    sch = slapo.create_schedule(nn.Sequential(lin))
    sch["0"].offload(min_bytes=0, devices=("cpu",))
    x = torch.randn(4, 8, requires_grad=True)
    lin(x).sum().backward()
    stats = offload_wrapper(lin).stats
    assert (stats.tensors, stats.kept) == (1, 1), stats  # x out; the weight (its t()) kept
    sch2 = slapo.create_schedule(nn.Sequential(nn.Linear(8, 8)))
    sch2["0"].offload(min_bytes=4 * 8 * 4 + 1, devices=("cpu",))  # x is 128 bytes
    sch2.mod[0](x).sum().backward()
    assert offload_wrapper(sch2.mod[0]).stats.tensors == 0
    with torch.no_grad():  # nothing is saved without autograd
        sch2.mod[0](x)


def test_default_keeps_cpu_tensors_where_they_are():
    model = _llama(layers=2)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    x = torch.randint(0, 128, (2, 16))
    model(input_ids=x, labels=x).loss.backward()
    assert all(offload_wrapper(layer).stats.tensors == 0 for layer in model.model.layers)


@pytest.mark.compile
def test_offloaded_compiled_blocks_are_exact():
    """The hooks wrap each compiled layer's call and see what its compiled backward saves."""
    ref = _llama(layers=2)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0,
                         compile_blocks="aot_eager")
    wrappers = _force_cpu_path(model)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    try:
        want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    finally:
        torch._dynamo.reset()
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all(w.stats.tensors > 0 for w in wrappers)


def _state(model: nn.Module) -> tuple:
    from slapo import module_patch

    return ([(n, len(module_patch.wrappers(m))) for n, m in model.named_modules()],
            {k: v.clone() for k, v in model.state_dict().items()})


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# the refusals of bad values (min_bytes, devices, the ratios) are cases of
# tests/test_bad_input_api.py and test_bad_input_cli.py (docs/bad-input.md)
def test_offload_and_checkpoint_on_one_module_are_refused_both_ways():
    model = _llama(layers=2)
    sch = slapo.create_schedule(model)
    sch["model.layers.0"].checkpoint()
    sch["model.layers.1"].offload()
    with pytest.raises(SchedulingError, match="checkpointed: it keeps only its inputs"):
        sch["model.layers.0"].offload()
    with pytest.raises(SchedulingError, match="this module is offloaded"):
        sch["model.layers.1"].checkpoint()
    with pytest.raises(SchedulingError, match="already offloaded"):
        sch["model.layers.1"].offload()


def test_wideresnet_refuses_more_than_every_block_untouched():
    """WideResNet offloads per stage (tests/test_wideresnet.py); ratios that ask for more than
    every block (checkpointed and offloaded) are refused before any change."""
    import vision_models

    model = vision_models.tiny()
    sch = slapo.create_schedule(model)
    before = _state(model)
    with pytest.raises(SchedulingError, match="more than every layer"):
        model_schedule.apply(sch, ckpt_ratio=0.75, offload_ratio=0.5)
    assert _same(before, _state(model)) and not list(sch.applied())


def job_tp2_offload() -> list:
    """tp=2 with every layer offloaded (CPU path forced) against the same tp=2 schedule
    without offload: the loss and this rank's gradient shards, exactly."""
    import torch.distributed as dist

    from slapo.runtime.mesh import init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dp=1, tp=2)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    out = []
    for ratio in (0.0, 1.0):
        model = _llama(layers=2)
        sch = slapo.create_schedule(model, mesh=mesh)
        model_schedule.apply(sch, tp=2, offload_ratio=ratio)
        _force_cpu_path(model)
        out.append(_loss_and_grads(model, x))
    (l0, g0), (l1, g1) = out
    return [dist.get_rank(), l0 == l1, all(torch.equal(a, b) for a, b in zip(g0, g1))]


@pytest.mark.dist
def test_offload_under_tp2_is_exact(dist2):
    assert [r[1:] for r in dist2.run(job_tp2_offload)] == [[True, True], [True, True]]


FAMILIES = ["bert_mlm", "roberta", "albert", "gpt2", "gpt_neo", "opt", "t5", "t5_gated", "llama",
            "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe", "deepseek_v3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_offloaded_computes_what_it_computed(family):
    """offload_ratio=1.0 with the host-copy path forced, on every family's ready schedule
    (encoders, decoders, T5's encoder and decoder blocks, ALBERT's shared layer, MoE layers):
    the loss and every gradient, bit for bit."""
    import models

    ref = getattr(models, family)(seed=0)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    wrappers = _force_cpu_path(model)
    batch = models.batch_for(family)
    got, want = [], []
    for m, out in ((ref, want), (model, got)):
        m.zero_grad(set_to_none=True)
        loss = m(**batch).loss
        loss.backward()
        out.extend([loss.detach()] + [p.grad for p in m.parameters() if p.grad is not None])
    assert wrappers and all(w.stats.tensors > 0 for w in wrappers), family
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_backward_prefetches_the_next_layer_and_stays_exact(monkeypatch):
    """Every layer offloaded (host-copy path forced): when backward reaches a layer it starts
    bringing back the layer before it, so every offloaded tensor of layers 0..L-2 is served by
    a prefetch and only the last layer's (where backward starts) are copied back on demand;
    the gradients are the unscheduled model's exactly. A prefetch that copies the wrong
    tensor (the mutation) changes them."""
    ref = _llama(layers=3)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    wrappers = [offload_wrapper(layer) for layer in model.model.layers]
    _force_cpu_path(model)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    served = [(w.stats.prefetched, w.stats.tensors) for w in wrappers]
    assert all(p == t > 0 for p, t in served[:-1]) and served[-1][0] == 0, served

    real = offload_mod._prefetch

    def wrong(group):
        real(group)
        for ref in group.items:
            if (packed := ref()) is not None:
                packed.back = packed.back * 1.001
    monkeypatch.setattr(offload_mod, "_prefetch", wrong)
    bad = _loss_and_grads(model, x)
    assert any(not torch.equal(g, w) for g, w in zip(bad[1], want[1]))


def test_host_copies_are_freed_after_backward_without_the_garbage_collector(monkeypatch):
    """A packed tensor holds its group and the group only weak references to its tensors: no
    reference cycle, so every host copy (pinned memory on a GPU) and every prefetched device
    copy is freed when autograd frees the graph, not whenever Python's collector runs."""
    import gc
    import weakref

    model = _llama(layers=3)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    _force_cpu_path(model)
    groups = []
    real_init = offload_mod._Group.__init__

    def recording(self, stats):
        real_init(self, stats)
        groups.append(weakref.ref(self))
    monkeypatch.setattr(offload_mod._Group, "__init__", recording)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    gc.collect()
    gc.disable()
    try:
        model(input_ids=x, labels=x).loss.backward()
        assert len(groups) == 3
        assert all(g() is None for g in groups), [g() for g in groups]
    finally:
        gc.enable()
