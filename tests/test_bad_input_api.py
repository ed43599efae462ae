"""Bad input through the Python API, in breadth (issue 15, item 6): every primitive and every
`model_schedule.apply` knob, one table each.

Each case must be *caught* (a `SchedulingError`, never a raw TypeError/AssertionError), *clear*
(the message names the schedule path, the problem and, after "Fix:", what to do) and change
*nothing*: `_rejected` snapshots the model (tensor objects and values, module classes, hooks,
wrappers, kernels, size attributes, the attention implementation) and the schedule (tree,
history, metadata, pipeline cuts) before the call and compares after it.

A world of 2 is simulated by torch's fake process group (shapes only: validation runs no
collective), so the tp=2 cases (heads and KV heads against tp) run in this one process.
`docs/bad-input.md` publishes the counts and the case names; `test_doc_counts_match_tables`
keeps it in sync with the tables below.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from models import albert, bert, t5

import slapo
from slapo import model_schedule
from slapo.errors import SchedulingError
from slapo.model_schedule.knobs import KnobError
from slapo.primitives import BUILTIN


@pytest.fixture(scope="module", autouse=True)
def fake_world_of_two():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():  # another module's world: keep it, it is torn down there
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


# ---- the "nothing changed" helper --------------------------------------------------------------
def _snapshot(sch) -> dict[str, Any]:
    """Everything a rejected call must leave as it was."""
    from slapo import module_patch

    model = sch.mod
    cfg = getattr(model, "config", None)
    return {
        "tensors": {k: (id(v), tuple(v.shape), v.detach().clone()) for k, v in
                    [*model.named_parameters(remove_duplicate=False),
                     *model.named_buffers(remove_duplicate=False)]},
        "modules": [(n, type(m), len(m._forward_hooks), len(m._forward_pre_hooks),
                     len(m._backward_hooks), tuple(type(w) for w in module_patch.wrappers(m)),
                     type(module_patch.kernel(m)), m.__dict__.get("_compiled_call_impl") is None,
                     getattr(m, "in_features", None), getattr(m, "out_features", None),
                     getattr(m, "split_size", None)) for n, m in model.named_modules()],
        "tree": repr(sch),
        "history": [(p, str(h)) for p, h in sch.applied()],
        "metadata": [(p, repr(s.metadata)) for p, s in sch.named_schedules()],
        "cuts": tuple(sch.pipeline_cuts),
        "config": (getattr(cfg, "_attn_implementation", None), getattr(cfg, "use_cache", None)),
    }


def _assert_unchanged(before: dict[str, Any], after: dict[str, Any]) -> None:
    for key in ("tree", "history", "metadata", "cuts", "config", "modules"):
        assert before[key] == after[key], f"{key} changed"
    assert before["tensors"].keys() == after["tensors"].keys()
    for k, (ident, shape, value) in before["tensors"].items():
        ident2, shape2, value2 = after["tensors"][k]
        assert ident == ident2 and shape == shape2, f"{k} was replaced or resized"
        assert torch.equal(value, value2), f"{k} changed"


def _rejected(sch, call: Callable, path: str, needles: tuple[str, ...]) -> SchedulingError:
    """Run `call(sch)`: it must raise a clear SchedulingError and change nothing."""
    before = _snapshot(sch)
    with pytest.raises(SchedulingError) as info:
        call(sch)
    err = info.value
    msg = str(err)
    where = path or "<root>"
    assert msg.startswith(f"[{where}]"), f"the path {where!r} is not named: {msg!r}"
    assert err.problem and err.fix and "Fix:" in msg, f"no problem/fix in {msg!r}"
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    _assert_unchanged(before, _snapshot(sch))
    return err


# ---- primitives ---------------------------------------------------------------------------------
L0 = "encoder.layer.0"
Q, K, V = (f"{L0}.attention.self.{n}" for n in ("query", "key", "value"))
SELF = f"{L0}.attention.self"
OUT = f"{L0}.output.dense"
INTER = f"{L0}.intermediate.dense"
IM = f"{L0}.intermediate"
LN = f"{L0}.output.LayerNorm"
EMB = "embeddings.word_embeddings"


def _base():
    """BERT, 2 layers (token types not divisible by 2), with some prior scheduling so that
    "unchanged" covers recorded state too."""
    sch = slapo.create_schedule(bert(layers=2, type_vocab_size=3))
    sch[Q].shard(["weight", "bias"], axis=0)
    sch[OUT].shard("weight", axis=1)
    return sch


def _traced():
    sch = _base()
    sch[IM].trace()
    return sch


def _bn_net():
    """A small CNN with BatchNorms (BERT has none), for sync_batchnorm."""
    torch.manual_seed(0)
    return slapo.create_schedule(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4),
                                               nn.ReLU(), nn.Flatten(), nn.BatchNorm1d(4)))


def _bn_synced():
    sch = _bn_net()
    sch.sync_batchnorm(group=dist.group.WORLD)
    return sch


def _prepared(step: Callable) -> Callable:
    def setup():
        sch = _base()
        step(sch)
        return sch
    return setup


class Case(NamedTuple):
    primitive: str          # the primitive under test ("(path)": schedule lookup)
    setup: Callable         # () -> Schedule, scheduled as the case needs
    call: Callable          # (sch) -> the bad call
    path: str               # the path the message must name
    needles: tuple = ()     # words the message must contain


def _stale_subgraph(sch):
    other = _traced()
    return sch[IM].fuse(other[IM].find("act"), compiler=None)


PRIMITIVE_CASES: dict[str, Case] = {
    # schedule paths
    "path_typo": Case("(path)", _base, lambda s: s["encoder.layr.0"], "encoder", ("'layr'",)),
    "path_index_out_of_range": Case("(path)", _base, lambda s: s["encoder.layer"]["7"],
                                    "encoder.layer", ("'7'",)),
    "path_not_a_string": Case("(path)", _base, lambda s: s[3], "", ("'3'",)),
    "unknown_primitive": Case("(path)", _base, lambda s: s[K].shardd("weight", 0), K,
                              ("'shardd'", "shard")),
    # annotate
    "annotate_missing_tensor": Case("annotate", _base, lambda s: s[K].annotate("w", "tp", 1), K,
                                    ("no parameter or buffer 'w'", "weight")),
    "annotate_reserved_key": Case("annotate", _base,
                                  lambda s: s[K].annotate("weight", "_slapo_x", 1), K,
                                  ("invalid annotation key",)),
    "annotate_key_not_identifier": Case("annotate", _base,
                                        lambda s: s[K].annotate("weight", "a-b", 1), K,
                                        ("'a-b'",)),
    "annotate_name_not_str": Case("annotate", _base, lambda s: s[K].annotate(3, "tp", 1), K,
                                  ("got 3",)),
    "annotate_dotted_name": Case("annotate", _base,
                                 lambda s: s[SELF].annotate("key.weight", "tp", 1), SELF,
                                 ("not a direct tensor", K)),
    # checkpoint
    "checkpoint_twice": Case("checkpoint", _prepared(lambda s: s[L0].checkpoint()),
                             lambda s: s[L0].checkpoint(), L0, ("already checkpointed",)),
    "checkpoint_condition_not_callable": Case("checkpoint", _base,
                                              lambda s: s[L0].checkpoint(condition=3), L0,
                                              ("condition must be callable",)),
    "checkpoint_order_args_not_callable": Case("checkpoint", _base,
                                               lambda s: s[L0].checkpoint(order_args_fn="x"),
                                               L0, ("order_args_fn must be callable",)),
    "checkpoint_unknown_policy": Case("checkpoint", _base,
                                      lambda s: s[L0].checkpoint(policy="some"), L0,
                                      ("unknown checkpoint policy 'some'", "selective")),
    "checkpoint_policy_on_subgraph": Case("checkpoint", _traced, lambda s: s[IM].checkpoint(
        s[IM].find("act"), policy="selective"), IM, ("whole module",)),
    "checkpoint_subgraph_untraced": Case("checkpoint", _base,
                                         lambda s: s[IM].checkpoint(subgraph=[1]), IM,
                                         ("needs a traced module", ".trace()")),
    "checkpoint_offloaded": Case("checkpoint", _prepared(lambda s: s[L0].offload()),
                                 lambda s: s[L0].checkpoint(), L0, ("is offloaded",)),
    # offload
    "offload_twice": Case("offload", _prepared(lambda s: s[L0].offload()),
                          lambda s: s[L0].offload(), L0, ("already offloaded",)),
    "offload_checkpointed": Case("offload", _prepared(lambda s: s[L0].checkpoint()),
                                 lambda s: s[L0].offload(), L0, ("is checkpointed",)),
    "offload_min_bytes_negative": Case("offload", _base, lambda s: s[L0].offload(min_bytes=-1),
                                       L0, ("min_bytes must be an int >= 0",)),
    "offload_unknown_device": Case("offload", _base,
                                   lambda s: s[L0].offload(devices=("tpu",)), L0,
                                   ("devices must be", "'cuda'")),
    # compile
    "compile_unknown_backend": Case("compile", _base, lambda s: s[IM].compile(backend="nope"),
                                    IM, ("unknown torch.compile backend 'nope'",)),
    "compile_unknown_mode": Case("compile", _base, lambda s: s[IM].compile(mode="fast"), IM,
                                 ("unknown compile mode 'fast'",)),
    "compile_backend_not_name": Case("compile", _base, lambda s: s[IM].compile(backend=3), IM,
                                     ("backend must be a name or a callable",)),
    "compile_fullgraph_not_bool": Case("compile", _base, lambda s: s[IM].compile(
        backend="aot_eager", fullgraph="yes"), IM, ("fullgraph must be True or False",)),
    "compile_dynamic_not_bool": Case("compile", _base, lambda s: s[IM].compile(
        backend="aot_eager", dynamic="maybe"), IM, ("dynamic must be None, True or False",)),
    "compile_twice": Case("compile", _prepared(lambda s: s[IM].compile(backend="aot_eager")),
                          lambda s: s[IM].compile(backend="aot_eager"), IM,
                          ("already compiled",)),
    "compile_around_compiled_part": Case(
        "compile", _prepared(lambda s: s[IM].compile(backend="aot_eager")),
        lambda s: s[L0].compile(backend="aot_eager"), L0, (f"{IM} is already compiled",)),
    "compile_inside_compiled_block": Case(
        "compile", _prepared(lambda s: s[L0].compile(backend="aot_eager")),
        lambda s: s[IM].compile(backend="aot_eager"), IM, (f"inside {L0}",)),
    # cut_pipeline_stage
    "cut_root": Case("cut_pipeline_stage", _base, lambda s: s.cut_pipeline_stage(), "",
                     ("root module cannot be cut",)),
    "cut_last_layer": Case("cut_pipeline_stage", _base,
                           lambda s: s["encoder.layer.1"].cut_pipeline_stage(),
                           "encoder.layer.1", ("last layer of its container",)),
    "cut_inside_block": Case("cut_pipeline_stage", _base, lambda s: s[IM].cut_pipeline_stage(),
                             IM, ("inside a block", "BertLayer")),
    "cut_twice": Case("cut_pipeline_stage", _prepared(lambda s: s[L0].cut_pipeline_stage()),
                      lambda s: s[L0].cut_pipeline_stage(), L0, ("already a stage boundary",)),
    # decompose
    "decompose_not_linear": Case("decompose", _base, lambda s: s[LN].decompose(), LN,
                                 ("LayerNorm", "nn.Linear")),
    "decompose_twice": Case("decompose", _prepared(lambda s: s[INTER].decompose()),
                            lambda s: s[INTER].decompose(), INTER, ("already runs matmul",)),
    "decompose_after_row_sync": Case(
        "decompose", _prepared(lambda s: s[OUT].sync("fwd_post", "all_reduce")),
        lambda s: s[OUT].decompose(), OUT, ("row-parallel sync",)),
    # find
    "find_untraced_no_match": Case("find", _base, lambda s: s[IM].find("softmax"), IM,
                                   ("matches no node", "dense")),
    "find_bad_regex": Case("find", _traced, lambda s: s[IM].find("gelu("), IM,
                           ("not a valid regular expression",)),
    "find_no_match": Case("find", _traced, lambda s: s[IM].find("softmax"), IM,
                          ("matches no node", "dense")),
    "find_unknown_kind": Case("find", _traced, lambda s: s[IM].find("act", kind="re"), IM,
                              ("unknown kind 're'",)),
    "find_wrong_type": Case("find", _traced, lambda s: s[IM].find(3), IM,
                            ("cannot search for a int",)),
    # fork_rng
    "fork_rng_twice": Case("fork_rng", _prepared(lambda s: s[SELF].fork_rng()),
                           lambda s: s[SELF].fork_rng(), SELF, ("already applied",)),
    # fuse
    "fuse_untraced": Case("fuse", _base, lambda s: s[IM].fuse(None), IM,
                          ("needs a traced module",)),
    "fuse_not_a_subgraph": Case("fuse", _traced, lambda s: s[IM].fuse("act"), IM,
                                ("expects a subgraph from .find()",)),
    "fuse_unknown_compiler": Case("fuse", _traced, lambda s: s[IM].fuse(
        s[IM].find("act"), compiler="nope"), IM, ("unknown torch.compile backend 'nope'",)),
    "fuse_bad_name": Case("fuse", _traced, lambda s: s[IM].fuse(
        s[IM].find("act"), compiler=None, name="a b"), IM, ("not a valid attribute name",)),
    "fuse_stale_subgraph": Case("fuse", _traced, _stale_subgraph, IM,
                                ("another (or an older) graph",)),
    # reduce_param_grads
    "reduce_grads_buffer": Case("reduce_param_grads", _base,
                                lambda s: s["embeddings"].reduce_param_grads("position_ids"),
                                "embeddings", ("is a buffer",)),
    "reduce_grads_sharded": Case("reduce_param_grads", _base,
                                 lambda s: s[Q].reduce_param_grads("weight"), Q,
                                 ("is sharded",)),
    "reduce_grads_no_params": Case("reduce_param_grads", _base,
                                   lambda s: s[L0].reduce_param_grads(), L0,
                                   ("no direct replicated parameter",)),
    "reduce_grads_wrong_type": Case("reduce_param_grads", _base,
                                    lambda s: s[LN].reduce_param_grads(3), LN,
                                    ("names must be a parameter name",)),
    "reduce_grads_duplicate": Case("reduce_param_grads", _base,
                                   lambda s: s[LN].reduce_param_grads(["weight", "weight"]), LN,
                                   ("duplicate",)),
    "reduce_grads_twice": Case("reduce_param_grads",
                               _prepared(lambda s: s[LN].reduce_param_grads()),
                               lambda s: s[LN].reduce_param_grads(), LN, ("already summed",)),
    # replace
    "replace_with_int": Case("replace", _base, lambda s: s[K].replace(3), K,
                             ("cannot replace with 3",)),
    "replace_with_nothing": Case("replace", _base, lambda s: s[K].replace(), K,
                                 ("cannot replace with None",)),
    "replace_with_itself": Case("replace", _base, lambda s: s[K].replace(s[K].mod), K,
                                ("is the current module",)),
    "replace_fn_wrong_arity": Case("replace", _base, lambda s: s[IM].replace(lambda x, y: x), IM,
                                   ("requires 2 positional",)),
    "replace_unexpected_kwargs": Case("replace", _base, lambda s: s[K].replace(
        nn.Linear(64, 64), foo=1), K, ("unexpected arguments ['foo']",)),
    "replace_subgraph_untraced": Case("replace", _base, lambda s: s[IM].replace(
        nn.GELU(), target_ops=[1]), IM, ("needs a traced module",)),
    "replace_subgraph_arity": Case("replace", _traced, lambda s: s[IM].replace(
        lambda a, b, c: a, target_ops=s[IM].find("act")), IM, ("1 input(s)",)),
    # set_attr
    "set_attr_unknown": Case("set_attr", _base, lambda s: s[SELF].set_attr("nheads", 2), SELF,
                             ("no plain attribute 'nheads'",)),
    "set_attr_tensor": Case("set_attr", _base, lambda s: s[K].set_attr("weight", 2), K,
                            ("no plain attribute 'weight'",)),
    "set_attr_module_value": Case("set_attr", _base, lambda s: s[SELF].set_attr(
        "attention_head_size", nn.Identity()), SELF, ("tensor or module",)),
    "set_attr_name_not_str": Case("set_attr", _base, lambda s: s[SELF].set_attr(["x"], 1), SELF,
                                  ("no plain attribute",)),
    # shard
    "shard_unknown_tensor": Case("shard", _base, lambda s: s[K].shard("wieght", axis=0), K,
                                 ("'wieght'", "weight")),
    "shard_name_not_str": Case("shard", _base, lambda s: s[K].shard(3, axis=0), K,
                               ("expected a tensor name",)),
    "shard_no_names": Case("shard", _base, lambda s: s[K].shard([], axis=0), K,
                           ("no tensor names",)),
    "shard_duplicate_names": Case("shard", _base, lambda s: s[K].shard(["weight", "weight"], 0),
                                  K, ("duplicate",)),
    "shard_axis_not_int": Case("shard", _base, lambda s: s[K].shard("weight", axis="0"), K,
                               ("axis must be an int",)),
    "shard_axis_bool": Case("shard", _base, lambda s: s[K].shard("weight", axis=True), K,
                            ("axis must be an int",)),
    "shard_axis_out_of_range": Case("shard", _base, lambda s: s[K].shard("weight", axis=2), K,
                                    ("axis 2 is out of range", "[0, 1]")),
    "shard_blocks_zero": Case("shard", _base, lambda s: s[K].shard("weight", 0, blocks=0), K,
                              ("blocks must be a positive int",)),
    "shard_blocks_bool": Case("shard", _base, lambda s: s[K].shard("weight", 0, blocks=True), K,
                              ("blocks must be a positive int",)),
    "shard_indivisible": Case("shard", _base, lambda s: s["embeddings.token_type_embeddings"]
                              .shard("weight", axis=0), "embeddings.token_type_embeddings",
                              ("size 3", "not divisible by world size 2")),
    "shard_blocks_indivisible": Case("shard", _base, lambda s: s[K].shard("weight", 0, blocks=3),
                                     K, ("world size 2 x 3 blocks",)),
    "shard_twice": Case("shard", _base, lambda s: s[Q].shard("weight", axis=0), Q,
                        ("already sharded",)),
    "shard_batch_with_bad_name": Case("shard", _base, lambda s: s[K].shard(["weight", "nope"], 0),
                                      K, ("'nope'",)),
    "shard_dotted_name": Case("shard", _base, lambda s: s[SELF].shard("key.weight", 0), SELF,
                              ("not a direct tensor",)),
    # sync
    "sync_unknown_mode": Case("sync", _base, lambda s: s[OUT].sync("fwd", "all_reduce"), OUT,
                              ("unknown sync mode 'fwd'", "fwd_post")),
    "sync_unknown_op": Case("sync", _base, lambda s: s[OUT].sync("fwd_post", "allreduce"), OUT,
                            ("unknown sync op 'allreduce'", "all_reduce")),
    "sync_bwd_post_gather": Case("sync", _base, lambda s: s[OUT].sync("bwd_post", "all_gather"),
                                 OUT, ("bwd_post supports only 'all_reduce'",)),
    "sync_without_shard": Case("sync", _base, lambda s: s[INTER].sync("fwd_post", "all_reduce"),
                               INTER, ("unsharded", "shard the weight")),
    "sync_gather_partial_sum": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_post", "all_gather", axis=-1), OUT, ("partial-sum",)),
    "sync_reduce_partition": Case("sync", _base, lambda s: s[Q].sync("fwd_post", "all_reduce"),
                                  Q, ("partitioned",)),
    "sync_gather_wrong_axis": Case("sync", _base, lambda s: s[Q].sync(
        "fwd_post", "all_gather", axis=1), Q, ("axis=-1",)),
    "sync_unknown_kwarg": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_post", "all_reduce", dim=1), OUT, ("unexpected sync arguments ['dim']",)),
    "sync_axis_bool": Case("sync", _base, lambda s: s[Q].sync("fwd_post", "all_gather",
                                                              axis=True), Q,
                           ("axis must be an int",)),
    "sync_pre_gather_without_axis": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_pre", "all_gather"), OUT, ("needs an axis",)),
    "sync_arg_wrong_type": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_pre", "all_reduce", arg=1.5), OUT, ("arg must be an input's name",)),
    "sync_arg_on_output": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_post", "all_reduce", arg=0), OUT, ("arg= selects a forward input",)),
    "sync_arg_unknown_name": Case("sync", _base, lambda s: s[OUT].sync(
        "bwd_post", "all_reduce", arg="weights"), OUT, ("not an argument of Linear.forward",)),
    "sync_output_grad_not_bool": Case("sync", _base, lambda s: s[Q].sync(
        "fwd_post", "all_gather", tensor_parallel_output_grad="x"), Q, ("must be True or False",)),
    "sync_output_grad_not_gather": Case("sync", _base, lambda s: s[OUT].sync(
        "fwd_post", "all_reduce", tensor_parallel_output_grad=True), OUT,
        ("applies only to 'all_gather'",)),
    "sync_twice": Case("sync", _prepared(lambda s: s[OUT].sync("fwd_post", "all_reduce")),
                       lambda s: s[OUT].sync("fwd_post", "all_reduce"), OUT,
                       ("already applied",)),
    "sync_input_grad_reduced_twice": Case(
        "sync", _prepared(lambda s: s[Q].sync("fwd_pre", "all_gather", axis=1)),
        lambda s: s[Q].sync("bwd_post", "all_reduce"), Q, ("sum it a second time",
                                                            "tensor_parallel_output_grad=False")),
    "sync_gather_after_input_grad_reduce": Case(
        "sync", _prepared(lambda s: s[Q].sync("bwd_post", "all_reduce", arg="input")),
        lambda s: s[Q].sync("fwd_pre", "all_gather", axis=1, arg=0), Q,
        ("already sums this input's gradient",)),
    # sync_batchnorm
    "sync_bn_no_batchnorm": Case("sync_batchnorm", _base, lambda s: s[LN].sync_batchnorm(
        group=dist.group.WORLD), LN, ("has no BatchNorm",)),
    "sync_bn_no_mesh": Case("sync_batchnorm", _bn_net, lambda s: s.sync_batchnorm(), "",
                            ("no mesh", "group=")),
    "sync_bn_twice": Case("sync_batchnorm", _bn_synced, lambda s: s.sync_batchnorm(
        group=dist.group.WORLD), "", ("already runs the kernel 'sync_batchnorm'",)),
    # trace
    "trace_unknown_tracer": Case("trace", _base, lambda s: s[IM].trace(tracer="jit"), IM,
                                 ("unknown tracer 'jit'",)),
    "trace_tracer_not_str": Case("trace", _base, lambda s: s[IM].trace(tracer=["fx"]), IM,
                                 ("tracer must be a name",)),
    "trace_dynamo_refused": Case("trace", _base, lambda s: s[IM].trace(tracer="dynamo"), IM,
                                 ("not supported",)),
    "trace_export_without_inputs": Case("trace", _base, lambda s: s[IM].trace(tracer="export"),
                                        IM, ("without example_inputs",)),
    "trace_missing_leaf": Case("trace", _base, lambda s: s[IM].trace(leaves=["dens.x"]), IM,
                               ("leaf 'dens.x' is not a submodule",)),
    "trace_leaf_wrong_type": Case("trace", _base, lambda s: s[IM].trace(leaves=[3]), IM,
                                  ("must be a path, class name or class",)),
    "trace_concrete_args_not_dict": Case("trace", _base, lambda s: s[IM].trace(
        concrete_args=[1]), IM, ("concrete_args must be a dict",)),
    "trace_bad_example_inputs": Case("trace", _base, lambda s: s[IM].trace(example_inputs=3),
                                     IM, ("example_inputs of type int",)),
    "trace_after_checkpoint": Case("trace", _prepared(lambda s: s[IM].checkpoint()),
                                   lambda s: s[IM].trace(), IM, ("tracing would drop it",)),
}


def test_every_primitive_has_cases():
    names = {p.name for p in BUILTIN}
    covered = {c.primitive for c in PRIMITIVE_CASES.values()}
    assert names <= covered, f"primitives without a bad-input case: {sorted(names - covered)}"


@pytest.mark.parametrize("case", list(PRIMITIVE_CASES))
def test_primitive_bad_input(case):
    c = PRIMITIVE_CASES[case]
    sch = c.setup()
    _rejected(sch, c.call, c.path, c.needles)
    usable = V if c.setup is not _bn_net and c.setup is not _bn_synced else "1"
    sch[usable].annotate("weight", "still_usable", True)  # the schedule still works afterwards


# ---- model_schedule.apply knobs -----------------------------------------------------------------
def _gpt2(**over):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**{**dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128,
                                                n_positions=64, bos_token_id=0,
                                                eos_token_id=0), **over}))


def _llama(**over):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64, bos_token_id=0,
        eos_token_id=0, pad_token_id=0), **over}))


def _one_rank(model):
    """A schedule on a group of one rank (tp=1), inside the simulated world of two."""
    return slapo.create_schedule(model, group=dist.new_group([0]))


def _two_ranks(model):
    return slapo.create_schedule(model)


def _sdpa_applied(model):
    sch = _one_rank(model)
    model_schedule.apply(sch, attention="sdpa")
    return sch


class KnobCase(NamedTuple):
    knob: str                 # the knob under test (the KnobError's `knob` when it is one)
    model: Callable           # () -> model
    schedule: Callable        # (model) -> Schedule
    kwargs: dict
    needles: tuple = ()


# Knobs that would mutate first (attention, tp) are given with each bad one, so the case also
# checks that validation runs before the first change.
KNOB_CASES: dict[str, KnobCase] = {
    "tp_zero": KnobCase("tp", _gpt2, _one_rank, dict(tp=0), ("tp must be a positive int",)),
    "tp_float": KnobCase("tp", _gpt2, _one_rank, dict(tp=2.0), ("got 2.0",)),
    "tp_not_the_group_size": KnobCase("tp", _gpt2, _two_ranks, dict(tp=3, attention="sdpa"),
                                      ("tp=3", "2 rank(s)")),
    "tp_above_one_rank_group": KnobCase("tp", _gpt2, _one_rank, dict(tp=2, attention="sdpa"),
                                        ("tp=2", "1 rank(s)")),
    "tp_heads_not_divisible": KnobCase("tp", lambda: _gpt2(n_head=3, n_embd=48), _two_ranks,
                                       dict(tp=2, attention="sdpa", ckpt_ratio=0.5),
                                       ("num_attention_heads=3", "tp=2")),
    "tp_kv_heads_one": KnobCase("tp", lambda: _llama(num_key_value_heads=1), _two_ranks,
                                dict(tp=2, attention="sdpa"), ("num_key_value_heads=1", "tp=2")),
    "tp_kv_heads_three": KnobCase("tp", lambda: _llama(num_attention_heads=6,
                                                       num_key_value_heads=3, hidden_size=96),
                                  _two_ranks, dict(tp=2, attention="sdpa"),
                                  ("num_key_value_heads=3",)),
    "tp_mlp_width_not_divisible": KnobCase("tp", lambda: _llama(intermediate_size=129),
                                           _two_ranks, dict(tp=2, attention="sdpa"),
                                           ("intermediate_size=129",)),
    "tp_default_group_heads": KnobCase("tp", lambda: _gpt2(n_head=1, n_embd=48), _two_ranks,
                                       dict(attention="sdpa"), ("num_attention_heads=1",)),
    "ckpt_ratio_above_one": KnobCase("ckpt_ratio", _gpt2, _one_rank,
                                     dict(attention="sdpa", ckpt_ratio=2),
                                     ("ckpt_ratio must be a number in [0, 1]",)),
    "ckpt_ratio_negative": KnobCase("ckpt_ratio", _gpt2, _one_rank, dict(ckpt_ratio=-0.1)),
    "ckpt_ratio_nan": KnobCase("ckpt_ratio", _gpt2, _one_rank, dict(ckpt_ratio=float("nan"))),
    "ckpt_ratio_string": KnobCase("ckpt_ratio", _gpt2, _one_rank,
                                  dict(attention="sdpa", ckpt_ratio="half")),
    "ckpt_ratio_bool": KnobCase("ckpt_ratio", _gpt2, _one_rank, dict(ckpt_ratio=True)),
    "offload_ratio_above_one": KnobCase("offload_ratio", _gpt2, _one_rank,
                                        dict(offload_ratio=2),
                                        ("offload_ratio must be a number in [0, 1]",)),
    "offload_ratio_with_ckpt_over_one": KnobCase("offload_ratio", _gpt2, _one_rank,
                                                 dict(ckpt_ratio=0.75, offload_ratio=0.5),
                                                 ("more than every layer",)),
    "ckpt_policy_unknown": KnobCase("ckpt_policy", _gpt2, _one_rank,
                                    dict(attention="sdpa", ckpt_ratio=0.5, ckpt_policy="some"),
                                    ("full, selective",)),
    "attention_unknown": KnobCase("attention", _gpt2, _one_rank, dict(attention="fast"),
                                  ("eager, sdpa, flash",)),
    "attention_wrong_case": KnobCase("attention", _gpt2, _one_rank, dict(attention="SDPA")),
    "cp_attention_unknown": KnobCase("cp_attention", _gpt2, _one_rank,
                                     dict(attention="sdpa", cp_attention="striped"),
                                     ("allgather, ring, ulysses",)),
    "attention_flash_without_cuda": KnobCase("attention", _gpt2, _two_ranks,
                                             dict(attention="flash", tp=2),
                                             ("flash-attn", "attention='sdpa'")),
    "attention_eager_over_cores": KnobCase("attention", _gpt2, _sdpa_applied,
                                           dict(attention="eager", ckpt_ratio=0.5),
                                           ("already run Slapo attention cores",)),
    "fuse_not_bool": KnobCase("fuse", _gpt2, _one_rank, dict(attention="sdpa", fuse="yes")),
    "fuse_no_plan": KnobCase("fuse", albert, _one_rank, dict(attention="sdpa", ckpt_ratio=0.5,
                                                             fuse=True), ("no fusion plan",)),
    "fuse_with_compile_blocks": KnobCase("fuse", _gpt2, _one_rank,
                                         dict(fuse=True, compile_blocks=True), ("fuse=False",)),
    "fuse_compiler_unknown": KnobCase("fuse_compiler", _gpt2, _one_rank,
                                      dict(attention="sdpa", fuse=True, fuse_compiler="nope"),
                                      ("unknown torch.compile backend 'nope'",)),
    "fuse_compiler_not_str": KnobCase("fuse_compiler", _gpt2, _one_rank,
                                      dict(fuse=True, fuse_compiler=3)),
    "tempo_not_bool": KnobCase("tempo", _gpt2, _one_rank, dict(attention="sdpa", tempo=1)),
    "pp_stages_zero": KnobCase("pp_stages", _gpt2, _one_rank, dict(pp_stages=0)),
    "pp_stages_float": KnobCase("pp_stages", _gpt2, _one_rank, dict(pp_stages=1.0)),
    "pp_stages_above_layers": KnobCase("pp_stages", _llama, _one_rank,
                                       dict(attention="sdpa", ckpt_ratio=0.5, pp_stages=3),
                                       ("2 layers cannot make 3 stages",)),
    "sequence_parallel_not_bool": KnobCase("sequence_parallel", _gpt2, _one_rank,
                                           dict(sequence_parallel=1)),
    "sequence_parallel_no_plan": KnobCase("sequence_parallel", t5, _two_ranks,
                                          dict(tp=2, attention="sdpa", sequence_parallel=True),
                                          ("not implemented for the t5 family",)),
    "sequence_parallel_with_pp": KnobCase("sequence_parallel", _gpt2, _two_ranks,
                                          dict(tp=2, sequence_parallel=True, pp_stages=2),
                                          ("pipeline stages",)),
    "vocab_parallel_not_bool": KnobCase("vocab_parallel", _gpt2, _one_rank,
                                        dict(vocab_parallel="no")),
    "compile_blocks_int": KnobCase("compile_blocks", _gpt2, _one_rank, dict(compile_blocks=3)),
    "compile_blocks_unknown_backend": KnobCase("compile_blocks", _gpt2, _one_rank,
                                               dict(attention="sdpa", compile_blocks="nope"),
                                               ("unknown torch.compile backend 'nope'",)),
    "fused_loss_not_bool": KnobCase("fused_loss", _gpt2, _one_rank, dict(fused_loss="yes")),
    "fused_loss_without_a_head": KnobCase("fused_loss", lambda: bert(layers=1), _one_rank,
                                          dict(fused_loss=True), ("no plan for BertModel",
                                                                  "fused_loss=False")),
    "fused_loss_with_vocab_parallel": KnobCase("fused_loss", _gpt2, _two_ranks,
                                               dict(attention="sdpa", fused_loss=True),
                                               ("vocab_parallel=False",)),
    "kernels_not_bool": KnobCase("kernels", _gpt2, _one_rank, dict(kernels=1)),
    "model_not_supported": KnobCase("(model)", lambda: nn.Sequential(nn.Linear(2, 2)), _one_rank,
                                    dict(attention="sdpa"), ("no ready schedule",)),
    "model_not_a_module": KnobCase("(model)", lambda: bert(layers=1), lambda m: object(),
                                   dict(attention="sdpa"), ("nn.Module",)),
}


def test_every_knob_has_cases():
    from slapo.model_schedule import knobs

    covered = {c.knob for c in KNOB_CASES.values()}
    assert set(knobs.names()) <= covered, sorted(set(knobs.names()) - covered)


@pytest.mark.parametrize("case", list(KNOB_CASES))
def test_apply_bad_knob(case):
    c = KNOB_CASES[case]
    model = c.model()
    target = c.schedule(model)
    if not isinstance(target, slapo.Schedule):  # not a model at all: nothing to snapshot
        with pytest.raises(SchedulingError, match="nn.Module"):
            model_schedule.apply(target, **c.kwargs)
        return
    err = _rejected(target, lambda s: model_schedule.apply(s, **c.kwargs), "", c.needles)
    if isinstance(err, KnobError):  # a value check: the knob is named (the CLI's --flag)
        assert err.knob == c.knob and c.knob in str(err), (err.knob, str(err))


# ---- the published counts -----------------------------------------------------------------------
DOC = Path(__file__).resolve().parents[1] / "docs" / "bad-input.md"


def doc_surface(surface: str) -> tuple[list[int], list[str]]:
    """(the counts row, the case names listed) of one surface of docs/bad-input.md."""
    text = DOC.read_text()
    row = re.search(rf"^\| {re.escape(surface)} \|([^\n]*)$", text, re.M)
    assert row, f"no counts row for {surface!r} in {DOC}"
    counts = [int(x) for x in re.findall(r"\d+", row.group(1))]
    section = re.search(rf"^### {re.escape(surface)}\n(.*?)(?=^### |^## |\Z)", text, re.M | re.S)
    assert section, f"no case list for {surface!r} in {DOC}"
    return counts, re.findall(r"`([a-z0-9_]+)`", section.group(1))


@pytest.mark.parametrize("surface,table", [("API: primitives", PRIMITIVE_CASES),
                                           ("API: model_schedule.apply", KNOB_CASES)])
def test_doc_counts_match_tables(surface, table):
    counts, names = doc_surface(surface)
    assert counts == [len(table)] * 4, (surface, counts, len(table))
    assert sorted(names) == sorted(table), set(names) ^ set(table)
