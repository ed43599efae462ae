"""Pipeline parallelism through torch.distributed.pipelining, on real gloo ranks.

Every job trains the pipelined model and, on each rank, a single-process copy of the same model
on the same batches; the losses (and afterwards the parameters each rank holds) must agree.
"""

from __future__ import annotations

import copy

import pytest
import torch
from reference import LR, make_batches, reference_losses

from slapo.runtime.split_backward import SPLIT_BACKWARD, split_backward_is_exact

pytestmark = pytest.mark.dist



# ------------------------------------------------------------------------------------------------
# helpers (run on every rank)
# ------------------------------------------------------------------------------------------------

def cut(sch, path: str) -> None:
    sch[path].cut_pipeline_stage()


def gpt2_loss(outputs, batch):
    """Next-token cross-entropy written by hand (checks that loss_fn sees logits and labels)."""
    logits = outputs.logits[:, :-1]
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1))


def compare_params(tm, ref, rtol=1e-4, atol=1e-5) -> int:
    """Every parameter this rank holds equals the reference's (by original name).

    atol 1e-5 is 100x below one AdamW step (lr 1e-3), so any wrong gradient shows; it is above
    the roundoff a gradient that is zero in exact arithmetic gets (GPT-2's key bias: softmax is
    invariant to it), which Adam turns into tiny, arbitrary-sign updates (seen: 2.7e-6)."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    n = 0
    for stage in tm.stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=rtol,
                                       atol=atol, msg=lambda m, name=name: f"{name}: {m}")
            n += 1
    assert n > 0
    return n


# ------------------------------------------------------------------------------------------------
# jobs
# ------------------------------------------------------------------------------------------------

def job_pp_gpt2():
    """PP=2 on a 4-layer GPT-2: GPipe (+ grad accumulation), 1F1B (+ custom loss, clipping),
    and the multi-stage schedules with 2 virtual stages per rank (=> 4 stages): Interleaved1F1B,
    ZBVZeroBubble, LoopedBFS, InterleavedZeroBubble, DualPipeV."""
    import models

    import slapo
    import slapo.runtime

    rank = torch.distributed.get_rank()
    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    cases = [
        ("GPipe", {"num_microbatches": 2, "grad_accum": 2}, ["transformer.h.1"]),
        ("1F1B", {"num_microbatches": 4, "grad_clip": 0.5, "loss_fn": gpt2_loss},
         ["transformer.h.2"]),
        ("Interleaved1F1B", {"num_microbatches": 4},
         ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
        ("ZBVZeroBubble", {"num_microbatches": 4},
         ["transformer.h.0", "transformer.h.1", "transformer.h.2"]),
    ] + [(name, {"num_microbatches": 4}, ["transformer.h.0", "transformer.h.1", "transformer.h.2"])
         for name in ("LoopedBFS", "InterleavedZeroBubble", "DualPipeV")]
    out = {}
    batches = make_batches()
    for name, kw, cuts in cases:
        model = models.gpt2(seed=0, layers=4)
        ref = copy.deepcopy(model)
        sch = slapo.create_schedule(model, mesh=mesh)
        for c in cuts:
            cut(sch, c)
        if name in SPLIT_BACKWARD and not split_backward_is_exact():  # torch < 2.13
            with pytest.raises(slapo.SchedulingError, match="180952"):
                slapo.build(sch, optimizer=torch.optim.AdamW, pipeline=name, **kw)
            out[name] = {"refused": True, "held": []}
            continue
        tm, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                              pipeline=name, **kw)
        assert isinstance(tm, slapo.runtime.built_model.PipelineTrainModule)
        assert len(tm.stages) == (2 if len(cuts) == 3 else 1)
        # this rank holds only its stages' layers
        held = {n.split(".")[2] for st in tm.stages for n, _ in st.named_parameters()
                if n.startswith("transformer.h.")}
        assert 0 < len(held) < 4, held
        losses = [tm.train_step(b) for b in batches]
        ref_losses = reference_losses(ref, batches, grad_accum=kw.get("grad_accum", 1),
                                      grad_clip=kw.get("grad_clip"), loss_fn=kw.get("loss_fn"))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m, name=name: f"{name}: {m}")
        assert losses[-1] < losses[0]
        # eval_step: the trained model's eval-mode loss, gradients untouched (the V-shaped
        # schedules evaluate through `step` with a zero-weighted backward)
        grads = [None if p.grad is None else p.grad.clone() for p in tm.parameters()]
        ref.eval()
        with torch.no_grad():
            ref_out = ref(**batches[0])
            want = (kw["loss_fn"](ref_out, batches[0]) if "loss_fn" in kw else
                    ref_out.loss).item()
        ref.train()
        assert tm.eval_step(batches[0]) == pytest.approx(want, rel=1e-5), name
        for p, g in zip(tm.parameters(), grads, strict=True):
            assert (p.grad is None and g is None) or torch.equal(p.grad, g), name
        n = compare_params(tm, ref)
        out[name] = {"losses": losses, "n_params": n, "held": sorted(held), "rank": rank}
    return out


def job_pp_llama_four_ranks():
    """4 ranks, LLaMA, 1F1B: TP=2 x PP=2 (TP inside each stage), then FSDP2 DP=2 x PP=2 (each
    stage fully_shard-ed over dp, + accumulation); losses equal single-process training."""
    import models
    import tp_schedules

    import slapo
    import slapo.runtime

    out = {}
    for name, sizes, kw in (("tp2xpp2", {"tp": 2}, {}),
                            ("fsdp2xpp2", {"dp": 2}, {"data_parallel": "fsdp",
                                                      "grad_accum": 2})):
        mesh = slapo.runtime.init_mesh(pp=2, **sizes)
        model = models.llama(seed=0, layers=4)
        ref = copy.deepcopy(model)
        sch = slapo.create_schedule(model, mesh=mesh)
        assert sch.world_size == sizes.get("tp", 1)
        if "tp" in sizes:
            tp_schedules.llama_tp(sch)
        cut(sch, "model.layers.1")
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                            pipeline="1F1B", num_microbatches=2, grad_clip=1.0, **kw)
        batches = make_batches(batch=8)
        losses = [tm.train_step(b) for b in batches]
        ref_losses = reference_losses(ref, batches, grad_clip=1.0)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5,
                                   atol=0, msg=lambda m, name=name: f"{name}: {m}")
        out[name] = losses
    return out


def job_pp_delayed_init():
    """A meta-device model pipelined: each rank materialises only its stages, with exactly the
    values the whole model gets (the tied embedding/LM head too, on the rank with only the
    head), and then trains like the single-process model."""
    import models

    import slapo
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    with slapo.init_empty_weights():
        model = models.gpt2(seed=0, layers=4)
    sch = slapo.create_schedule(model, mesh=mesh)
    cut(sch, "transformer.h.1")
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        pipeline="1F1B", num_microbatches=2, seed=3, device="cpu")
    with slapo.init_empty_weights():
        full = models.gpt2(seed=0, layers=4)
    ref, _ = slapo.build(slapo.create_schedule(full), seed=3, device="cpu")
    n = compare_params(tm, ref, rtol=0, atol=0)
    # layers of the other stage stay unallocated on this rank
    rank = torch.distributed.get_rank()
    other = model.transformer.h[3 if rank == 0 else 0]
    assert all(p.device.type == "meta" for p in other.parameters())
    # each rank's state dict has the full model's keys for its stages; together, all of them
    keys = list(tm.state_dict())
    everyone = [None, None]
    torch.distributed.all_gather_object(everyone, keys)
    assert set(everyone[0]) | set(everyone[1]) == set(ref.state_dict()), "keys lost"
    assert set(everyone[0]) != set(everyone[1])
    batches = make_batches()
    losses = [tm.train_step(b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses),
                               torch.tensor(reference_losses(ref, batches)), rtol=1e-5, atol=0)
    # loading a full (original-key) state dict restores this rank's stages exactly
    tm.load_state_dict(ref.state_dict())
    compare_params(tm, ref, rtol=0, atol=0)
    return {"n_params": n, "losses": losses}


def job_pp_bad_inputs():
    """Wrong cut count, micro-batches not dividing the batch, unknown schedule: clear errors."""
    import models

    import slapo
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    msgs = {}

    def expect(key, fn, *needles):
        try:
            fn()
        except slapo.SchedulingError as e:
            for needle in needles:
                assert needle in str(e), (key, str(e))
            msgs[key] = str(e)
        else:
            raise AssertionError(f"{key}: no error")

    sch = slapo.create_schedule(models.gpt2(layers=4), mesh=mesh)
    cut(sch, "transformer.h.1")
    expect("cuts", lambda: slapo.build(sch, optimizer=torch.optim.AdamW,
                                       pipeline="Interleaved1F1B"), "1 pipeline cut", "4 stages")
    expect("schedule", lambda: slapo.build(sch, pipeline="NoSuchSchedule"), "unknown pipeline")
    expect("no-pipeline", lambda: slapo.build(sch), "pp=2")
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, pipeline="1F1B", num_microbatches=4)
    ids = models.ids(batch=6)
    expect("microbatches", lambda: tm.train_step({"input_ids": ids, "labels": ids}),
           "6 samples", "num_microbatches=4")
    # the pool is still usable afterwards: a correct step runs on both ranks
    ids = models.ids(batch=4)
    loss = tm.train_step({"input_ids": ids, "labels": ids})
    return {"msgs": msgs, "loss": loss}


# ------------------------------------------------------------------------------------------------
# tests
# ------------------------------------------------------------------------------------------------

def job_pp_shapes_change(name: str):
    """Batches whose shapes change between steps (sequence length, batch size, an eval of the
    whole batch after `grad_accum` slices): torch before 2.13 inferred a stage's shapes once
    and then refused (first stage) or received into stale buffers (the others)."""
    import models

    import slapo
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=1, pp=2, tp=1)
    model = models.gpt2(seed=0, layers=4)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    cuts = ["transformer.h.1"] if name in ("1F1B", "GPipe") else \
        ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    for c in cuts:
        cut(sch, c)
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        pipeline=name, num_microbatches=2, grad_accum=2)
    batches = [make_batches(batch=b, seq=s, seed=20 + i)[0]
               for i, (b, s) in enumerate([(8, 16), (8, 8), (4, 16), (8, 16)])]
    losses = [tm.train_step(b) for b in batches]
    whole = copy.deepcopy(ref)  # trains the same 4 steps and a fifth
    want = reference_losses(ref, batches, grad_accum=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
    ref.eval()
    for b in batches[:2]:  # whole batches: micro-batches of 4, training's were 2
        with torch.no_grad():
            expect = ref(**b).loss.item()
        assert tm.eval_step(b) == pytest.approx(expect, rel=1e-5), name
    losses.append(tm.train_step(batches[0]))  # training again, at the first shapes
    want = reference_losses(whole, batches + batches[:1], grad_accum=2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0)
    compare_params(tm, whole)
    return losses


@pytest.mark.parametrize("name", ["1F1B", "Interleaved1F1B"])
def test_pipeline_batch_shapes_may_change_between_steps(dist2, name):
    ranks = dist2.run(job_pp_shapes_change, name, timeout=300)
    assert ranks[0] == ranks[1]


def test_pipeline_schedules_match_single_process(dist2):
    res = dist2.run(job_pp_gpt2, timeout=300)
    assert len(res[0]) == 7
    for name in res[0]:
        if res[0][name].get("refused"):  # a zero-bubble schedule on torch < 2.13, both ranks
            assert res[1][name].get("refused") and name in SPLIT_BACKWARD, name
            continue
        assert res[0][name]["losses"] == res[1][name]["losses"]
        # the two ranks hold different layers
        assert not set(res[0][name]["held"]) & set(res[1][name]["held"]), name


def test_pipeline_delayed_init_materialises_only_own_stages(dist2):
    res = dist2.run(job_pp_delayed_init)
    assert res[0]["losses"] == res[1]["losses"]
    assert res[0]["n_params"] > 0 and res[1]["n_params"] > 0


def test_pipeline_bad_inputs_fail_on_every_rank(dist2):
    res = dist2.run(job_pp_bad_inputs)
    assert res[0]["loss"] == res[1]["loss"]
    assert set(res[0]["msgs"]) == {"cuts", "schedule", "no-pipeline", "microbatches"}


def test_tp_x_pp_and_fsdp_x_pp_llama_four_ranks(dist4):
    res = dist4.run(job_pp_llama_four_ranks, timeout=300)
    assert all(r == res[0] for r in res)
