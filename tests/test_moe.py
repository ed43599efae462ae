"""Expert parallelism (issue 33): ep=2 on real gloo ranks equals one process for Mixtral,
Qwen3-MoE and DeepSeek-V3 (loss, auxiliary loss, every gradient, parameters after two AdamW
steps), with uneven tokens per expert and an expert that receives none; a token sent to the wrong rank is
caught; bad placements and models are refused before anything changes.

The reference is HF's model in one process, each rank's half of the global batch run as one
micro-batch and the gradients averaged (what DDP computes): the auxiliary load-balancing loss
is HF's per-micro-batch statistic (docs/model_schedule.md), so each rank's aux loss equals the
one-process aux loss of its half.
"""

from __future__ import annotations

import copy

import pytest
import torch

from slapo.errors import SchedulingError
from slapo.runtime.mesh import ParallelDims

LR = 1e-2
REL = 1e-5
FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")
RIGGED = ("mixtral", "qwen3_moe")  # layer 0 is sparse: its router is rigged (`_model`)


# ---- bad placements (one process) ------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"ep": 2}, "ep does not divide dp=1"),
    ({"dp_replicate": 3, "ep": 2}, "ep does not divide dp=3"),
    ({"ep": 0}, "must be a positive int"),
])
def test_bad_ep_placements_are_refused(kw, match):
    with pytest.raises(SchedulingError, match=match):
        ParallelDims(**kw)


def test_ep_borrows_data_parallel_ranks():
    dims = ParallelDims.for_world(8, tp=2, ep=2)
    assert (dims.dp, dims.ep, dims.dp_rest, dims.world) == (4, 2, 2, 8)
    assert dims.mesh_dims == ("dp", "pp", "tp") and str(dims) == "dp=4 (ep=2 of dp) x pp=1 x tp=2"
    with pytest.raises(SchedulingError, match="ep does not divide dp=3"):
        ParallelDims.for_world(6, tp=2, ep=2)
    with pytest.raises(SchedulingError, match="2 ranks"):  # the job has one process
        from slapo.runtime.mesh import init_mesh

        init_mesh(dims=ParallelDims(dp_replicate=2, ep=2, device="cpu"))


def test_families_find_their_experts_and_skip_dense_layers():
    """Qwen3-MoE's `mlp_only_layers` and DeepSeek-V3's first layers keep a dense MLP: the
    plan finds only the sparse layers' experts (what ep swaps)."""
    import models
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    import slapo
    from slapo.model_schedule import _registry

    dense0 = models._build(Qwen3MoeConfig, Qwen3MoeForCausalLM, 0, hidden_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                           vocab_size=128, num_experts=4, num_experts_per_tok=2,
                           mlp_only_layers=[0])
    for model, name, found in ((dense0, "qwen3_moe", ["model.layers.1.mlp.experts"]),
                               (models.deepseek_v3(), "deepseek_v3",  # first layer dense
                                ["model.layers.1.mlp.experts"]),
                               (models.mixtral(), "mixtral", [f"model.layers.{i}.mlp.experts"
                                                              for i in range(2)])):
        family = _registry.detect(model)
        layers = _registry.layers_of(slapo.create_schedule(model), family)
        assert family.name == name
        assert [n.path for n in family.moe.modules(layers)] == found


# ---- ep=2 against one process ----------------------------------------------------------------
def _model(family: str, experts: int = 4, dp: int = 2, rows: int = 1, **kw):
    """The tiny model, its layer-0 router rigged so expert 3 receives no token of the first
    batch: its row becomes -c * v, with v a direction every router input of that batch has a
    positive component along (found by a perceptron) and c so large that expert 3's logit is
    the lowest for each of those tokens (the test asserts it happened)."""
    import models

    model = getattr(models, family)(seed=0, experts=experts, **kw)
    if experts != 4 or family not in RIGGED:
        return model
    gate = model.model.layers[0].mlp.gate
    seen = []
    hook = gate.register_forward_pre_hook(lambda m, a: seen.append(a[0].detach()))
    with torch.no_grad():
        model(input_ids=_batches(dp, rows)[0]["input_ids"])
    hook.remove()
    x = seen[0].reshape(-1, seen[0].shape[-1])
    v = x.mean(0)
    for _ in range(1000):
        wrong = x @ v <= 0
        if not wrong.any():
            break
        v = v + x[wrong].sum(0)
    v = v / v.norm()
    with torch.no_grad():
        largest = (x @ gate.weight.T).abs().max()
        gate.weight[3] = -(2 * largest / (x @ v).min() + 1) * v
    return model


def _batches(dp: int = 2, rows: int = 1) -> list[dict]:
    """Two global batches, `rows` sequences of 16 tokens per data-parallel rank."""
    import models

    return [{"input_ids": x, "labels": x} for x in (models.ids(dp * rows, 16, seed=1),
                                                    models.ids(dp * rows, 16, seed=2))]


def _reference(ref, batches):
    """One process: per step, each sequence as a micro-batch (grads averaged), AdamW. Returns
    the step losses, each sequence's aux loss per step, the first step's gradients and the routing
    counts per layer of the first forward pass over the whole batch."""
    counts = []
    sparse = [layer for layer in ref.model.layers if hasattr(layer.mlp, "experts")]
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, a, o: counts.append(torch.bincount(o[2].reshape(-1), minlength=4)))
        for layer in sparse]
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, auxes, grads = [], [], None
    for batch in batches:
        opt.zero_grad()
        total, aux = 0.0, []
        dp = batch["input_ids"].shape[0]
        for r in range(dp):
            out = ref(**{k: v[r:r + 1] for k, v in batch.items()})
            (out.loss / dp).backward()
            total += out.loss.item() / dp
            aux.append(_aux(out))
        if grads is None:
            grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        losses.append(total)
        auxes.append(aux)
    for h in hooks:
        h.remove()
    n = len(sparse)  # the first step's micro-batches, summed per sparse layer
    per_layer = [sum(counts[i + n * r] for r in range(batches[0]["input_ids"].shape[0]))
                 for i in range(n)]
    return losses, auxes, grads, per_layer


def _aux(out) -> float | None:
    """The auxiliary loss of an HF MoE output (None: HF's DeepSeek-V3 has none)."""
    return None if getattr(out, "aux_loss", None) is None else out.aux_loss.item()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.abs().max().item()
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def _local(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a reference tensor (the experts it holds), else the tensor."""
    from slapo.op.moe import expert_shard

    s = expert_shard(p)
    return value if s is None else value[s.first:s.first + s.count]


def _full(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor) and a tensor-parallel shard (`p`'s) gathered whole;
    anything else as it is."""
    from slapo.sharding import gather_full, shard_spec

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    spec = shard_spec(p)
    return gather_full(t, spec) if spec is not None and spec.world_size > 1 else t


def _ep_run(family: str, mesh, batches, dp: int = 2, grad_accum: int = 1, **kw):
    """The scheduled model: apply on the ep mesh, build with DDP, two train steps."""
    import slapo

    dtype = kw.pop("dtype", torch.float32)
    clip = kw.pop("grad_clip", None)
    data_parallel = kw.pop("data_parallel", "ddp")
    model = _model(family, dp=dp, rows=grad_accum, **kw).to(dtype)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    slapo.model_schedule.apply(sch)
    auxes = []
    model.register_forward_hook(lambda m, a, o: auxes.append(_aux(o)))
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        data_parallel=data_parallel, grad_accum=grad_accum, grad_clip=clip)
    losses, grads = [], None
    for batch in batches:
        losses.append(tm.train_step(batch))
        if grads is None:
            grads = {n: _full(p.grad, p) for n, p in tm.named_parameters()}
            tm.__dict__["first_norm"] = tm.train_step.__self__.last_grad_norm
    return ref, tm, losses, auxes, grads


def _off_by_one(honest):
    """The mutation: one row destined for one rank's experts is sent to the other (the split
    computation moved by one)."""
    def splits(tokens_per_expert, ep):
        out = honest(tokens_per_expert, ep).clone()
        src = 0 if out[0] > 0 else 1
        out[src] -= 1
        out[1 - src] += 1
        return out
    return splits


def job_ep2_equals_one_process(families=FAMILIES, misroute=False, dp=2, grad_accum=1, tp=1,
                               ep=2, **kw):
    """Each family: every compared quantity's relative difference, and the facts the
    comparison relies on (an idle expert, uneven counts, this rank's experts). `misroute`:
    with `_off_by_one` patched into the split computation; `dp`: data-parallel ranks (ep=2
    of them, so dp=4 has two ranks holding each expert); `grad_accum`: micro-batches per
    rank and step (one sequence each); `tp`: tensor-parallel ranks per data-parallel rank
    (their shards gathered to compare); `ep`: the ranks the experts spread over. "reduces":
    the expert all-reduces run."""
    import torch.distributed as dist

    import slapo.op.moe as moe
    from slapo.runtime.data_parallel import ExpertGradMean
    from slapo.runtime.mesh import init_mesh

    rank, k = dist.get_rank() // tp, grad_accum  # the data-parallel rank
    dp_kind = "dp_shard" if kw.get("data_parallel") == "fsdp" else "dp_replicate"
    mesh = init_mesh(dims=ParallelDims(**{dp_kind: dp}, ep=ep, tp=tp, device="cpu"))
    batches = _batches(dp, k)
    honest, out, reduces = moe.send_splits, {}, []
    real_reduce = ExpertGradMean.reduce
    if misroute:
        moe.send_splits = _off_by_one(honest)
    ExpertGradMean.reduce = lambda self: (reduces.append(1), real_reduce(self))[1]
    try:
        for family in families:
            reduces.clear()
            ref, tm, losses, auxes, grads = _ep_run(family, mesh, batches, dp, k, **kw)
            ref_losses, ref_auxes, ref_grads, counts = _reference(ref, batches)
            experts = next(m for m in tm.modules() if isinstance(m, moe.ExpertParallelExperts))
            shard = moe.expert_shard(experts.gate_up_proj)
            params, ref_params = dict(tm.named_parameters()), dict(ref.named_parameters())
            assert params.keys() == ref_params.keys()
            out[family] = {
                "held": (shard.first, shard.count, tuple(experts.gate_up_proj.shape)),
                "grouped": experts.grouped,
                "counts": [c.tolist() for c in counts],
                "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
                "aux": 0.0 if auxes[0] is None else max(
                    abs(auxes[s * k + j] - ref_auxes[s][rank * k + j])
                    / abs(ref_auxes[s][rank * k + j]) for s in range(2) for j in range(k)),
                "has_aux": auxes[0] is not None and ref_auxes[0][rank] is not None,
                "reduces": len(reduces),
                "grad": {n: _rel(g, _local(ref_grads[n], params[n])) for n, g in grads.items()},
                "param": {n: _rel(_full(p.detach(), p), _local(ref_params[n].detach(), p))
                          for n, p in params.items()},
                "tp_split": sum(_full(p, p) is not p for p in params.values()
                                if not hasattr(p, "full_tensor")),
                "mla_split": any(_full(p, p) is not p for n, p in params.items()
                                 if "kv_b_proj" in n and not hasattr(p, "full_tensor")),
                "fsdp": sum(hasattr(p, "full_tensor") for p in params.values()),
                # the clipped norm (with `grad_clip`): each expert once, tp replicas once
                "norm": None if tm.__dict__.get("first_norm") is None else _rel(
                    tm.__dict__["first_norm"].double(),
                    torch.stack([g.double().norm() for g in ref_grads.values()]).norm()),
            }
    finally:
        moe.send_splits = honest
        ExpertGradMean.reduce = real_reduce
    return out


def _recording(pipeline_outputs, auxes: list):
    """A last stage's `pipeline_outputs` that appends each micro-batch's aux loss to `auxes`."""
    def wrapped(output):
        out = pipeline_outputs(output)
        auxes.append(_aux(out))
        return out
    return wrapped


def job_ep2_pp2_equals_one_process(families=FAMILIES) -> dict:
    """ep=2 x pp=2 on 4 ranks (1F1B, 2 micro-batches of one sequence per dp rank; FSDP2 per
    stage, as pipelines take data parallelism: DDP's reducer cannot follow them), in float64,
    with the router's auxiliary loss (the stages carry its statistics, `runtime/stage_router.py`;
    each micro-batch's aux loss is recorded from the last stage's outputs): each rank's stage
    parameters, their gradients and values after 2 AdamW steps against one process, the losses,
    the aux losses, the clipped norm; which experts it holds."""
    import torch.distributed as dist

    import slapo
    import slapo.op.moe as moe
    from slapo.runtime.mesh import init_mesh

    mesh = init_mesh(dims=ParallelDims(dp_shard=2, ep=2, pp=2, device="cpu"))
    batches = _batches(2, 2)
    out = {}
    for family in families:
        model = _model(family, dp=2, rows=2).to(torch.float64)
        ref = copy.deepcopy(model)
        sch = slapo.create_schedule(model, mesh=mesh)
        slapo.model_schedule.apply(sch, pp_stages=2)
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                            data_parallel="fsdp", pipeline="1F1B", num_microbatches=2,
                            grad_clip=1e6)
        auxes = []
        for st in tm.stages:
            if st.last:
                st.pipeline_outputs = _recording(st.pipeline_outputs, auxes)
        losses, grads, norm = [], None, None
        for batch in batches:
            losses.append(tm.train_step(batch))
            if grads is None:
                grads = {n: _full(p.grad, p) for st in tm.stages
                         for n, p in st.named_parameters()}
                norm = tm._trainer.last_grad_norm
        ref_losses, ref_auxes, ref_grads, _ = _reference(ref, batches)
        auxes = auxes[-4:]  # the real micro-batches (torch may call the loss once more first)
        mine = [ref_auxes[s][2 * (dist.get_rank() // 2) + j] for s in range(2) for j in range(2)]
        params = {n: p for st in tm.stages for n, p in st.named_parameters()}
        ref_params = dict(ref.named_parameters())
        held = [m for m in tm.modules() if isinstance(m, moe.ExpertParallelExperts)]
        out[family] = {
            "rank": dist.get_rank(),
            "held": [(moe.expert_shard(m.gate_up_proj).first,
                      tuple(m.gate_up_proj.shape)) for m in held],
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "aux": 0.0 if mine[0] is None or not any(st.last for st in tm.stages) else max(
                abs(a - b) / abs(b) for a, b in zip(auxes, mine, strict=True)),
            "has_aux": bool(auxes) and auxes[0] is not None,
            "grad": {n: _rel(g, _local(ref_grads[n], params[n])) for n, g in grads.items()},
            "param": {n: _rel(_full(p.detach(), p), _local(ref_params[n].detach(), p))
                      for n, p in params.items()},
            "norm": _rel(norm.double(), torch.stack([g.double().norm()
                                                     for g in ref_grads.values()]).norm()),
        }
    return out


def _mismatches(results: list[dict], family: str, param_rel: float = REL) -> dict:
    """Every quantity of `family` (on any rank) further than REL from one process (the
    parameters after the AdamW steps: `param_rel`)."""
    bad = {}
    for rank, r in enumerate(results):
        res = r[family]
        bad.update({(rank, kind): res[kind] for kind in ("loss", "aux") if res[kind] > REL})
        bad.update({(rank, kind, n): v for kind in ("grad", "param")
                    for n, v in res[kind].items() if v > (REL if kind == "grad" else param_rel)})
    return bad


def job_bad_models_are_refused():
    """On an ep=2 mesh: experts ep does not divide, a model without an MoE plan, and builds ep
    cannot run yet: each a SchedulingError, the model unchanged."""
    import models

    import slapo
    from slapo.runtime.mesh import init_mesh

    mesh = init_mesh(dims=ParallelDims(dp_replicate=2, ep=2, device="cpu"))
    refused = {}
    cases = {"experts": (lambda: _model("qwen3_moe", experts=3), {}),
             "no_plan": (lambda: models.llama(seed=0), {})}
    for name, (make, kw) in cases.items():
        model = make()
        before = {n: (type(m), ) for n, m in model.named_modules()}
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(SchedulingError) as err:
            slapo.model_schedule.apply(slapo.create_schedule(model, mesh=mesh), **kw)
        assert {n: (type(m), ) for n, m in model.named_modules()} == before
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        refused[name] = str(err.value)
    # (grad_clip is no longer refused: the norm sums the experts over ep, and
    # test_train_moe's ep run clips to one process's norm)
    for name, kw in {"none": {}}.items():
        sch = slapo.create_schedule(_model("mixtral"), mesh=mesh)
        slapo.model_schedule.apply(sch)
        with pytest.raises(SchedulingError) as err:
            slapo.build(sch, optimizer=torch.optim.AdamW, **kw)
        refused[name] = str(err.value)
    return refused


@pytest.mark.dist
def test_ep2_equals_one_process(dist2):
    results = dist2.run(job_ep2_equals_one_process)
    for family in FAMILIES:
        held = {r[family]["held"] for r in results}
        assert held == {(0, 2, (2, 64, 64)), (2, 2, (2, 64, 64))}, held  # E/ep each
        counts = results[0][family]["counts"]
        if family in RIGGED:
            assert counts[0][3] == 0, counts  # an expert received no token
        assert any(len(set(c)) > 1 for c in counts), counts  # uneven loads
        assert all(r[family]["has_aux"] == (family in RIGGED) for r in results)
        assert not _mismatches(results, family), (family, _mismatches(results, family))
        assert all(len(r[family]["grad"]) == len(r[family]["param"]) > 10 for r in results)
        assert all(r[family]["reduces"] == 0 for r in results)  # dp == ep: nothing to average


@pytest.mark.dist
def test_ep2_of_dp4_with_accumulation_equals_one_process(dist4):
    """dp=4, ep=2, two micro-batches per rank and step: two ranks hold each expert, their
    accumulated gradients averaged over "dp_rest" in one bucketed all-reduce per step (not per
    micro-batch or parameter: `ExpertGradMean`).

    An expert's gradient is then `(a + b) / 4 + (c + d) / 4` (two ep groups) where one
    process accumulates `((a/4 + b/4) + c/4) + d/4`: equal to roundoff (the gradients within
    REL), which AdamW's first steps amplify where a gradient element is near zero (its update
    is about lr * sign), so the parameters are compared at 1e-4, as test_data_parallel's DDP
    (whose all-reduce reorders the same sums) is."""
    results = dist4.run(job_ep2_equals_one_process, families=("mixtral",), dp=4,
                        grad_accum=2)
    assert [r["mixtral"]["held"][0] for r in results] == [0, 2, 0, 2]  # consecutive ep groups
    assert [r["mixtral"]["reduces"] for r in results] == [2] * 4  # one per step
    assert results[0]["mixtral"]["counts"][0][3] == 0, results[0]["mixtral"]["counts"]
    bad = _mismatches(results, "mixtral", param_rel=1e-3)
    assert not bad, bad


@pytest.mark.dist
def test_ep4_equals_one_process(dist4):
    """ep=4 of dp=4: one expert per rank, each token's two experts on two other ranks mostly,
    the rigged idle expert's rank receiving no row of the first batch's layer 0. In float64:
    an expert sums its 4 ranks' rows in another order than one process's loop, whose float32
    roundoff AdamW amplifies to 1.5e-5 in a parameter."""
    results = dist4.run(job_ep2_equals_one_process, dp=4, ep=4, dtype=torch.float64)
    for family in FAMILIES:
        assert [r[family]["held"] for r in results] == [(i, 1, (1, 64, 64)) for i in range(4)]
        if family in RIGGED:
            assert results[0][family]["counts"][0][3] == 0
        assert all(r[family]["reduces"] == 0 for r in results)  # dp == ep
        assert not _mismatches(results, family), (family, _mismatches(results, family))


@pytest.mark.dist
def test_ep2_with_tp2_equals_one_process(dist4):
    """ep=2 x tp=2 on 4 ranks: attention (and DeepSeek-V3's MLA, its dense layer and shared
    expert) split by the tensor-parallel plan, the experts by ep among the ranks of one tp
    index, whole on each (the tp plan leaves them to ep: `moe.without_experts`). In float64:
    tp's all-reduces sum in another order than one process, whose float32 roundoff AdamW's
    first steps amplify to ~2e-4 in a parameter whose gradient element is near zero."""
    results = dist4.run(job_ep2_equals_one_process, tp=2, dtype=torch.float64, grad_clip=1e6)
    for family in FAMILIES:
        assert [r[family]["held"][0] for r in results] == [0, 0, 2, 2]  # ep over dp ranks
        assert all(r[family]["held"][2] == (2, 64, 64) for r in results)  # experts whole
        assert all(r[family]["tp_split"] > 0 for r in results)  # tp split something
        # DeepSeek-V3's MLA heads too (plan_supplements: DeepSeek-V2's declared MLA rows)
        assert all(r[family]["mla_split"] == (family == "deepseek_v3") for r in results)
        assert all(r[family]["norm"] < REL for r in results), [r[family]["norm"] for r in results]
        assert not _mismatches(results, family), (family, _mismatches(results, family))


@pytest.mark.dist
def test_ep2_of_fsdp2_dp4_with_accumulation_equals_one_process(dist4):
    """ep=2 of dp_shard=4 (FSDP2), two micro-batches per rank and step, in float64: FSDP2
    shards every parameter but the experts over the 4 ranks and reduce-scatters on the last
    micro-batch; the experts stay ep's (`ignored_params`), averaged over "dp_rest" once per
    step with FSDP2's own sync flag (`set_expert_sync`); the clipped norm counts each expert
    once (it would count them on each of FSDP2's dp ranks otherwise)."""
    results = dist4.run(job_ep2_equals_one_process, dp=4, grad_accum=2,
                        data_parallel="fsdp", dtype=torch.float64, grad_clip=1e6)
    for family in FAMILIES:
        assert [r[family]["held"][0] for r in results] == [0, 2, 0, 2]
        assert all(r[family]["fsdp"] > 10 for r in results)  # FSDP2 sharded the rest
        assert [r[family]["reduces"] for r in results] == [2] * 4  # one per step
        assert all(r[family]["norm"] < REL for r in results), [r[family]["norm"] for r in results]
        assert not _mismatches(results, family), (family, _mismatches(results, family))


@pytest.mark.dist
def test_ep2_with_pp2_equals_one_process(dist4):
    """ep=2 x pp=2 on 4 ranks: each stage's experts spread over the 2 dp ranks running that
    stage (ranks 0, 2 hold stage 0; 1, 3 stage 1), their all-to-alls in step under the same
    1F1B schedule; DeepSeek-V3's first stage holds its dense layer only, so no experts."""
    results = dist4.run(job_ep2_pp2_equals_one_process)
    for family in FAMILIES:
        held = [r[family]["held"] for r in results]
        stage1 = [[(0, (2, 64, 64))], [(0, (2, 64, 64))], [(2, (2, 64, 64))],
                  [(2, (2, 64, 64))]]
        want = stage1 if family in RIGGED else [[], stage1[1], [], stage1[3]]
        assert held == want, (family, held)
        # the aux loss (Mixtral, Qwen3-MoE; DeepSeek-V3 has none) on the last stage's ranks
        assert [r[family]["has_aux"] for r in results] == [False, family in RIGGED] * 2
        assert all(r[family]["norm"] < REL for r in results), [r[family]["norm"] for r in results]
        assert not _mismatches(results, family), (family, _mismatches(results, family))


@pytest.mark.dist
def test_ep2_equals_hf_default_grouped_mm_experts(dist2):
    """Against HF's default experts implementation (`grouped_mm` on this CPU in transformers
    5.24), not only its eager loop: the ep experts then run grouped GEMMs too
    (`ExpertParallelExperts.grouped`). Loss, aux loss and every gradient within REL; the
    parameters after two AdamW steps at 1e-3 (measured 2e-4): a grouped GEMM over both ranks' rows sums each expert's weight
    gradient in another order than HF's over one process's, which AdamW's first steps amplify
    where a gradient element is near zero."""
    results = dist2.run(job_ep2_equals_one_process, families=("mixtral",), impl=None)
    assert all(r["mixtral"]["grouped"] for r in results)  # the grouped GEMM path ran
    bad = _mismatches(results, "mixtral", param_rel=1e-3)
    assert not bad, bad


@pytest.mark.dist
def test_a_token_routed_to_the_wrong_rank_fails(dist2):
    """The comparison above catches one (token, expert) row sent to the wrong rank."""
    results = dist2.run(job_ep2_equals_one_process, families=("mixtral",), misroute=True)
    bad = _mismatches(results, "mixtral")
    assert any(k[1] == "grad" and "experts" in k[2] for k in bad if len(k) == 3), bad


@pytest.mark.dist
def test_bad_models_and_builds_are_refused(dist2):
    refused = dist2.run(job_bad_models_are_refused)[0]
    assert "ep=2 does not divide the 3 experts" in refused["experts"]
    assert "no mixture-of-experts plan" in refused["no_plan"]
    assert "'mixtral'" in refused["no_plan"] and "drop --ep" in refused["no_plan"]
    assert "data_parallel=None" in refused["none"]
