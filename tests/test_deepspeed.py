"""The DeepSpeed target, run for real: ZeRO 1-3 on 2 gloo ranks (DeepSpeed's CPU accelerator).

Each run trains a tiny HF model (GPT-2 LM, BERT masked-LM) for a few `train_step`s through
`slapo.build(..., target="deepspeed")` and compares the losses and the final weights (gathered
from the ZeRO-3 partitions) with a one-process plain-PyTorch AdamW run on the same global
batches: same gradient accumulation split, same clipping. The jobs run on the session's
persistent 2-rank pool (`dist2`), so DeepSpeed adds no process launches.

DeepSpeed's CPU accelerator: `DS_ACCELERATOR=cpu` is set in every rank before deepspeed is first
imported (on a GPU machine DeepSpeed would otherwise pick CUDA and move the model there), and
`LOCAL_RANK` (which DeepSpeed requires; torchrun sets it) is the rank, all ranks being on one host.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import sys

import models
import pytest
import torch
from reference import LR, reference_losses

import slapo

HAS_DS = importlib.util.find_spec("deepspeed") is not None
needs_ds = pytest.mark.skipif(not HAS_DS, reason="needs deepspeed (the 'deepspeed' extra)")
CLIP = 0.5  # well below the tiny models' gradient norms (checked), so clipping acts
STEPS_SEEDS = (1, 2, 1)  # three steps; the repeated batch makes the loss fall


# ------------------------------------------------------------------------------------------------
# jobs (run on every rank of the pool)
# ------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _ds_rank_env():
    """DeepSpeed's CPU accelerator and the launcher variable it insists on (restored after the
    job: the pool's ranks serve other test files too)."""
    import torch.distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(dist.get_rank())
    try:
        from deepspeed.accelerator import get_accelerator

        name = get_accelerator().device_name()
        if name != "cpu":
            raise RuntimeError(f"DeepSpeed picked the {name!r} accelerator in this pool rank "
                               "(deepspeed was imported before DS_ACCELERATOR=cpu was set).")
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def _family(name: str):
    model = models.gpt2(seed=0) if name == "gpt2" else models.bert_mlm(seed=0)
    batches = []
    for s in STEPS_SEEDS:
        ids = models.ids(batch=4, seed=s)  # 2 ranks x grad_accum 2 slices of 1 sample
        labels = ids.clone()
        if name != "gpt2":  # masked-LM labels: each sample supervises a different count
            keep = torch.rand(ids.shape, generator=torch.Generator().manual_seed(s)) < 0.5
            labels[~keep] = -100
        batches.append({"input_ids": ids, "labels": labels})
    return model, batches


def _max_param_diff(state: dict, ref: torch.nn.Module) -> tuple[str, float]:
    worst = ("", 0.0)
    for name, p in ref.named_parameters():
        d = float((state[name].float() - p.detach()).abs().max())
        worst = max(worst, (name, d), key=lambda t: t[1])
    return worst


def _train(family: str, stage: int, *, grad_accum: int, grad_clip: float | None,
           extra: dict | None = None) -> dict:
    """One DeepSpeed run and its one-process reference (computed on this rank)."""
    model, batches = _family(family)
    ref = copy.deepcopy(model)
    mesh = slapo.runtime.init_mesh(dp=2)
    cfg = {"zero_optimization": {"stage": stage}, **(extra or {})}
    tm, opt = slapo.build(slapo.create_schedule(model, mesh=mesh), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": LR}, target="deepspeed", grad_accum=grad_accum,
                          grad_clip=grad_clip, deepspeed_config=cfg)
    losses = [tm.train_step(b) for b in batches]
    state = tm.state_dict()
    # one process on the whole batch: the token mean the split step must reproduce
    want = reference_losses(ref, batches, grad_clip=grad_clip)
    return {"losses": losses, "want": want, "worst": _max_param_diff(state, ref),
            "keys": sorted(state) == sorted(model.state_dict()) or sorted(state),
            "dtype": str(next(iter(tm.engine.module.parameters())).dtype),
            "stage": tm.engine.zero_optimization_stage(), "opt": type(opt).__name__,
            "config_reaches": tm.config is model.config, "load_refused": _load_refused(tm)}


def _load_refused(tm) -> bool:
    try:
        tm.load_state_dict({})
    except slapo.SchedulingError as e:
        return "master weights" in str(e)
    return False


def job_zero(stage: int) -> dict:
    """GPT-2 and BERT-MLM, accumulation 2, clipping at CLIP; plus the unclipped reference."""
    linear = torch.nn.functional.linear
    out = {}
    with _ds_rank_env():
        for family in ("gpt2", "bert_mlm"):
            out[family] = _train(family, stage, grad_accum=2, grad_clip=CLIP)
            out[family]["clip_effect"] = _clip_effect(family)
    # ZeRO-3's memory-efficient linear would have replaced it for the rest of the process
    out["linear_kept"] = torch.nn.functional.linear is linear
    return out


def _clip_effect(family: str) -> float:
    """How far clipping at CLIP moves the reference's final weights (so it is not a no-op)."""
    clipped, batches = _family(family)
    plain = copy.deepcopy(clipped)
    reference_losses(clipped, batches, grad_clip=CLIP)
    reference_losses(plain, batches)
    return _max_param_diff(dict(clipped.named_parameters()), plain)[1]


def job_bf16() -> dict:
    with _ds_rank_env():
        return {stage: _train("gpt2", stage, grad_accum=1, grad_clip=None,
                              extra={"bf16": {"enabled": True}}) for stage in (1, 2, 3)}


def _refusal(build_kwargs: dict, mesh=None, schedule=None) -> str:
    """The SchedulingError text of a refused build; the model must be left as it was."""
    model = models.gpt2(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sch = slapo.create_schedule(model, mesh=mesh)
    if schedule is not None:
        schedule(sch)
        before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        slapo.build(sch, **{"optimizer": torch.optim.AdamW, "target": "deepspeed",
                            **build_kwargs})
    except slapo.SchedulingError as e:
        after = model.state_dict()
        assert before.keys() == after.keys()
        for k, v in before.items():
            assert after[k].dtype == v.dtype and torch.equal(after[k], v), k
        return str(e)
    return "<not refused>"


def job_refusals() -> dict:
    with _ds_rank_env():
        return _refusals()


def _refusals() -> dict:
    from tp_schedules import gpt2_tp

    runtime = slapo.runtime
    dp, tp, pp = runtime.init_mesh(dp=2), runtime.init_mesh(tp=2), runtime.init_mesh(pp=2)
    out = {
        "tp_sharded": _refusal({}, mesh=tp, schedule=gpt2_tp),
        "no_mesh": _refusal({}),
        "pp_mesh": _refusal({}, mesh=pp),
        "pipeline_arg": _refusal({"pipeline": "1F1B"}, mesh=dp),
        "ddp": _refusal({"data_parallel": "ddp"}, mesh=dp),
        "device": _refusal({"device": "cuda"}, mesh=dp),
        "fp16": _refusal({"deepspeed_config": {"fp16": {"enabled": True}}}, mesh=dp),
        "accum_conflict": _refusal({"grad_accum": 2, "deepspeed_config":
                                    {"gradient_accumulation_steps": 4}}, mesh=dp),
        "clip_conflict": _refusal({"grad_clip": 1.0, "deepspeed_config":
                                   {"gradient_clipping": 0.5}}, mesh=dp),
    }
    out["no_optimizer"] = _refusal({"optimizer": None}, mesh=dp)
    local = os.environ.pop("LOCAL_RANK")
    try:
        out["no_local_rank"] = _refusal({}, mesh=dp)
    finally:
        os.environ["LOCAL_RANK"] = local
    return out


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

def _check_run(r: dict, *, loss_rtol: float, param_atol: float) -> None:
    torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(r["want"]),
                               rtol=loss_rtol, atol=0)
    name, diff = r["worst"]
    assert diff <= param_atol, f"{name} differs by {diff:.3g} from the plain AdamW run"
    assert r["keys"] is True, f"state_dict keys are not the model's: {r['keys']}"
    assert r["config_reaches"] and r["load_refused"]
    assert r["losses"][-1] < r["losses"][0]


@needs_ds
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_matches_plain_adamw(dist2, stage):
    res = dist2.run(job_zero, stage, timeout=300)
    assert res[0]["linear_kept"] and res[1]["linear_kept"]
    for family in ("gpt2", "bert_mlm"):
        r0, r1 = res[0][family], res[1][family]
        assert r0["losses"] == r1["losses"]  # every rank reports the same global loss
        assert r0["stage"] == stage and r0["dtype"] == "torch.float32", r0
        assert r0["opt"] == ("DeepSpeedZeroOptimizer_Stage3" if stage == 3
                             else "DeepSpeedZeroOptimizer")
        _check_run(r0, loss_rtol=1e-5, param_atol=1e-5)
        _check_run(r1, loss_rtol=1e-5, param_atol=1e-5)
        # clipping acted: it moves the weights far more than the tolerance
        assert r0["clip_effect"] > 10 * 1e-5, (family, r0["clip_effect"])


@needs_ds
def test_bf16_trains_with_bf16_weights_and_fp32_master(dist2):
    """bf16 on DeepSpeed's CPU accelerator: the module runs in bf16 (checked, so an ignored
    flag fails), the ZeRO optimizer keeps fp32 masters; close to fp32 within bf16 rounding."""
    res = dist2.run(job_bf16, timeout=300)
    for stage, r in res[0].items():
        assert r["dtype"] == "torch.bfloat16" and r["stage"] == stage
        _check_run(r, loss_rtol=2e-2, param_atol=2e-2)


@needs_ds
def test_refusals_are_clear_and_change_nothing(dist2):
    res = dist2.run(job_refusals, timeout=300)
    for r in res:
        assert "does not combine with Slapo tensor parallelism" in r["tp_sharded"]
        assert "create_schedule without a mesh" in r["no_mesh"]
        assert "does not run Slapo pipelines" in r["pp_mesh"]
        assert "does not run Slapo pipelines" in r["pipeline_arg"]
        assert "does its own data parallelism" in r["ddp"]
        assert "accelerator runs on 'cpu', but device is on 'cuda'" in r["device"]
        assert "enables fp16" in r["fp16"] and "'cpu' accelerator" in r["fp16"]
        assert "gradient_accumulation_steps" in r["accum_conflict"]
        assert "gradient_clipping" in r["clip_conflict"]
        assert "ZeRO stage 1 needs an optimizer" in r["no_optimizer"]
        assert "LOCAL_RANK" in r["no_local_rank"] and "torchrun" in r["no_local_rank"]


def test_deepspeed_not_importable_is_a_clear_error(monkeypatch):
    """Whether or not deepspeed is installed: a None entry in sys.modules makes `import
    deepspeed` raise ImportError, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    model = models.gpt2(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match="needs the deepspeed package") as e:
        slapo.build(sch, optimizer=torch.optim.AdamW, target="deepspeed", device="cpu")
    assert "DS_BUILD_OPS=0 pip install deepspeed" in str(e.value)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # what needs no deepspeed is still checked first
    with pytest.raises(slapo.SchedulingError, match="does not run Slapo pipelines"):
        slapo.build(sch, target="deepspeed", pipeline="1F1B")
    from slapo.compat.build import init_target_engine

    with pytest.raises(slapo.SchedulingError, match="needs the deepspeed package"):
        init_target_engine(model, target="deepspeed")


@needs_ds
def test_build_again_after_the_process_group_was_destroyed(deepspeed_one_rank, one_thread):
    """One process, torch.distributed initialised by DeepSpeed from the torchrun variables, torn
    down, and again: DeepSpeed's cached world-group clone must not outlive its process group."""
    import torch.distributed as dist

    model, batches = _family("gpt2")
    want = reference_losses(copy.deepcopy(model), batches[:2], grad_accum=2)
    for _ in range(2):
        deepspeed_one_rank()  # a fresh MASTER_PORT for each process group
        tm, _ = slapo.build(slapo.create_schedule(copy.deepcopy(model)),
                            optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                            target="deepspeed", grad_accum=2)
        got = [tm.train_step(b) for b in batches[:2]]
        # DeepSpeed's CPU shared-memory all-reduce (inference only) was not JIT-built: a 2-min
        # C++ compile per fresh install (see slapo.runtime.deepspeed._no_inference_shm_build)
        assert __import__("deepspeed").comm.comm.cdb.shm_comm_op is None
        dist.destroy_process_group()
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    import importlib  # the builder is DeepSpeed's own again after initialize

    assert importlib.import_module("deepspeed.comm.torch").build_shm_op.__name__ == "build_shm_op"


@needs_ds
def test_2023_loop_backward_and_step_reach_the_engine(deepspeed_one_rank, one_thread):
    """A 2023 script drives the engine itself: loss = model(...); model.backward(loss);
    model.step(). Those calls reach DeepSpeed's engine and train like plain AdamW."""
    model, batches = _family("gpt2")
    want = reference_losses(copy.deepcopy(model), batches[:2])
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, target="deepspeed")
    got = []
    for b in batches[:2]:
        loss = tm(**b).loss
        tm.backward(loss)
        tm.step()
        got.append(float(loss))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)


def test_no_grad_clip_means_no_clipping_not_deepspeeds_default():
    """DeepSpeed clips at 1.0 unless told otherwise; build(grad_clip=None) means no clipping
    on every target, and a config's own value (the 2023 way) is kept."""
    from slapo.runtime.deepspeed import complete_config
    from slapo.runtime.train_step import StepConfig

    assert complete_config({}, StepConfig(None))["gradient_clipping"] == 0.0
    assert complete_config({"gradient_clipping": 0.5}, StepConfig(None))[
        "gradient_clipping"] == 0.5
    assert complete_config({}, StepConfig(None, grad_clip=2.0))["gradient_clipping"] == 2.0
