"""Activation offloading (`offload` primitive, `offload_ratio` knob; issue 36 item 2).

On CPU there is no device memory to free, so the tests force the CPU path (`devices=("cpu",)`,
`min_bytes=0`): every saved activation is copied out in forward and read back in backward
through the same hooks the CUDA path uses. The numbers must be exactly the model's, each saved
tensor crosses once (however many ops save it), and backward finds every copy prefetched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import slapo
from slapo import model_schedule
from slapo.errors import SchedulingError
from slapo.primitives import offload as offload_mod
from slapo.primitives.offload import offload_wrapper, prefetch_trigger


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
    assert [i for i, layer in enumerate(layers) if prefetch_trigger(layer)] == [2, 3]
    assert offload_mod._AT_START not in model.__dict__  # layer 3 is kept: it triggers layer 2
    wrappers = _force_cpu_path(model)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    for w in wrappers:  # activations went out and came back, prefetched; the weights stayed
        assert w.stats.tensors > 10 and w.stats.bytes > 0 and w.stats.kept > 0, w.stats
        assert w.stats.prefetched == w.stats.tensors and w.stats.demanded == 0, w.stats


def test_a_corrupted_copy_changes_the_gradients(monkeypatch):
    """The mutation the equality test above must catch: a host copy that is not the tensor."""
    ref = _llama(layers=2)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    _force_cpu_path(model)
    real = offload_mod._unpack
    monkeypatch.setattr(offload_mod, "_unpack", lambda packed: real(packed) * 1.001
                        if isinstance(packed, offload_mod._Saved) else packed)
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
    assert len(wrappers) == 2 and all(t == p > 0 and d == 0 for t, p, d in _served(wrappers))
    assert prefetch_trigger(model.model.layers[1]) is wrappers[0]  # compiled, and it triggers


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


def _hf_loss_and_grads(model, batch: dict) -> list:
    """One forward and backward: the loss and every gradient the model got."""
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_offloaded_computes_what_it_computed(family):
    """offload_ratio=1.0 with the host-copy path forced, on every family's ready schedule
    (encoders, decoders, T5's encoder and decoder blocks, ALBERT's shared layer, MoE layers):
    the loss and every gradient, bit for bit, and no copy waited for."""
    import models

    ref = getattr(models, family)(seed=0)
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    wrappers = _force_cpu_path(model)
    batch = models.batch_for(family)
    want, got = _hf_loss_and_grads(ref, batch), _hf_loss_and_grads(model, batch)
    assert wrappers and all(w.stats.tensors > 0 for w in wrappers), family
    # no read waits for a copy, the last layer's prefetched at the loss (ALBERT: its one
    # layer's last call); DeepSeek-V3's MoE layer saves 4 index tensors backward never reads
    assert all(d == 0 and 0 < p <= t for t, p, d in _served(wrappers)), (family,
                                                                           _served(wrappers))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _served(wrappers: list) -> list[tuple[int, int, int]]:
    return [(w.stats.tensors, w.stats.prefetched, w.stats.demanded) for w in wrappers]


def test_backward_prefetches_every_offloaded_layer_and_stays_exact(monkeypatch):
    """Every layer offloaded (offload_ratio=1.0, 3 layers): the loss's backward starts the
    last layer's prefetch (the root's output is its trigger), reaching layer 2 starts layer 1's
    (layer 2 is its trigger, and its first unpack would be), reaching layer 1 layer 0's. So
    every copy of every layer is served by a prefetch, none copied back on demand, and the
    gradients are the unscheduled model's exactly (float64). The mutations: without the
    triggers the last layer (the first offloaded layer backward reaches) is copied back on
    demand; a prefetch that copies the wrong tensor changes the gradients."""
    ref = _llama(layers=3).double()
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    layers = model.model.layers
    wrappers = _force_cpu_path(model)
    assert [prefetch_trigger(m) for m in layers] == [None, *wrappers[:2]]
    assert model.__dict__[offload_mod._AT_START] == [wrappers[2]]
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert got[0] == want[0]
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert all(t == p > 0 and d == 0 for t, p, d in _served(wrappers)), _served(wrappers)

    with monkeypatch.context() as m:
        m.setattr(offload_mod, "prefetch_when_reached", lambda group, out: None)
        untriggered = _loss_and_grads(model, x)
    assert [d > 0 for _, _, d in _served(wrappers)] == [False, False, True], _served(wrappers)
    assert all(torch.equal(g, w) for g, w in zip(untriggered[1], want[1]))

    real = offload_mod._prefetch

    def wrong(group):
        real(group)
        for ref in group.items:
            if (packed := ref()) is not None:
                packed.back = packed.back * 1.001
    monkeypatch.setattr(offload_mod, "_prefetch", wrong)
    bad = _loss_and_grads(model, x)
    assert any(not torch.equal(g, w) for g, w in zip(bad[1], want[1]))


def test_the_last_layer_offloaded_by_hand_waits_unless_its_trigger_is_placed():
    """A hand-written schedule that offloads a list's last layer places no trigger after it
    (nothing after it in its list): its copies come back when backward reads them;
    `prefetch_first_reached` with no layer after it makes the loss's backward start them."""
    ref = _llama(layers=2).double()
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want = _loss_and_grads(ref, x)
    for placed in (False, True):
        model = copy.deepcopy(ref)
        sch = slapo.create_schedule(model)
        sch["model.layers.1"].offload(min_bytes=0, devices=("cpu",))
        if placed:
            with pytest.raises(SchedulingError, match="not offloaded"):
                offload_mod.prefetch_first_reached(sch["model.layers.0"], sch["model.layers.1"])
            offload_mod.prefetch_first_reached(sch["model.layers.1"], None)
        got = _loss_and_grads(model, x)
        assert all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
        served = _served([offload_wrapper(model.model.layers[1])])
        assert served == ([(19, 19, 0)] if placed else [(19, 0, 19)]), served


def test_a_t5_encoder_offloaded_is_prefetched_by_the_first_decoder_block():
    """T5's layer list is its encoder's blocks, then its decoder's: offload_ratio=0.5 offloads
    the encoder, whose last block has no block after it in its own list; `offload_ratio` makes
    the first decoder block (the next layer in the list) its trigger, not the loss (the whole
    decoder's backward comes between), and every copy is prefetched, exactly."""
    import models

    ref = models.t5(seed=0).double()
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=0.5)
    wrappers = _force_cpu_path(model)
    assert [offload_wrapper(b) for b in model.encoder.block] == wrappers
    assert prefetch_trigger(model.decoder.block[0]) is wrappers[-1]
    assert offload_mod._AT_START not in model.__dict__
    batch = models.batch_for("t5")
    grads = []
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
        m(**batch).loss.backward()
        grads.append([p.grad for p in m.parameters() if p.grad is not None])
    assert all(torch.equal(g, w) for g, w in zip(*grads))
    assert all(t == p > 0 and d == 0 for t, p, d in _served(wrappers)), _served(wrappers)


def test_only_an_ordered_container_gets_a_trigger_and_a_checkpointed_one_still_fires():
    """The module after an offloaded one is known only in an ordered container (a layer list);
    offloading a submodule of a layer places no trigger. A checkpointed module after an
    offloaded one is its trigger too (the hook fires in the checkpointed forward's backward)."""
    ref = _llama(layers=3).double()
    model = copy.deepcopy(ref)
    sch = slapo.create_schedule(model)
    sch["model.layers.0.mlp"].offload(min_bytes=0, devices=("cpu",))
    assert not any(prefetch_trigger(m) for m in model.modules())
    sch["model.layers.1"].offload(min_bytes=0, devices=("cpu",))
    sch["model.layers.2"].checkpoint()
    model.config.use_cache = False
    layer1 = offload_wrapper(model.model.layers[1])
    mlp0 = offload_wrapper(model.model.layers[0].mlp)
    assert prefetch_trigger(model.model.layers[2]) is layer1
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, got = _loss_and_grads(ref, x), _loss_and_grads(model, x)
    assert all(torch.equal(g, w) for g, w in zip(got[1], want[1]))
    assert _served([layer1]) == [(layer1.stats.tensors, layer1.stats.tensors, 0)]
    # the mlp's group follows layer 1's in the chain: layer 1's first unpack prefetched it
    assert _served([mlp0]) == [(mlp0.stats.tensors, mlp0.stats.tensors, 0)]


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


# ---- one copy per saved tensor ------------------------------------------------------------------

class QKV(nn.Module):
    """Three projections of one input: each matmul saves the input (through its own 2-D
    view), as an attention layer's q, k and v do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (nn.Linear(8, 8, dtype=torch.float64) for _ in range(3))

    def forward(self, x):
        return self.q(x) + self.k(x) + self.v(x)  # adds save nothing


def _offloaded(module: nn.Module) -> tuple[nn.Module, offload_mod.OffloadWrapper]:
    model = copy.deepcopy(module)
    wrap = nn.Sequential(model)
    slapo.create_schedule(wrap)["0"].offload(min_bytes=0, devices=("cpu",))
    return model, offload_wrapper(model)


def _grads(module: nn.Module, x: torch.Tensor, times: int = 1) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    loss = (module(x) ** 2).sum()
    for i in range(times):
        loss.backward(retain_graph=i + 1 < times)
    return [x.grad] + [p.grad for p in module.parameters()]


def test_a_tensor_saved_by_three_projections_crosses_once(monkeypatch):
    """The input saved by q, k and v's matmuls is copied to the host once (2 saves served by
    that copy), read back by all three, and the gradients are exactly the module's. Without
    the dedupe (the mutation) it is copied three times."""
    ref = QKV()
    model, w = _offloaded(ref)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, want = _grads(model, x), _grads(ref, x)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    assert (w.stats.tensors, w.stats.deduped, w.stats.bytes, w.stats.kept) == (1, 2, 640, 3)
    assert w.stats.demanded == 1  # brought back once, read by the three matmuls' backward
    monkeypatch.setattr(offload_mod._Group, "_find", lambda self, key: None)
    _grads(model, x)
    assert (w.stats.tensors, w.stats.deduped, w.stats.bytes) == (3, 0, 1920)


def test_a_retained_graph_reads_shared_copies_again():
    """A second backward through a retained graph reads every save again: the shared copy was
    handed over to the first backward's last reader, so it comes back from the host, exactly."""
    ref = QKV()
    model, w = _offloaded(ref)
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, want = _grads(model, x, times=2), _grads(ref, x, times=2)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    # one copy (no trigger: the module is alone in its list), brought back once per backward
    assert (w.stats.tensors, w.stats.deduped, w.stats.demanded) == (1, 2, 2)


class ViewAndSource(nn.Module):
    """Saves `h` and its transpose (one memory span, two views), then doubles `h` in place
    (`in_place`, else into a new tensor) and saves it a third time. Without offload autograd
    refuses the in-place form (a saved tensor changed); through the hooks it does not check
    versions, so the third save is new memory to the dedupe (`_version` bumped) and must get
    the doubled values while the first two keep theirs."""

    def __init__(self, in_place: bool):
        super().__init__()
        torch.manual_seed(0)
        self.in_place = in_place
        self.a = nn.Parameter(torch.randn(6, 3, dtype=torch.float64))
        self.b = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
        self.c = nn.Parameter(torch.randn(6, dtype=torch.float64))

    def forward(self, x):
        h = x * 1.5  # (4, 6): mm saves h, and h.t() (stride (1, 6)) for the second product
        first = h @ self.a
        second = h.t() @ self.b
        h = h.mul_(2.0) if self.in_place else h * 2.0  # (a scalar: saves nothing)
        third = h * self.c  # saves the doubled h
        return first + second.sum() + third.sum(-1, keepdim=True)


def test_views_unpack_as_themselves_and_an_in_place_change_is_a_new_copy(monkeypatch):
    """`h` and `h.t()` cover one span: one copy, each save rebuilt with its own strides; `h`
    after an in-place change is a second copy with the new values. The gradients are those of
    the out-of-place module without offload (`second`'s needs h.t(), `third`'s the doubled h).
    Mutations: rebuilding every view as contiguous, or leaving the version out of the key,
    changes them."""
    ref = ViewAndSource(in_place=False)
    model, w = _offloaded(ViewAndSource(in_place=True))
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want = _grads(ref, x)
    assert all(torch.equal(g, r) for g, r in zip(_grads(model, x), want))
    assert (w.stats.tensors, w.stats.deduped) == (2, 1), w.stats
    with monkeypatch.context() as m:
        m.setattr(offload_mod._Saved, "rebuild", lambda self, d: d.view(self.view[0])
                  if self.view is not None else d)
        assert not all(torch.equal(g, r) for g, r in zip(_grads(model, x), want))
    real = offload_mod._layout

    def no_version(t):
        key, view, span = real(t)
        return (*key[:3], 0, *key[4:]), view, span
    monkeypatch.setattr(offload_mod, "_layout", no_version)
    assert not all(torch.equal(g, r) for g, r in zip(_grads(model, x), want))
    assert w.stats.tensors == 1  # h at both versions taken for one tensor


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_unpack_returns_what_was_saved(family, monkeypatch):
    """Every layer offloaded (float64, host-copy path forced): each unpack returns
    a tensor with the values and size the op saved, and its strides when it was copied as its
    span (a strided slice, GPT-2's q out of the fused qkv output, is copied compactly and
    comes back contiguous: the same values), the gradients are the
    unscheduled model's exactly, and every copy is prefetched. A LLaMA layer makes 19 copies
    for 29 offloaded saves (q, k and v's input, the norms' inputs and outputs, the attention
    output and its 2-D view; 267,520 bytes instead of 353,792); a GPT-2 layer (one fused
    c_attn) 18 for 19 (the attention output and its view)."""
    import models

    ref = getattr(models, family)(seed=0, layers=3).double()
    model = copy.deepcopy(ref)
    model_schedule.apply(slapo.create_schedule(model), offload_ratio=1.0)
    wrappers = _force_cpu_path(model)
    saved, checked = {}, []
    real_pack, real_unpack = offload_mod._Group.pack, offload_mod._unpack

    def pack(self, t, copy_out, dedupe=True):
        handle = real_pack(self, t, copy_out, dedupe)
        saved[id(handle)] = (handle, t.detach().clone(), t.shape, t.stride())
        return handle

    def unpack(packed):
        out = real_unpack(packed)
        if isinstance(packed, offload_mod._Saved):
            _, value, size, stride = saved[id(packed)]
            checked.append(torch.equal(out, value) and out.shape == size
                           and (packed.view is None or out.stride() == stride))
        return out
    monkeypatch.setattr(offload_mod._Group, "pack", pack)
    monkeypatch.setattr(offload_mod, "_unpack", unpack)
    batch = models.batch_for(family)
    want, got = _hf_loss_and_grads(ref, batch), _hf_loss_and_grads(model, batch)
    assert all(torch.equal(g, r) for g, r in zip(got, want))
    assert len(checked) == len(saved) and all(checked), checked
    saves = [w.stats.tensors + w.stats.deduped for w in wrappers]
    assert len(wrappers) == 3 and all(t == p > 0 and d == 0 for t, p, d in _served(wrappers))
    copies = {"llama": (19, 10), "gpt2": (18, 1)}[family]  # (copies, saves that reused one)
    assert all((w.stats.tensors, w.stats.deduped) == copies for w in wrappers), saves
