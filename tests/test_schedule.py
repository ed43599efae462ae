"""The schedule tree and the module primitives on one process (a world of one rank)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import bert, gpt2, ids, llama
from reference import hidden_loss

import slapo


def _saved_bytes(fn) -> int:
    """Bytes saved for backward during `fn()`, de-duplicated by storage."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_tree_mirrors_named_modules():
    model = bert()
    sch = slapo.create_schedule(model)
    paths = [p for p, _ in sch.named_schedules()]
    assert paths == [n for n, _ in model.named_modules()]
    node = sch["encoder.layer.0.attention.self"]
    assert node is sch["encoder"]["layer"]["0"]["attention"]["self"]
    assert node.path == "encoder.layer.0.attention.self"
    assert node.name == "self"
    assert node.parent.path == "encoder.layer.0.attention"
    assert node.mod is model.encoder.layer[0].attention.self
    assert set(node.child) == {"query", "key", "value", "dropout"}
    assert [c.name for c in node] == list(node.child)
    assert "encoder.layer.1.output.dense" in sch and "encoder.layer.9" not in sch
    assert sch.world_size == 1 and sch.rank == 0
    assert node.root is sch


def test_primitives_listed_and_documented():
    names = slapo.list_primitives()
    for p in ("replace", "shard", "sync", "checkpoint", "fork_rng", "annotate", "decompose"):
        assert p in names
    sch = slapo.create_schedule(nn.Linear(2, 2))
    for p in names:
        doc = getattr(sch, p).__doc__
        assert doc and len(doc.strip()) > 40, p


def test_print_shows_history():
    sch = slapo.create_schedule(bert())
    sch["encoder.layer.0.attention.self.query"].shard(["weight", "bias"], axis=0)
    sch["encoder.layer.1"].checkpoint()
    text = str(sch)
    # the history shows each call's arguments by name, defaults left out
    assert "query: Linear  ← shard(name_or_names=['weight', 'bias'], axis=0)" in text
    assert "1: BertLayer  ← checkpoint()" in text
    assert [p for p, _ in sch.applied()] == ["encoder.layer.0.attention.self.query",
                                              "encoder.layer.1"]
    assert "intermediate" not in sch.tree(only_scheduled=True)


def test_replace_keeps_schedules_valid_and_moves_hooks():
    model = bert()
    sch = slapo.create_schedule(model)
    inter = sch["encoder.layer.0.intermediate"]
    dense_before = inter["dense"]
    calls = []
    inter.mod.register_forward_hook(lambda m, a, o: calls.append(1))

    class MyFFN(nn.Module):
        def __init__(self, old):
            super().__init__()
            self.dense = old.dense
            self.act = nn.GELU()

        def forward(self, hidden_states):
            return self.act(self.dense(hidden_states))

    new = MyFFN(inter.mod)
    inter.replace(new)
    assert model.encoder.layer[0].intermediate is new
    assert inter.mod is new and sch["encoder.layer.0.intermediate"] is inter
    assert set(inter.child) == {"dense", "act"}
    assert dense_before.mod is new.dense  # the node still resolves
    model(ids())
    assert calls == [1]
    assert "replace(new_mod_or_fn=MyFFN(...))" in str(sch)


def test_replace_by_function_is_equivalent():
    model = bert()
    x = ids()
    sch = slapo.create_schedule(model)
    with slapo.Verify(sch, [x], loss_fn=lambda o: o.last_hidden_state.sum()):
        act = sch["encoder.layer.0.intermediate.intermediate_act_fn"]
        act.replace(lambda hidden_states: F.gelu(hidden_states))


def test_verify_detects_wrong_replacement():
    sch = slapo.create_schedule(bert())
    with pytest.raises(slapo.VerificationError, match="last_hidden_state"):
        with slapo.Verify(sch, [ids()]):
            sch["encoder.layer.0.intermediate.intermediate_act_fn"].replace(
                lambda hidden_states: F.relu(hidden_states))


def test_verify_detects_lost_parameter():
    sch = slapo.create_schedule(bert())
    with pytest.raises(slapo.VerificationError, match="missing"):
        with slapo.Verify(sch, [ids()]):
            sch["encoder.layer.0.intermediate.dense"].replace(nn.Identity())


def test_verify_leaves_model_unchanged():
    model = gpt2()
    before = copy.deepcopy(model.state_dict())
    sch = slapo.create_schedule(model)
    x = ids()
    with slapo.Verify(sch, [x], loss_fn=lambda o: o.loss, example_kwargs={"labels": x},
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1)):
        sch["transformer.h.0"].checkpoint()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_checkpoint_identical_and_saves_memory(family):
    make = {"bert": bert, "gpt2": gpt2, "llama": llama}[family]
    x = ids(batch=4, seq=32)
    kw = {} if family == "bert" else {"labels": x}

    def loss_of(out):
        return hidden_loss(out.last_hidden_state) if family == "bert" else out.loss

    model = make()
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    layers = sch["encoder.layer" if family == "bert" else
                 "transformer.h" if family == "gpt2" else "model.layers"]
    for node in layers:
        node.checkpoint()
    saved_ref, out_ref = _saved_bytes(lambda: ref(x, **kw))
    saved, out = _saved_bytes(lambda: model(x, **kw))
    assert saved < 0.6 * saved_ref, (saved, saved_ref)
    loss_of(out_ref).backward()
    loss_of(out).backward()
    torch.testing.assert_close(loss_of(out), loss_of(out_ref))
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_checkpoint_with_dropout_recomputes_same_mask():
    model = bert(dropout=0.3)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model)
    sch["encoder.layer.0"].checkpoint()
    x = ids()
    torch.manual_seed(3)
    model(x).last_hidden_state.sum().backward()
    torch.manual_seed(3)
    ref(x).last_hidden_state.sum().backward()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_checkpoint_condition_and_kwargs():
    layer = nn.Linear(8, 8)
    sch = slapo.create_schedule(layer)
    sch.checkpoint(condition=lambda m: m.training)
    x = torch.randn(4, 8, requires_grad=True)
    layer.eval()
    assert _saved_bytes(lambda: layer(x))[0] > 0      # not checkpointed: saves x for backward
    layer.train()
    out = layer(input=x)                               # keyword arguments pass through
    out.sum().backward()
    assert x.grad is not None


def test_decompose_is_equivalent_and_exposes_bias_add():
    model = gpt2()
    sch = slapo.create_schedule(model)
    x = ids()
    with slapo.Verify(sch, [x], loss_fn=lambda o: o.loss, example_kwargs={"labels": x}):
        sch["transformer.h.0.mlp.c_fc"].decompose()
        sch["transformer.h.0.attn.c_attn"].decompose()
        lin = nn.Linear(4, 4)
        s2 = slapo.create_schedule(lin)
        s2.decompose()
    from slapo import module_patch

    assert module_patch.kernel(model.transformer.h[0].mlp.c_fc) is not None


def test_shard_on_one_rank_records_spec_and_annotations_survive():
    lin = nn.Linear(6, 4)
    sch = slapo.create_schedule(lin)
    sch.annotate("weight", "my_tag", 7)
    sch.shard("weight", axis=0)
    from slapo.sharding import shard_spec

    spec = shard_spec(lin.weight)
    assert spec.orig_shape == (4, 6) and spec.axis == 0 and spec.world_size == 1
    assert lin.weight.my_tag == 7 and lin.out_features == 4
    assert isinstance(lin.weight, nn.Parameter)


def test_fork_rng_single_process_reproducible():
    slapo.set_random_seed(11, tp_rank=0)
    drop = nn.Dropout(0.5)
    sch = slapo.create_schedule(drop)
    sch.fork_rng()
    x = torch.ones(100)
    default_before = torch.get_rng_state()
    a = drop(x)
    assert torch.equal(torch.get_rng_state(), default_before)  # default stream untouched
    slapo.set_random_seed(11, tp_rank=0)
    assert torch.equal(a, drop(x))


def test_fork_rng_for_dropouts_swaps_only_when_a_dropout_can_draw():
    """`fork_rng(draws="dropout")`: the stream swap runs only in training and with some
    probability above 0 that the module holds (an nn.Dropout, a `*drop*`/`p` number attribute)
    or is handed (a `dropout=` keyword, a positional number); `draws="any"` always swaps."""
    from slapo.primitives.fork_rng import may_drop

    class Core(nn.Module):  # an attention core: HF hands it the probability
        def forward(self, x, dropout=0.0, scaling=1.0):
            return nn.functional.dropout(x * scaling, dropout, self.training)

    block = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))
    core = Core()
    x = torch.ones(3, 4)
    assert not may_drop(block, (x,), {}) and not may_drop(core, (x,), {"scaling": 2.0})
    assert may_drop(core, (x,), {"dropout": 0.1}) and may_drop(core, (x, 0.1), {})
    block[1].p = 0.2
    assert may_drop(block, (x,), {})
    block.eval()
    assert not may_drop(block, (x,), {})
    block.train()
    block[1].p = 0.0
    block[0].attention_dropout = 0.3  # HF keeps attention's probability as a float attribute
    assert may_drop(block, (x,), {})

    slapo.set_random_seed(5, tp_rank=0)
    sch = slapo.create_schedule(core)
    sch.fork_rng(draws="dropout")
    before = slapo.distributed.rng.get_rng_tracker().get_states()
    core(x, dropout=0.0)
    after = slapo.distributed.rng.get_rng_tracker().get_states()
    assert all(torch.equal(before[k][0], after[k][0]) for k in before)
    default = torch.get_rng_state()
    y = core(torch.ones(100), dropout=0.5)  # drawn from the TP stream, default untouched
    assert torch.equal(torch.get_rng_state(), default) and (y == 0).any()
    with pytest.raises(slapo.SchedulingError, match="draws='noise'"):
        slapo.create_schedule(Core()).fork_rng(draws="noise")

    class Noisy(nn.Module):  # random numbers without a visible probability: caught, not silent
        def forward(self, x):
            return x + torch.randn_like(x)

    noisy = Noisy()
    slapo.create_schedule(noisy).fork_rng(draws="dropout")
    with pytest.raises(slapo.SchedulingError, match="drew random numbers"):
        noisy(x)


def test_set_attr_recorded():
    sch = slapo.create_schedule(gpt2())
    attn = sch["transformer.h.0.attn"]
    attn.set_attr("split_size", 64)
    assert "set_attr(name='split_size', value=64)" in str(sch)


def test_delayed_init_single_process_and_untouched_weights():
    with slapo.init_empty_weights():
        meta = bert()
    assert all(p.device.type == "meta" for p in meta.parameters())
    sch = slapo.create_schedule(meta)
    model, opt = slapo.build(sch, seed=3, device="cpu", optimizer=torch.optim.SGD,
                             optimizer_kwargs={"lr": 0.1})
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert isinstance(opt, torch.optim.SGD)
    # position ids (a buffer) were rebuilt by the model's own init, weights are not zero
    assert torch.equal(model.embeddings.position_ids[0, :5], torch.arange(5))
    assert model.encoder.layer[0].attention.self.query.weight.std() > 0.005
    model(ids())
    # build never re-initialises materialised (e.g. loaded) weights
    loaded = bert(seed=5)
    before = copy.deepcopy(loaded.state_dict())
    built, none = slapo.build(slapo.create_schedule(loaded))
    assert none is None
    for k, v in built.state_dict().items():
        assert torch.equal(v, before[k])


def test_patched_module_is_still_its_class_and_deepcopies():
    lin = nn.Linear(3, 3)
    sch = slapo.create_schedule(lin)
    sch.checkpoint()
    assert isinstance(lin, nn.Linear) and type(lin).__name__ == "Linear"
    clone = copy.deepcopy(lin)
    assert type(clone) is type(lin)
    x = torch.randn(2, 3)
    torch.testing.assert_close(clone(x), lin(x))


def test_deepcopy_model_keeps_shard_specs_and_tags():
    from slapo import sharding

    lin = nn.Linear(4, 4)
    sch = slapo.create_schedule(lin)
    sch.annotate("bias", "my_tag", 5)
    sch.shard("weight", axis=0)
    import copy

    assert sharding.shard_spec(copy.deepcopy(lin).weight) is None  # what torch does
    clone = sharding.deepcopy_model(lin)
    assert sharding.shard_spec(clone.weight) == sharding.shard_spec(lin.weight)
    assert clone.bias.my_tag == 5 and clone.weight is not lin.weight
