"""WideResNet ready schedule (`slapo.model_schedule.wideresnet`): channel TP, per-stage
checkpointing, pipeline cuts, the 2023 `apply_schedule(model, "wideresnet", ...)`.

Equivalence is checked in training mode against the unscheduled model: outputs, every gradient
(gathered over the TP group), every BatchNorm running statistic (gathered) after the step, every
parameter after one SGD step, and eval-mode outputs (which read the running statistics).
Distributed checks run on the persistent 2-rank gloo pool, one job per configuration family.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import pathlib
import warnings

import pytest
import torch
import torch.nn.functional as F
import vision_models as vm

import slapo
from slapo import model_schedule, sharding
from slapo.model_schedule import compat, wideresnet
from slapo.model_schedule.knobs import KnobError
from slapo.module_patch import wrappers

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _close(got, ref, what):
    """max |got - ref| <= 1e-4 max |ref| (+ 1e-6): the TP all-reduce sums channels in another
    order, so elementwise-relative checks would judge near-zero entries on roundoff (as
    `slapo.Verify` does, the tolerance scales with the tensor)."""
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    err = (got - ref).abs().max().item() if ref.numel() else 0.0
    bound = 1e-4 * (ref.abs().max().item() if ref.numel() else 0.0) + 1e-6
    assert err <= bound, f"{what}: max abs error {err:.3e} > {bound:.3e}"


def train_step_matches(model, ref, x, y, lr=0.1) -> int:
    """One SGD step of `model` (scheduled) and `ref` (original) on the same batch; compares
    outputs, gathered gradients, gathered BN buffers, stepped parameters, eval outputs.
    Returns the number of tensors compared."""
    model.train()
    ref.train()
    out, ref_out = model(x), ref(x)
    _close(out, ref_out, "output")
    F.cross_entropy(out, y).backward()
    F.cross_entropy(ref_out, y).backward()
    params = dict(model.named_parameters())
    n = 1
    for name, rp in ref.named_parameters():
        p = params[name]
        _close(sharding.gather_full(p.grad, sharding.shard_spec(p)), rp.grad, f"grad {name}")
        n += 1
    for opt_model in (model, ref):
        torch.optim.SGD(opt_model.parameters(), lr=lr).step()
    for name, rp in ref.named_parameters():
        _close(sharding.gather_full(params[name]), rp.detach(), f"param after step {name}")
    buffers = dict(model.named_buffers())
    for name, rb in ref.named_buffers():
        _close(sharding.gather_full(buffers[name]), rb, f"buffer {name}")
        n += 2
    model.eval()
    ref.eval()
    with torch.no_grad():
        _close(model(x), ref(x), "eval output (running statistics)")
    return n


# ---------------------------------------------------------------------------- one process
def test_sizes_2023_counted_on_meta():
    for name, count in vm.PARAMS_2023.items():
        assert vm.param_count(name) == count, name
    with torch.device("meta"):
        wrn50_2 = vm.ResNet([3, 4, 6, 3], 1000, 128)
    assert sum(p.numel() for p in wrn50_2.parameters()) == 68_883_240  # torchvision's


def test_detect_by_layout():
    assert model_schedule.detect(vm.tiny()).name == "wideresnet"
    wrapped = vm.ResNetWithLoss(vm.tiny())
    assert model_schedule.detect(wrapped).name == "wideresnet"
    assert wideresnet.resnet_prefix(wrapped) == "model"
    with pytest.raises(slapo.SchedulingError, match="no ready schedule"):
        model_schedule.detect(torch.nn.Sequential(torch.nn.Conv2d(3, 3, 1)))


@pytest.mark.parametrize("knob,value", [("attention", "sdpa"), ("fuse", True),
                                        ("tempo", True), ("kernels", True),
                                        ("sequence_parallel", True), ("vocab_parallel", False),
                                        ("fused_loss", True)])
def test_transformer_knobs_refused_before_any_change(knob, value):
    model = vm.tiny()
    before = copy.deepcopy(model.state_dict())
    sch = slapo.create_schedule(model)
    with pytest.raises(KnobError) as info:
        model_schedule.apply(sch, ckpt_ratio=1.0, pp_stages=2, **{knob: value})
    assert info.value.knob == knob and knob in str(info.value)
    assert not list(sch.applied()) and not sch.pipeline_cuts
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_checkpoint_per_stage_keeps_bn_statistics(one_thread):
    """ckpt_ratio=0.5 checkpoints round-half-up(0.5 n_k) blocks of each stage; recomputation
    must not update the BatchNorm statistics a second time."""
    model, ref = vm.tiny(), vm.tiny()
    sch = model_schedule.apply(model, ckpt_ratio=0.5)
    picked = [[b.path for b in s if any(w.name == "checkpoint" for w in wrappers(b.mod))]
              for s in wideresnet.stage_nodes(sch)]
    assert picked == [["layer1.0"], ["layer2.0"], ["layer3.0"], ["layer4.0"]]
    x, y = vm.images()
    assert train_step_matches(model, ref, x, y) > 100


def test_offload_per_stage_after_the_checkpointed_blocks_is_exact(one_thread):
    """offload_ratio=0.5 with ckpt_ratio=0.25 offloads round-half-up(0.5 n_k) blocks of each
    stage after its checkpointed ones (host-copy path forced on CPU); one train step equals
    the unscheduled model's (outputs, gradients, parameters, BatchNorm statistics)."""
    from slapo.primitives.offload import offload_wrapper

    model, ref = vm.tiny(), vm.tiny()
    sch = model_schedule.apply(model, ckpt_ratio=0.25, offload_ratio=0.5)
    kinds = [[("ckpt" if any(w.name == "checkpoint" for w in wrappers(b.mod)) else
               "off" if offload_wrapper(b.mod) else "-") for b in s]
             for s in wideresnet.stage_nodes(sch)]
    found = [w for s in wideresnet.stage_nodes(sch) for b in s
             if (w := offload_wrapper(b.mod)) is not None]
    for w in found:
        w.devices, w.min_bytes = ("cpu",), 0
    x, y = vm.images()
    assert train_step_matches(model, ref, x, y) > 100
    assert all("off" in k for k in kinds) and found and all(w.stats.tensors for w in found), kinds


def test_plain_checkpoint_primitive_counts_bn_once():
    """The trap WideResNet's schedule used to guard itself is closed in the `checkpoint`
    primitive: a plain checkpointed block updates running stats once, like the original."""
    model, ref = vm.tiny(), vm.tiny()
    sch = slapo.create_schedule(model)
    sch["layer1.0"].checkpoint()
    x, y = vm.images()
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert int(model.layer1[0].bn1.num_batches_tracked) == 1
    assert torch.allclose(model.layer1[0].bn1.running_mean, ref.layer1[0].bn1.running_mean)
    assert torch.allclose(model.layer1[0].bn1.running_var, ref.layer1[0].bn1.running_var)


def test_pipeline_cuts_and_stages(one_thread):
    model = vm.tiny()
    ref = copy.deepcopy(model)
    sch = model_schedule.apply(model, pp_stages=3)
    assert list(sch.pipeline_cuts) == ["layer1.1", "layer3.0"]
    stages = wideresnet.partition(sch)
    names = [n for s in stages for n, _ in s.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    x, _ = vm.images()
    h = x
    for stage in stages:
        h = stage(h)
    _close(h, ref(x), "composed stages")
    # the 2023 four-list form, under the loss wrapper's prefix
    wrapped = vm.ResNetWithLoss(vm.tiny())
    s2 = compat.apply_schedule(wrapped, "wideresnet", prefix="model", pipeline_cuts=[[], [0], [],
                                                                                     []])
    assert list(s2.pipeline_cuts) == ["model.layer2.0"]
    assert [st.blocks[-1] for st in wideresnet.partition(s2)] == ["model.layer2.0",
                                                                  "model.layer4.0"]


def test_bad_input_is_refused_before_any_change():
    model = vm.ResNetWithLoss(vm.tiny())
    for cfg, match in [({"pipeline_cuts": [[0], [5], [], []]}, "outside 0..0 of layer2"),
                       ({"pipeline_cuts": [[0]]}, "four lists"),
                       ({"pipeline_cuts": [[], [], [], [0]]}, "last stage without blocks"),
                       ({"ckpt_ratio": 1.5}, "ckpt_ratio"),
                       ({"attn_op_name": "cuda"}, "mean nothing for the wideresnet"),
                       ({"prefix": "backbone"}, "prefix 'backbone'")]:
        with pytest.raises(slapo.SchedulingError, match=match):
            compat.apply_schedule(model, "wideresnet", **cfg)
    assert not any(module_is_patched(m) for m in model.modules())
    with pytest.raises(slapo.SchedulingError, match="does not fit"):
        compat.apply_schedule(model, "gpt2")


def module_is_patched(mod) -> bool:
    return getattr(type(mod), "_slapo_patched", False)


def test_channel_styles_refuse_grouped_and_biased_convs():
    """A ResNeXt-style grouped conv2 or a conv with a bias cannot take the channel plan; the
    whole table is resolved first, so nothing changes."""
    from slapo.distributed.group import VirtualGroup

    for mutate, match in [(lambda b: setattr(b.conv2, "groups", 2), "grouped convolution"),
                          (lambda b: setattr(b.conv2, "bias", torch.nn.Parameter(
                              torch.zeros(b.conv2.out_channels))), "bias")]:
        model = vm.tiny()
        mutate(model.layer3[1])
        sch = slapo.create_schedule(model, group=VirtualGroup(2, 0))
        with pytest.raises(slapo.SchedulingError, match=match):
            model_schedule.apply(sch)
        assert not list(sch.applied())


def test_torchvision_model_if_available(one_thread):
    tv = vm.torchvision_wide_resnet()
    if tv is None:
        pytest.skip("torchvision cannot be imported here")
    ref = copy.deepcopy(tv)
    sch = model_schedule.apply(tv, ckpt_ratio=1.0, pp_stages=2)
    assert model_schedule.detect(tv).name == "wideresnet" and sch.pipeline_cuts
    x, y = vm.images()
    train_step_matches(tv, ref, x, y)


def _run_example(argv):
    path = ROOT / "examples" / "slapo2023" / "wideresnet_train.py"
    spec = importlib.util.spec_from_file_location("slapo2023_wideresnet_train", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(argv)


def test_example_script_trains_one_process(one_thread):
    from slapo.notices import Slapo2023Notice

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Slapo2023Notice)
        losses = _run_example(["--steps", "4"])
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------- 2 gloo ranks
def job_tp(ckpt_ratio: float, compile_blocks: bool | str = False):
    """tp=2 (+ checkpointing, + compiled blocks) against the unscheduled model, every rank."""
    torch._dynamo.reset()
    model, ref = vm.tiny(seed=3), vm.tiny(seed=3)
    sch = model_schedule.apply(model, tp=2, ckpt_ratio=ckpt_ratio, compile_blocks=compile_blocks)
    assert model.layer3[1].conv1.weight.shape[0] * 2 == ref.layer3[1].conv1.weight.shape[0]
    assert model.layer3[1].bn1.running_var.shape[0] * 2 == ref.layer3[1].bn1.num_features
    assert model.layer3[1].conv2.in_channels * 2 == ref.layer3[1].conv2.in_channels
    n = train_step_matches(model, ref, *vm.images(seed=7))
    full = slapo.consolidate(sch)  # the trained state, whole: parameters and BN statistics
    assert list(full) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        _close(full[k].to(v.dtype), v, f"consolidated {k}")
    # slapo.Verify around the same schedule agrees (its default eval mode: running statistics)
    fresh = vm.tiny(seed=3)
    vsch = slapo.create_schedule(fresh)
    x, _ = vm.images(seed=8)
    with slapo.Verify(vsch, [x], loss_fn=lambda out: out.pow(2).mean()) as v:
        model_schedule.apply(vsch, tp=2, ckpt_ratio=ckpt_ratio, compile_blocks=compile_blocks)
    return n + len(v.report)


@pytest.mark.dist
def test_tp2_and_tp2_ckpt(dist2):
    for ratio in (0.0, 1.0):
        n = dist2.run(job_tp, ratio)
        assert n[0] == n[1] > 100


@pytest.mark.dist
@pytest.mark.compile
def test_tp2_with_compiled_checkpointed_blocks(dist2):
    """Channel TP's collectives, checkpointing and the BN guard inside compiled blocks."""
    n = dist2.run(job_tp, 0.5, "aot_eager")
    assert n[0] == n[1] > 100


@pytest.mark.compile
@pytest.mark.parametrize("ratio,policy", [(0.0, "full"), (0.5, "full"), (1.0, "selective")])
def test_compiled_blocks_train_like_the_model(one_thread, ratio, policy):
    """compile_blocks: every Bottleneck compiled on its own (one graph per distinct block, no
    graph break), with checkpointing (full or selective) inside; a train step's gradients and
    every BatchNorm statistic equal the unscheduled model's bit for bit under aot_eager (the
    recomputation counts BN once; inductor measured within 2x eager's own distance from fp64,
    1.4e-4 vs 7.5e-5 relative, on this net whose 1 x 1 last stage amplifies roundoff)."""
    from torch._dynamo.utils import counters

    from slapo.primitives.compile import is_compiled

    torch._dynamo.reset()
    counters.clear()
    model, ref = vm.tiny(seed=2), vm.tiny(seed=2)
    sch = model_schedule.apply(model, ckpt_ratio=ratio, ckpt_policy=policy,
                               compile_blocks="aot_eager")
    blocks = [b for s in slapo.model_schedule.wideresnet.stage_nodes(sch) for b in s]
    assert all(is_compiled(b.mod) for b in blocks)
    x, y = vm.images(seed=3)
    for m in (model, ref):
        torch.nn.functional.cross_entropy(m(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    for (n, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, c), n
    assert counters["stats"]["unique_graphs"] == len(blocks)  # tiny's blocks all differ
    assert not counters["graph_break"], dict(counters["graph_break"])


def job_compat_2023_tp2():
    """The 2023 call (loss wrapper, prefix, uniform checkpointing, broadcast input)."""
    model = vm.ResNetWithLoss(vm.tiny(seed=4))
    ref = copy.deepcopy(model)
    compat.apply_schedule(model, "wideresnet", model_config=(128, [2, 1, 2, 1]),
                          prefix="model", ckpt_ratio=0.5, bcast_input=True)
    x, y = vm.images(seed=9)
    out, ref_out = model(x, y), ref(x, y)
    _close(out["loss"], ref_out["loss"], "loss")
    out["loss"].backward()
    ref_out["loss"].backward()
    params = dict(model.named_parameters())
    for name, rp in ref.named_parameters():
        p = params[name]
        _close(sharding.gather_full(p.grad, sharding.shard_spec(p)), rp.grad, f"grad {name}")
    return float(out["loss"].detach())


def job_pipeline(cuts):
    """2 pipeline stages (GPipe, 2 micro-batches) vs the original run on the same
    micro-batches one after the other: training-mode BN normalises per micro-batch."""
    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    model, ref = vm.tiny(seed=5), vm.tiny(seed=5)
    sch = slapo.create_schedule(model, mesh=mesh)
    if cuts is None:
        model_schedule.apply(sch, pp_stages=2, ckpt_ratio=0.5)
    else:
        wideresnet.cut_lists(sch, cuts)
    train, _ = slapo.build(sch, mesh=mesh, pipeline="GPipe", num_microbatches=2,
                           optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           loss_fn=lambda out, batch: F.cross_entropy(out, batch["labels"]))
    x, y = vm.images(seed=11)
    loss = train.train_step({"x": x, "labels": y})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        mb_loss = F.cross_entropy(ref(xm), ym)
        (mb_loss / 2).backward()
        losses.append(mb_loss.item())
    ref_opt.step()
    ref_params, ref_bufs = dict(ref.named_parameters()), dict(ref.named_buffers())
    n, buffer_errors = 0, {}
    for stage in train.stages:  # this rank's stage (GPipe: stage r on pp rank r)
        for name, p in stage.named_parameters():
            _close(p.detach(), ref_params[name].detach(), f"param after step {name}")
            n += 1
        for name, b in stage.named_buffers():
            try:
                _close(b, ref_bufs[name], f"buffer {name}")
            except AssertionError as e:
                buffer_errors[name] = str(e)
    return loss, sum(losses) / 2, n, buffer_errors


_PIPELINE_RESULTS: dict = {}


def _pipeline_results(dist2, cuts) -> list:
    key = repr(cuts)
    if key not in _PIPELINE_RESULTS:
        _PIPELINE_RESULTS[key] = dist2.run(job_pipeline, cuts)
    return _PIPELINE_RESULTS[key]


@pytest.mark.dist
def test_compat_tp2_and_pipeline_2_stages(dist2):
    losses = dist2.run(job_compat_2023_tp2)
    assert losses[0] == losses[1]
    for cuts in (None, [[], [0], [], []]):
        res = _pipeline_results(dist2, cuts)
        assert all(r[2] > 10 for r in res), res  # every parameter after the step, both stages
        assert abs(res[1][0] - res[1][1]) < 1e-5  # the last stage's loss: the reference's


@pytest.mark.dist
def test_pipeline_keeps_bn_statistics(dist2):
    res = _pipeline_results(dist2, [[], [0], [], []])
    assert not any(r[3] for r in res), [r[3] for r in res]
