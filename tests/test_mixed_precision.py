"""Mixed precision end to end: `build(..., mixed_precision=...)`, `Verify` under bf16, the CLI.

References are hand-written autocast loops (fp32 weights, forward + loss under
`torch.autocast`, backward outside it). Distributed runs (TP, DDP, FSDP2, 1F1B) on 2 real gloo
ranks must match the one-process bf16 loop within bf16 roundoff, measured on the same model: a
run is accepted when it is no further from the one-process bf16 losses than a multiple of the
distance between the one-process bf16 and fp32 losses.
"""

from __future__ import annotations

import copy

import models
import pytest
import torch
from reference import LR, hidden_loss, make_batches

import slapo
from slapo.runtime.precision import Precision

BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------------
# references and probes (also run inside the rank jobs)
# ------------------------------------------------------------------------------------------------

def autocast_losses(model, batches, dtype=BF16, *, grad_clip=None, scaler=None):
    """The hand-written mixed-precision loop (AdamW, fp32 master weights)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model(**batch).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(loss.item())
    return losses


def matmul_output_dtypes(module: torch.nn.Module) -> set:
    """Record the output dtypes of every Linear/Conv1D (the matmuls autocast lowers)."""
    seen: set = set()

    def hook(mod, args, out):
        seen.add(out.dtype)

    for m in module.modules():
        if type(m).__name__ in ("Linear", "Conv1D"):
            m.register_forward_hook(hook)
    return seen


def assert_bf16_close(got, want, fp32, factor=4.0, what=""):
    """|got - want| <= factor * |want - fp32| + tiny, per step (the test's bf16 tolerance)."""
    got, want, fp32 = (torch.tensor(x, dtype=torch.float64) for x in (got, want, fp32))
    d = (want - fp32).abs().max().item()
    err = (got - want).abs().max().item()
    assert d > 0, f"{what}: bf16 and fp32 gave identical losses: autocast had no effect"
    assert err <= factor * d + 1e-6, f"{what}: max loss error {err:.3e} > {factor} x {d:.3e}"
    return err, d


def check_fp32_master(tm, opt) -> None:
    """Parameters, gradients and optimizer moments stay fp32 under mixed precision."""
    for p in tm.parameters():
        assert p.dtype == torch.float32, p.dtype
        assert p.grad is None or p.grad.dtype == torch.float32, p.grad.dtype
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0:
                assert v.dtype == torch.float32, v.dtype


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------

def _mlm_batch(ids):
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert_mlm"])
def test_bf16_build_trains_with_fp32_master_weights(family):
    model = getattr(models, family)(seed=0)
    dtypes = matmul_output_dtypes(model)
    tm, opt = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": 3e-3}, mixed_precision="bf16", grad_clip=1.0)
    assert tm.precision.name == "bf16" and tm.precision.scaler is None
    batch = _mlm_batch(models.ids(batch=4, seq=16))
    losses = [tm.train_step(batch) for _ in range(6)]
    assert dtypes == {BF16}, dtypes            # every matmul ran in bf16 ...
    check_fp32_master(tm, opt)                 # ... on fp32 weights, grads and moments
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert losses[-1] < losses[0] - 0.1, losses


def test_bf16_build_equals_hand_written_autocast_loop_bit_for_bit():
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, mixed_precision="bf16")
    batches = make_batches()
    got = [tm.train_step(b) for b in batches]
    want = autocast_losses(ref, batches)
    assert got == want
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), n
    fp32 = autocast_losses(models.gpt2(seed=0), batches, dtype=None)
    assert got != fp32  # bf16 really changed the numbers


def test_bf16_loss_from_the_model_is_accepted():
    """A loss_fn returning a bf16 loss trains exactly like its fp32 upcast."""
    def bf16_loss(outputs, batch):
        return outputs.logits.pow(2).mean().to(BF16)

    runs = []
    for fn in (bf16_loss, lambda o, b: bf16_loss(o, b).float()):
        model = models.llama(seed=0)
        tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                            optimizer_kwargs={"lr": 0.1}, mixed_precision="bf16", loss_fn=fn)
        runs.append(([tm.train_step((models.ids(batch=2),)) for _ in range(2)],
                     [p.detach().clone() for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))


def test_fp16_grad_scaler_matches_hand_written_loop():
    """CPU autocast supports float16 in this torch, so fp16 runs for real: scaled loss, unscale
    before clipping, scaler step and update, exactly as torch.amp.GradScaler by hand."""
    model = models.gpt2(seed=0)
    ref = copy.deepcopy(model)
    tm, opt = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": LR}, mixed_precision="fp16", grad_clip=1.0)
    assert isinstance(tm.precision.scaler, torch.amp.GradScaler)
    dtypes = matmul_output_dtypes(model)
    batches = make_batches()
    got = [tm.train_step(b) for b in batches]
    want = autocast_losses(ref, batches, torch.float16, grad_clip=1.0,
                           scaler=torch.amp.GradScaler("cpu"))
    assert dtypes == {torch.float16}
    check_fp32_master(tm, opt)
    # the norm is computed in fp64 by slapo (torch's clip in fp32): equal to roundoff
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0)
    assert tm.precision.skipped_steps == 0 and tm.precision.scaler.get_scale() == 2.0 ** 16


def test_fp16_overflow_skips_the_step_and_backs_off():
    model = models.gpt2(seed=0)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, mixed_precision="fp16")
    state = tm.precision.state_dict()
    state["scaler"]["scale"] = 2.0 ** 120     # fp16 gradients overflow at this scale
    tm.precision.load_state_dict(state)
    before = [p.detach().clone() for p in model.parameters()]
    loss = tm.train_step(make_batches()[0])
    assert torch.isfinite(torch.tensor(loss))  # the reported loss is unscaled
    assert tm.precision.last_step_skipped and tm.precision.skipped_steps == 1
    assert tm.precision.scaler.get_scale() == 2.0 ** 119
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert tm.precision.state_dict()["skipped_steps"] == 1


@pytest.mark.parametrize("bad", ["bfloat16", "float16", 16, torch.bfloat16, "BF16"])
def test_bad_mixed_precision_is_refused_before_anything_changes(bad):
    model = models.gpt2(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    forward = model.forward
    with pytest.raises(slapo.SchedulingError, match=r"mixed_precision=.*'bf16'.*'fp16'"):
        slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                    mixed_precision=bad, device="cpu")
    assert model.forward == forward and "forward" not in vars(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_mixed_precision_argument_combinations():
    model = models.gpt2(seed=0)
    with pytest.raises(slapo.SchedulingError, match="DeepSpeed manages precision"):
        slapo.build(slapo.create_schedule(model), mixed_precision="bf16", target="deepspeed")
    # "fp32" and None are the same: no autocast, no scaler, the fp32 numbers
    for off in (None, "fp32"):
        tm, _ = slapo.build(slapo.create_schedule(models.gpt2(seed=0)),
                            optimizer=torch.optim.SGD, mixed_precision=off)
        assert tm.precision.name == "fp32" and tm.precision.dtype is None
    with pytest.raises(slapo.SchedulingError, match="mp_tolerance"):
        slapo.Verify(slapo.create_schedule(model), mp_tolerance=0)
    with pytest.raises(slapo.SchedulingError, match="mixed_precision='half'"):
        slapo.Verify(slapo.create_schedule(model), mixed_precision="half")
    with pytest.raises(slapo.SchedulingError, match="no autocast"):
        from slapo.runtime.precision import check_autocast

        check_autocast("bf16", "meta")


def test_precision_is_a_no_op_in_fp32():
    p = Precision()
    loss = torch.ones((), requires_grad=True)
    assert p.loss_for_backward(loss) is loss
    m = torch.nn.Linear(2, 2)
    assert p.wrap_forward(m) is m and "forward" not in vars(m)
    assert p.fsdp_policy() is None
    assert p.state_dict() == {"precision": "fp32", "skipped_steps": 0}


def test_verify_bf16_single_process_passes_and_reports_tolerances():
    model = models.gpt2(seed=0)
    sch = slapo.create_schedule(model)
    v = slapo.Verify(sch, example_inputs=[models.ids(batch=2)], mixed_precision="bf16",
                     loss_fn=lambda out: out.logits.float().pow(2).mean())
    with v:
        sch["transformer.h.0"].checkpoint()
    assert v.tolerance and set(v.tolerance) == set(v.report) == set(v.baseline)
    assert v.baseline["output.logits"] > 0     # bf16 was in effect for the original ...
    assert v.tolerance["output.logits"] == pytest.approx(4 * v.baseline["output.logits"])
    # ... and the scheduled model, run the same way, lands within its roundoff
    assert v.report["output.logits"] <= v.tolerance["output.logits"]


# ------------------------------------------------------------------------------------------------
# 2 gloo ranks
# ------------------------------------------------------------------------------------------------

def _mesh_case(name):
    """(mesh sizes, build kwargs, schedule fn) of one parallel configuration."""
    import tp_schedules

    return {
        "tp": ({"tp": 2}, {"grad_clip": 1.0}, tp_schedules.gpt2_tp),
        "ddp": ({"dp": 2}, {"data_parallel": "ddp", "grad_clip": 1.0}, None),
        "fsdp": ({"dp": 2}, {"data_parallel": "fsdp", "grad_clip": 1.0}, None),
        "1f1b": ({"pp": 2}, {"pipeline": "1F1B", "num_microbatches": 2, "grad_clip": 1.0},
                 lambda sch: sch["transformer.h.0"].cut_pipeline_stage()),
    }[name]


def job_bf16_parallel(names):
    """Each configuration in bf16 on 2 ranks: autocast in effect, fp32 master weights, and the
    losses of the one-process bf16 loop within bf16 roundoff."""
    import slapo.runtime

    batches = make_batches()
    want = autocast_losses(models.gpt2(seed=0, layers=2), batches, grad_clip=1.0)
    fp32 = autocast_losses(models.gpt2(seed=0, layers=2), batches, dtype=None, grad_clip=1.0)
    out = {}
    for name in names:
        sizes, kw, schedule = _mesh_case(name)
        mesh = slapo.runtime.init_mesh(**sizes)
        model = models.gpt2(seed=0, layers=2)
        dtypes, weight_dtypes = matmul_output_dtypes(model), set()
        model.transformer.h[-1].mlp.c_fc.register_forward_hook(
            lambda mod, args, o, seen=weight_dtypes: seen.add(mod.weight.dtype))
        sch = slapo.create_schedule(model, mesh=mesh)
        if schedule:
            schedule(sch)
        tm, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                              mixed_precision="bf16", **kw)
        losses = [tm.train_step(b) for b in batches]
        # (TP: row-parallel layers add their bias after the matmul, in fp32, so their output
        # and its all-reduce are fp32; the matmul itself still runs in bf16)
        assert dtypes == ({BF16, torch.float32} if name == "tp" else {BF16}), (name, dtypes)
        # FSDP2's MixedPrecisionPolicy gathers bf16 weights; the others cast under autocast
        assert weight_dtypes == ({BF16} if name == "fsdp" else {torch.float32}) or (
            name == "1f1b" and not weight_dtypes), weight_dtypes  # rank 0 lacks that layer
        check_fp32_master(tm, opt)
        err, d = assert_bf16_close(losses, want, fp32, what=name)
        out[name] = {"losses": losses, "err": err, "bf16_vs_fp32": d}
    return out


def job_fp16_pipeline_vote():
    """fp16 through a 1F1B pipeline: the rank without the loss still scales/unscales, and an
    overflow on one rank only (rank 1's stage) skips the step on both ranks."""
    import slapo.runtime

    rank = torch.distributed.get_rank()
    mesh = slapo.runtime.init_mesh(pp=2)
    batches = make_batches()
    model = models.gpt2(seed=0, layers=2)
    ref = copy.deepcopy(model)
    sch = slapo.create_schedule(model, mesh=mesh)
    sch["transformer.h.0"].cut_pipeline_stage()
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        mixed_precision="fp16", pipeline="1F1B", num_microbatches=2,
                        grad_clip=1.0)
    losses = [tm.train_step(b) for b in batches[:3]]
    want = autocast_losses(ref, batches[:3], torch.float16, grad_clip=1.0,
                           scaler=torch.amp.GradScaler("cpu"))
    fp32 = autocast_losses(models.gpt2(seed=0, layers=2), batches[:3], dtype=None)
    assert_bf16_close(losses, want, fp32, what="fp16 1f1b")
    assert tm.precision.skipped_steps == 0
    # poison one gradient on rank 1 only
    if rank == 1:
        def poison(q):
            q.grad.fill_(float("inf"))

        next(tm.stages[0].parameters()).register_post_accumulate_grad_hook(poison)
    before = [p.detach().clone() for p in tm.parameters()]
    scale = tm.precision.scaler.get_scale()
    tm.train_step(batches[3])
    assert tm.precision.last_step_skipped and tm.precision.skipped_steps == 1, rank
    assert tm.precision.scaler.get_scale() == scale / 2
    assert all(torch.equal(p, q) for p, q in zip(tm.parameters(), before, strict=True)), rank
    return {"losses": losses, "scale": tm.precision.scaler.get_scale()}


def _verify_tp_bert(skip_sync, mixed_precision):
    import tp_schedules

    model = models.bert(seed=0)
    sch = slapo.create_schedule(model)
    v = slapo.Verify(sch, example_inputs=[models.ids(batch=2, seq=16)],
                     loss_fn=lambda out: hidden_loss(out.last_hidden_state.float()),
                     mixed_precision=mixed_precision)
    try:
        with v:
            tp_schedules.bert_tp(sch, skip_sync=skip_sync)
    except slapo.VerificationError as e:
        return str(e)
    return None


def job_verify_bf16_catches_missing_all_reduce():
    """Row-parallel attention output of BERT sharded over 2 ranks: with its all-reduce the
    schedule passes Verify under bf16; without it (each rank keeps a partial sum) it fails,
    although bf16 roundoff is much larger than fp32's."""
    return {"correct": _verify_tp_bert(None, "bf16"),
            "missing": _verify_tp_bert("attention_out", "bf16")}


@pytest.mark.dist
def test_bf16_tp_ddp_fsdp_1f1b_match_one_process(dist2):
    results = dist2.run(job_bf16_parallel, ["tp", "ddp", "fsdp", "1f1b"])
    for name in ("tp", "ddp", "fsdp", "1f1b"):
        assert results[0][name]["losses"] == results[1][name]["losses"], name


@pytest.mark.dist
def test_fp16_pipeline_scaler_and_overflow_vote(dist2):
    results = dist2.run(job_fp16_pipeline_vote)
    assert results[0] == results[1]


@pytest.mark.dist
def test_verify_bf16_catches_a_missing_all_reduce(dist2):
    for result in dist2.run(job_verify_bf16_catches_missing_all_reduce):
        assert result["correct"] is None, result["correct"]
        assert result["missing"] is not None and "under bf16" in result["missing"], result


# ------------------------------------------------------------------------------------------------
# slapo train --precision / --device
# ------------------------------------------------------------------------------------------------

TINY = ["--hidden-size", "32", "--num-layers", "2", "--num-heads", "2", "--seq-len", "32",
        "--batch-size", "4", "--no-progress", "--no-plot", "--eval-batches", "1",
        "--device", "cpu"]


def _train(out, *flags):
    import json

    from slapo.cli import main

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", *TINY, "--out", str(out), *flags]) == 0
    finally:
        torch.set_num_threads(n)
    return json.loads((out / "metrics.json").read_text())


def test_cli_precision_trains_logs_and_resumes_fp16_exactly(tmp_path, capsys):
    import json

    fp32 = _train(tmp_path / "fp32", "--steps", "4")
    bf16 = _train(tmp_path / "bf16", "--steps", "4", "--precision", "bf16")
    assert "precision bf16 (autocast, fp32 master weights)" in capsys.readouterr().out
    assert fp32["precision"] == "fp32" and bf16["precision"] == "bf16"
    assert bf16["config"]["device"] == "cpu" and bf16["device"] == "cpu"
    assert bf16["losses"] != fp32["losses"]                       # bf16 was in effect
    torch.testing.assert_close(torch.tensor(bf16["losses"]), torch.tensor(fp32["losses"]),
                               rtol=2e-2, atol=0)                  # ... and trains the same
    # fp16: the loss scale is checkpointed, so a resumed run continues bit for bit
    straight = _train(tmp_path / "a", "--steps", "4", "--precision", "fp16", "--save-every", "2")
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    saved = json.loads((step2 / "trainer.json").read_text())["precision"]
    assert saved["precision"] == "fp16" and saved["scaler"]["scale"] == 2.0 ** 16
    resumed = _train(tmp_path / "b", "--steps", "4", "--precision", "fp16", "--resume",
                     str(step2))
    assert resumed["losses"] == straight["losses"] and resumed["skipped_steps"] == 0


def test_cli_precision_from_toml_and_bad_values(tmp_path, capsys):
    from slapo.cli import main, parse_train_args

    cfg = tmp_path / "run.toml"
    cfg.write_text('[run]\nprecision = "bf16"\ndevice = "cpu"\n')
    parsed = parse_train_args(["--config", str(cfg)])
    assert (parsed.precision, parsed.device, parsed.training.precision) == ("bf16", "cpu", "bf16")
    assert parse_train_args([]).precision == "fp32"
    cfg.write_text('precision = "half"\n')
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(cfg)])
    assert e.value.code == 2
    assert "--precision must be one of fp32, bf16, fp16, fp8, got 'half'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--device", "tpu"])
    assert "invalid choice: 'tpu'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["train", "--device", "cuda"])
        assert "no CUDA device is available" in capsys.readouterr().err


# the ready GPU schedule's knobs that change numerics under bf16 (kernels' CPU fallbacks, the
# fused loss, SDPA) for every family that has them, not only GPT-2's
BF16_FAMILIES = ["gpt2", "gpt_neo", "opt", "llama", "qwen2", "qwen3", "bert_mlm", "roberta",
                 "albert", "t5", "t5_gated"]


@pytest.mark.parametrize("family", BF16_FAMILIES)
def test_bf16_ready_schedule_tracks_the_models_own_autocast(family):
    """`model_schedule.apply(attention="sdpa", kernels=True, fused_loss=True)` built with
    `mixed_precision="bf16"` trains like the unscheduled model in a hand-written autocast loop:
    within 4x the distance between that loop's bf16 and fp32 losses, on every family (a
    kernel that rounded where HF does not, or a loss left in bf16, shows as a larger gap);
    weights, gradients and moments stay fp32."""
    from slapo import model_schedule

    make = getattr(models, family)
    batch = models.batch_for(family, batch=4, seq=16)
    batches = [batch] * 4
    want = autocast_losses(make(seed=0), batches)
    fp32 = autocast_losses(make(seed=0), batches, dtype=None)
    model = make(seed=0)
    model_schedule.apply(model, attention="sdpa", kernels=True, fused_loss=True)
    tm, opt = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                          optimizer_kwargs={"lr": LR}, mixed_precision="bf16")
    got = [tm.train_step(batch) for batch in batches]
    assert_bf16_close(got, want, fp32, what=family)
    check_fp32_master(tm, opt)
