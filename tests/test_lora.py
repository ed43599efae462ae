"""PEFT's LoRA through the ready schedules: a `PeftModel` under tp=2 (DDP, FSDP2 over dp=2) trains
exactly as PEFT's LoRA does on one process, for GPT-2 (fused q|k|v Conv1D), LLaMA (GQA),
Qwen3 (per-head norms), BERT (post-LN encoder) and OLMo-2 (no hand-written family: the plan its
config declares); and through pipeline stages (pp=2, tp=2 x pp=2) for GPT-2, LLaMA, Qwen3,
RoBERTa and BERT.

Compared per family: the first step's loss, every adapter gradient, every adapter after two
AdamW steps at lr 1e-2 (relative error <= 1e-5), the frozen base bit-identical after training,
no optimizer state or DDP reduction for it. Mutations (row reduction skipped, B not split, A's
gradient not summed) must break the comparison. Bad input is refused before any change.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

pytest.importorskip("peft")
pytestmark = pytest.mark.dist

FAMILIES = ("gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "bert", "roberta",
            "t5")
DECODER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DECLARED = "olmo2"  # scheduled from its config's base_model_tp_plan (hf_plan.py)
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "llama": DECODER, "qwen3": DECODER,
           "bert": ["query", "key", "value", "dense"],  # BERT's "dense": the pooler's too
           "gpt_neo": ["q_proj", "k_proj", "v_proj", "out_proj", "c_fc", "c_proj"],
           "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
           "mistral": DECODER, "qwen2": DECODER,
           "roberta": ["query", "key", "value", "dense"],  # the MLM head's dense: unsharded
           "t5": ["q", "k", "v", "o", "wi", "wo"],
           DECLARED: DECODER}
LR, TOL = 1e-2, 1e-5


# ---- jobs (every rank) ----------------------------------------------------------------------

def peft_model(family: str, dtype=torch.float32, **lora):
    """The tiny model wrapped by PEFT, with B drawn too (PEFT starts B at zero, which would
    leave A's first gradient zero and untested)."""
    import models
    import peft

    if family == DECLARED:  # no hand-written family: the plan its config declares
        import hf_tiny

        model = hf_tiny.build("olmo2", "Olmo2ForCausalLM", seed=0)
    else:
        model = getattr(models, family)(seed=0)
    cfg = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS[family])
    pm = peft.get_peft_model(model, peft.LoraConfig(**{**cfg, **lora}))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm.to(dtype)


def _batch(family: str) -> dict:
    import models

    ids = models.ids(batch=4, seq=8)
    return {"input_ids": ids} if family == "bert" else {"input_ids": ids, "labels": ids}


def _loss_fn(family: str):
    if family == "bert":
        return lambda out, batch: out.last_hidden_state.pow(2).mean() + \
            out.pooler_output.pow(2).mean()
    return None


def _full(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a TP shard (its spec on the parameter) or an FSDP2 DTensor."""
    from torch.distributed.tensor import DTensor

    from slapo.sharding import gather_full, shard_spec

    return t.full_tensor() if isinstance(t, DTensor) else gather_full(t, shard_spec(like))


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _reference(ref, family: str, batch: dict, steps: int = 2):
    """PEFT's LoRA on one process: losses, first-step gradients, the adapters after `steps`."""
    params = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    fn = _loss_fn(family)
    losses, grads = [], None
    for _ in range(steps):
        opt.zero_grad()
        out = ref(**batch)
        loss = fn(out, batch) if fn else out.loss
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def compare(family: str, dtype=torch.float32, mesh=None, data_parallel=None, mutate=None,
            steps: int = 2, knobs: dict | None = None) -> dict:
    """Schedule and build the PEFT model (tp over the world, or DDP over `mesh`), train `steps`
    steps next to PEFT's reference and return the worst relative errors."""
    import slapo
    from slapo.model_schedule import apply

    pm = peft_model(family, dtype)
    ref = copy.deepcopy(pm)
    base0 = {n: p.detach().clone() for n, p in pm.named_parameters() if not p.requires_grad}
    sch = slapo.create_schedule(pm, mesh=mesh)
    with mutate() if mutate else _nothing():
        apply(sch, **(knobs or {}))
        model, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                                 loss_fn=_loss_fn(family), data_parallel=data_parallel)
        batch = _batch(family)
        losses = [model.train_step(batch)]
        grads = {n: _full(p.grad, p) for n, p in model.named_parameters() if p.requires_grad}
        losses += [model.train_step(batch) for _ in range(steps - 1)]
    ref_losses, ref_grads = _reference(ref, family, batch, steps)
    trained = dict(ref.named_parameters())
    out = {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
           "grad": max(_rel(grads[n], g) for n, g in ref_grads.items()),
           "adapter": max(_rel(_full(p.detach(), p), trained[n].detach())
                          for n, p in model.named_parameters() if p.requires_grad),
           "n_adapters": len(ref_grads)}

    check_adapters_only(model, opt, grads, ref_grads, base0, _full)
    return out


def check_adapters_only(model, opt, grads: dict, ref_grads: dict, base0: dict, whole) -> None:
    """Gradients for exactly PEFT's adapters; the frozen base untouched (no gradient, values
    bit-identical to `base0`, gathered whole by `whole(t, p)`); the optimizer holds adapters
    only."""
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for n, p in model.named_parameters():
        if not p.requires_grad:  # frozen: untouched, no gradient, no optimizer state
            assert p.grad is None, n
            assert torch.equal(whole(p.detach(), p), base0[n]), n
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(ref_grads) and all(p.requires_grad for p in held)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def job_tp2_equals_peft(families):
    """Each family in fp32 and in fp64. Why both: Adam divides each gradient element by its
    own magnitude, so an element whose true gradient is ~0 (LLaMA's last k_proj B has one of
    1.9e-9 next to 1e-3) turns fp32 roundoff of a different summation order into a visible
    parameter difference after a step; fp64 makes that roundoff negligible, so the adapters
    after two AdamW steps test the math; loss and gradients are compared in fp32 too."""
    out = {(f, str(dtype)): compare(f, dtype) for f in families
           for dtype in (torch.float32, torch.float64)}
    out[(DECLARED, "torch.float64")] = compare(DECLARED, torch.float64)
    # sequence parallelism (the row kernel's reduce-scatter) with checkpointed layers
    for f in ("gpt2", "llama"):
        out[(f + "+sp+ckpt", "torch.float64")] = compare(
            f, torch.float64, knobs=dict(sequence_parallel=True, ckpt_ratio=1.0))
    return out


def job_dp2_equals_peft(family):
    """DDP and FSDP2 over dp=2 (each rank half of the batch): the same comparison (FSDP2: the
    frozen base sharded, gathered bit-identical, no gradient), and DDP reduces the adapters'
    gradients only (counted by a comm hook)."""
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2)
    reduced = []
    real = torch.nn.parallel.DistributedDataParallel.__init__

    def counting(self, module, *a, **kw):
        real(self, module, *a, **kw)
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):
            reduced.append(bucket.buffer().numel())
            return allreduce_hook(state, bucket)
        self.register_comm_hook(None, hook)

    torch.nn.parallel.DistributedDataParallel.__init__ = counting
    try:
        out = compare(family, torch.float64, mesh=mesh, data_parallel="ddp", steps=2)
    finally:
        torch.nn.parallel.DistributedDataParallel.__init__ = real
    out["reduced_per_step"] = sum(reduced) / 2
    out["fsdp"] = compare(family, torch.float64, mesh=mesh, data_parallel="fsdp", steps=2)
    out["trainable"] = sum(p.numel() for p in peft_model(family).parameters() if p.requires_grad)
    return out


def job_fsdp2_equals_peft(families):
    """FSDP2 over dp=2 for more families (the frozen base sharded, gathered bit-identical)."""
    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2)
    return {f: compare(f, torch.float64, mesh=mesh, data_parallel="fsdp", steps=2)
            for f in families}


@contextlib.contextmanager
def a_grad_not_summed():
    """The LoRA Column rule broken: A's gradient left unsummed over tp."""
    from slapo.schedule import Schedule

    real = Schedule.reduce_param_grads
    Schedule.reduce_param_grads = lambda self, names=None: None
    try:
        yield
    finally:
        Schedule.reduce_param_grads = real


def job_mutations():
    """Each broken rule of the LoRA styles makes GPT-2's comparison fail."""

    from slapo.model_schedule import lora

    @contextlib.contextmanager
    def no_row_reduction():
        real = lora.collectives.reduce_forward
        lora.collectives.reduce_forward = lambda y, group=None: y
        try:
            yield
        finally:
            lora.collectives.reduce_forward = real

    @contextlib.contextmanager
    def b_not_split():
        real = lora.LoraColumn.apply

        def apply(self, node, tp, sp):  # base split, B whole: shapes clash in the sum
            self.inner.apply(node["base_layer"], tp, sp)
        lora.LoraColumn.apply = apply
        try:
            yield
        finally:
            lora.LoraColumn.apply = real

    out = {}
    for name, mutation in (("no_row_reduction", no_row_reduction), ("b_not_split", b_not_split),
                           ("a_grad_not_summed", a_grad_not_summed)):
        try:
            errs = compare("gpt2", mutate=mutation, steps=1)
            out[name] = max(errs["loss"], errs["grad"])
        except Exception as e:  # noqa: BLE001 - a mutation may also crash the forward
            out[name] = f"{type(e).__name__}"
    return out


def job_refusals():
    """Bad input under tp=2: SchedulingError, the model and the schedule unchanged."""
    import peft

    import slapo
    from slapo.errors import SchedulingError
    from slapo.model_schedule import apply

    cases = {
        "dora": (dict(use_dora=True), {}),
        "embedding": (dict(target_modules=["q_proj", "embed_tokens"]), {}),
        "fuse": ({}, dict(fuse=True)),
        "kernels": ({}, dict(kernels=True)),
    }
    out = {}
    for name, (lora, knobs) in cases.items():
        pm = peft_model("llama", **lora)
        before = {n: p.detach().clone() for n, p in pm.state_dict().items()}
        sch = slapo.create_schedule(pm)
        with pytest.raises(SchedulingError) as info:
            apply(sch, **knobs)
        after = pm.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), name
        assert not sch.applied(), (name, sch.applied())
        assert isinstance(pm, peft.PeftModel)
        out[name] = str(info.value)
    return out


PIPED = ("gpt2", "llama", "qwen3", "roberta", "bert")  # decoder and encoder stages (BERT: no head)


def _stage_loss_fn(family: str):
    """`_loss_fn` on what the last stage returns: BERT's (no head) is the tuple
    (last_hidden_state, pooler_output), the model's own output otherwise."""
    if family == "bert":
        return lambda out, batch: out[0].pow(2).mean() + out[1].pow(2).mean()
    return _loss_fn(family)


def job_pp_equals_peft(tp: int) -> dict:
    """pp=2 (x tp) with FSDP2-free stages: each rank's adapters (the PEFT wrapper's names, held
    by its stage) against PEFT on one process in float64; the frozen base untouched, the
    optimizer holding adapters only."""
    import slapo
    from slapo.model_schedule import apply
    from slapo.runtime import init_mesh

    mesh = init_mesh(dp=1, pp=2, tp=tp)
    out = {}
    for family in PIPED:
        pm = peft_model(family, torch.float64)
        ref = copy.deepcopy(pm)
        base0 = {n: p.detach().clone() for n, p in pm.named_parameters(remove_duplicate=False)
                 if not p.requires_grad}  # a tied head: each stage holds it by its own name
        sch = slapo.create_schedule(pm, mesh=mesh)
        apply(sch, pp_stages=2)
        model, opt = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                                 pipeline="1F1B", num_microbatches=2,
                                 loss_fn=_stage_loss_fn(family))
        batch = _batch(family)
        held = {n: p for st in model.stages for n, p in st.named_parameters()}
        losses = [model.train_step(batch)]
        grads = {n: _full(p.grad, p) for n, p in held.items() if p.requires_grad}
        losses.append(model.train_step(batch))
        ref_losses, ref_grads = _reference(ref, family, batch)
        trained = dict(ref.named_parameters())
        assert set(grads) <= set(ref_grads), sorted(set(grads) - set(ref_grads))
        for n, p in held.items():
            if not p.requires_grad:
                assert p.grad is None and torch.equal(_full(p.detach(), p), base0[n]), n
        kept = [p for g in opt.param_groups for p in g["params"]]
        assert all(p.requires_grad for p in kept)
        out[family] = {
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad": max(_rel(g, ref_grads[n]) for n, g in grads.items()),
            "adapter": max(_rel(_full(p.detach(), p), trained[n].detach())
                           for n, p in held.items() if p.requires_grad),
            "held": sorted(grads), "all": sorted(ref_grads)}
    return out


# ---- tests ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tp", [1, 2])
def test_pp2_lora_equals_peft_on_one_process(tp, dist2, dist4):
    """LoRA through pipeline stages: the stages are the inner model's, carried under PEFT's
    names (`runtime.partition.PrefixedStage`); pp=2 on 2 ranks and tp=2 x pp=2 on 4 ranks
    equal PEFT's LoRA on one process, every adapter held by exactly one stage."""
    res = (dist2 if tp == 1 else dist4).run(job_pp_equals_peft, tp)
    for family in PIPED:
        held = {n for r in res for n in r[family]["held"]}
        assert held == set(res[0][family]["all"]), family
        for r in res:
            for what in ("loss", "grad", "adapter"):
                assert r[family][what] <= TOL, (family, what, r[family])


def test_tp2_lora_equals_peft_on_one_process(dist2):
    res = dist2.run(job_tp2_equals_peft, FAMILIES)
    for rank_res in res:
        assert len(rank_res) == 2 * len(FAMILIES) + 3
        for (family, dtype), errs in rank_res.items():
            assert errs["n_adapters"] > 0, family
            checked = ("loss", "grad") if dtype == "torch.float32" else ("loss", "grad", "adapter")
            for what in checked:
                assert errs[what] <= TOL, (family, dtype, what, errs)


def test_ddp_and_fsdp2_lora_equal_peft_and_reduce_adapters_only(dist2):
    res = dist2.run(job_dp2_equals_peft, "llama")
    for errs in res:
        for what in ("loss", "grad", "adapter"):
            assert errs[what] <= TOL, (what, errs)
            assert errs["fsdp"][what] <= TOL, (what, errs["fsdp"])
        assert errs["reduced_per_step"] == errs["trainable"], errs


def test_fsdp2_lora_equals_peft_for_gpt2_qwen3_and_bert(dist2):
    res = dist2.run(job_fsdp2_equals_peft, ("gpt2", "qwen3", "bert"))
    for rank_res in res:
        for family, errs in rank_res.items():
            for what in ("loss", "grad", "adapter"):
                assert errs[what] <= TOL, (family, what, errs)


def test_mutations_of_the_lora_styles_fail(dist2):
    res = dist2.run(job_mutations)
    for rank_res in res:  # numbers: the worst loss/gradient error; a string: the error raised
        assert rank_res["no_row_reduction"] > 1e-2, rank_res
        assert rank_res["a_grad_not_summed"] > 1e-2, rank_res
        assert rank_res["b_not_split"] == "ScheduledShapeError", rank_res


def test_bad_lora_input_is_refused_unchanged(dist2):
    res = dist2.run(job_refusals)
    msgs = res[0]
    assert "DoRA" in msgs["dora"]
    assert "vocab_parallel" in msgs["embedding"] and "fuse" in msgs["fuse"]
    assert "kernels" in msgs["kernels"]
