"""Bad input gets a clear `slapo` error naming the path, the problem and the fix, and changes
nothing: the model (tensors, classes, hooks) and the schedule (tree, history) are as before.

The shard/sync checks that depend on the world size run on a world of 2 simulated by torch's
fake process group (shapes only; no collective runs during validation).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from models import bert

import slapo


@pytest.fixture(scope="module", autouse=True)
def fake_world_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _snapshot(sch):
    model = sch.mod
    return {
        "tensors": {k: (id(v), v.detach().clone()) for k, v in
                    [*model.named_parameters(remove_duplicate=False),
                     *model.named_buffers(remove_duplicate=False)]},
        "classes": [(n, type(m)) for n, m in model.named_modules()],
        "hooks": [(n, len(m._forward_hooks), len(m._forward_pre_hooks),
                   len(m._backward_hooks), tuple(m.__dict__.get("_slapo_wrappers", ())),
                   m.__dict__.get("_slapo_kernel")) for n, m in model.named_modules()],
        "attrs": [(n, getattr(m, "in_features", None), getattr(m, "out_features", None),
                   getattr(m, "split_size", None)) for n, m in model.named_modules()],
        "tree": repr(sch),
        "history": [(p, str(h)) for p, h in sch.applied()],
        "metadata": [(p, repr(s.metadata)) for p, s in sch.named_schedules()],
    }


def _assert_unchanged(before, after):
    assert before["tree"] == after["tree"]
    assert before["history"] == after["history"]
    assert before["metadata"] == after["metadata"]
    assert before["classes"] == after["classes"]
    assert before["hooks"] == after["hooks"]
    assert before["attrs"] == after["attrs"]
    assert before["tensors"].keys() == after["tensors"].keys()
    for k, (ident, value) in before["tensors"].items():
        ident2, value2 = after["tensors"][k]
        assert ident == ident2, f"{k} was replaced"
        assert torch.equal(value, value2), f"{k} changed"


@pytest.fixture
def sch():
    s = slapo.create_schedule(bert(layers=1, type_vocab_size=3))
    # a little prior scheduling, so "unchanged" covers recorded state too
    s["encoder.layer.0.attention.self.query"].shard(["weight", "bias"], axis=0)
    s["encoder.layer.0.output.dense"].shard("weight", axis=1)
    return s


def _fails(sch, fn, *needles, exc=slapo.SchedulingError):
    before = _snapshot(sch)
    with pytest.raises(exc) as info:
        fn(sch)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert "Fix:" in msg, msg
    _assert_unchanged(before, _snapshot(sch))
    # the schedule is still usable afterwards
    value = sch["encoder.layer.0.attention.self.value"]
    value.annotate("weight", f"still_usable_{len(value.history)}", True)
    return msg


Q = "encoder.layer.0.attention.self.query"
K = "encoder.layer.0.attention.self.key"
OUT = "encoder.layer.0.output.dense"
INTER = "encoder.layer.0.intermediate.dense"

CASES = {
    "wrong_path": (lambda s: s["encoder.layr.0"], ["[encoder]", "'layr'", "layer"]),
    "wrong_chained_child": (lambda s: s["encoder"]["layer"]["7"], ["encoder.layer", "'7'", "0"]),
    "unknown_primitive": (lambda s: s[Q].shardd("weight", 0), ["'shardd'", "shard"]),
    "shard_unknown_tensor": (lambda s: s[K].shard("wieght", axis=0), [K, "'wieght'", "weight"]),
    "shard_axis_out_of_range": (lambda s: s[K].shard("weight", axis=2), [K, "axis 2", "[0, 1]"]),
    "shard_axis_not_int": (lambda s: s[K].shard("weight", axis="0"), [K, "axis must be an int"]),
    "shard_indivisible": (lambda s: s["embeddings.token_type_embeddings"].shard("weight", axis=0),
                          ["token_type_embeddings", "size 3", "not divisible by world size 2"]),
    "shard_twice": (lambda s: s[Q].shard("weight", axis=0), [Q, "already sharded"]),
    "shard_twice_in_one_call": (lambda s: s[K].shard(["weight", "weight"], axis=0),
                                ["duplicate"]),
    "shard_partial_batch_rolls_back": (lambda s: s[K].shard(["weight", "nope"], axis=0),
                                       ["'nope'"]),
    "shard_blocks_indivisible": (lambda s: s[K].shard("weight", axis=0, blocks=3),
                                 ["not divisible by world size 2 x 3 blocks"]),
    "shard_dotted_name": (lambda s: s["encoder.layer.0.attention.self"].shard("key.weight", 0),
                          ["not a direct tensor", K]),
    "sync_bad_mode": (lambda s: s[OUT].sync("fwd", "all_reduce"), [OUT, "fwd_post"]),
    "sync_bad_op": (lambda s: s[OUT].sync("fwd_post", "allreduce"), [OUT, "all_reduce"]),
    "sync_bwd_post_gather": (lambda s: s[OUT].sync("bwd_post", "all_gather"),
                             ["bwd_post supports only 'all_reduce'"]),
    "sync_before_shard": (lambda s: s[INTER].sync("fwd_post", "all_reduce"),
                          [INTER, "unsharded", "shard the weight"]),
    "sync_gather_partial": (lambda s: s[OUT].sync("fwd_post", "all_gather", axis=-1),
                            [OUT, "partial-sum", "all_reduce"]),
    "sync_reduce_partition": (lambda s: s[Q].sync("fwd_post", "all_reduce"),
                              [Q, "partitioned", "all_gather"]),
    "sync_unknown_kwarg": (lambda s: s[OUT].sync("fwd_post", "all_reduce", dim=1),
                           ["unexpected sync arguments", "'dim'"]),
    "sync_pre_gather_without_axis": (lambda s: s[OUT].sync("fwd_pre", "all_gather"),
                                     ["needs an axis"]),
    "sync_gather_wrong_axis": (lambda s: s[Q].sync("fwd_post", "all_gather", axis=1),
                               ["partitioned along the last axis", "axis=-1"]),
    "checkpoint_bad_condition": (lambda s: s["encoder.layer.0"].checkpoint(condition=3),
                                 ["condition must be callable"]),
    "replace_with_int": (lambda s: s[K].replace(3), [K, "cannot replace with 3"]),
    "replace_fn_wrong_signature": (lambda s: s["encoder.layer.0.intermediate"].replace(
        lambda x, y: x), ["intermediate", "requires 2 positional", "at most 1 (hidden_states)"]),
    "replace_same_module": (lambda s: s[K].replace(s[K].mod), ["is the current module"]),
    "annotate_bad_key": (lambda s: s[K].annotate("weight", "_slapo_x", 1), ["invalid annotation"]),
    "annotate_missing_tensor": (lambda s: s[K].annotate("w", "tp", 1), ["no parameter or buffer"]),
    "decompose_non_linear": (lambda s: s["encoder.layer.0.output.LayerNorm"].decompose(),
                             ["LayerNorm", "nn.Linear"]),
    "set_attr_unknown": (lambda s: s["encoder.layer.0.attention.self"].set_attr("nheads", 2),
                         ["no plain attribute 'nheads'"]),
    "set_attr_tensor": (lambda s: s[K].set_attr("weight", 2), ["no plain attribute"]),
    "create_schedule_not_module": (lambda s: slapo.create_schedule(object()), ["nn.Module"]),
    "build_bad_optimizer": (lambda s: slapo.build(s, optimizer="adamw"),
                            ["optimizer must be a class or callable"]),
    "embedding_vocab_shard_max_norm": (None, ["max_norm"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(sch, case):
    fn, needles = CASES[case]
    if case == "embedding_vocab_shard_max_norm":
        emb = sch["embeddings.word_embeddings"].mod
        emb.max_norm = 1.0
        try:
            _fails(sch, lambda s: s["embeddings.word_embeddings"].shard("weight", axis=0),
                   *needles)
        finally:
            emb.max_norm = None
        return
    _fails(sch, fn, *needles)


def test_second_checkpoint_and_fork_rng_and_decompose_rejected(sch):
    layer = sch["encoder.layer.0"]
    layer.checkpoint()
    _fails(sch, lambda s: s["encoder.layer.0"].checkpoint(), "already checkpointed")
    layer.fork_rng()
    _fails(sch, lambda s: s["encoder.layer.0"].fork_rng(), "already applied")
    sch[INTER].decompose()
    _fails(sch, lambda s: s[INTER].decompose(), "already runs matmul and bias separately")


def test_sync_twice_rejected(sch):
    sch[OUT].sync("fwd_post", "all_reduce")
    _fails(sch, lambda s: s[OUT].sync("fwd_post", "all_reduce"), "already applied")


def test_errors_are_one_family():
    assert issubclass(slapo.SchedulingError, slapo.SlapoError)
    assert issubclass(slapo.VerificationError, slapo.SlapoError)
    s = slapo.create_schedule(nn.Linear(2, 2))
    with pytest.raises(KeyError):  # path errors are also KeyErrors, for `in`-style code
        s["nope"]
    assert "nope" not in s
    assert not hasattr(s, "no_such_primitive")


@pytest.mark.parametrize("kwargs,match", [({"group": "tp"}, "group= must be"),
                                          ({"mesh": [0, 1]}, "mesh= must be a DeviceMesh")])
def test_create_schedule_refuses_a_wrong_group_or_mesh(kwargs, match):
    with pytest.raises(slapo.SchedulingError, match=match):
        slapo.create_schedule(nn.Linear(2, 2), **kwargs)
