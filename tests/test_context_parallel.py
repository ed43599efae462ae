"""Context parallelism (issue 34): cp=2 (and cp=4) on real gloo ranks equals one process for LLaMA (GQA), Qwen2 (q/k/v biases),
Qwen3 (RoPE, per-head norms) and GPT-2 (learned absolute positions, tied head), with both ways across ranks (all-gather of K/V, ring), on a
batch whose sequence length (14) is not a multiple of 2cp and whose second sequence is
left-padded (attention_mask 0, labels -100): the loss of both steps, every gradient, every
parameter after two AdamW steps at lr 1e-2. A ring that skips a step, or merges blocks without
the log-sum-exp correction, fails the same comparison; bad placements, families, knobs,
builds and batches are refused before anything changes.

The reference is HF's model in one process on the whole global batch (its own SDPA attention,
its own label shift); the cp run is `model_schedule.apply` + `slapo.build` on a cp=2 mesh and
`train_step(global batch)`, so the split, the position ids, the loss normalisation and DDP over
the cp ranks are all under test.
"""

from __future__ import annotations

import copy

import pytest
import torch

from slapo.errors import SchedulingError
from slapo.runtime.context_parallel import cp_batch, padded_length, zigzag_index
from slapo.runtime.mesh import MeshInfo, ParallelDims

LR = 1e-2
REL = 1e-5
# Qwen2: biased q/k/v projections; Mistral: a sliding window (4) shorter than the sequence and
# than a rank's span of it; BERT: bidirectional, masked-LM labels; OPT, RoBERTa: positions that
# count unpadded tokens only (RoBERTa's from the padding id in input_ids)
FAMILIES = ("llama", "qwen2", "qwen3", "gpt2", "mistral", "bert_mlm", "opt", "roberta")
MASKED = ("bert_mlm", "roberta")
MODES = ("allgather", "ring", "ulysses")
SEQ = 14  # not a multiple of 2 * cp = 4: padded to 16


# ---- one process: the placement and the split --------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    ({"cp": 0}, "must be a positive int"),
    ({"cp": 2, "ep": 2}, "ep does not divide dp=1"),
])
def test_bad_cp_placements_are_refused(kw, match):
    with pytest.raises(SchedulingError, match=match):
        ParallelDims(**kw)


def test_the_knob_offers_the_attention_choices_the_core_has():
    """The knob schema keeps its own copy of the choices (it must not import the op layer);
    the two must agree."""
    from slapo.model_schedule import knobs
    from slapo.op import context_parallel

    assert knobs.CP_ATTENTION == context_parallel.CP_ATTENTION


def test_cp_is_its_own_dimension_and_averages_with_dp():
    dims = ParallelDims.for_world(8, cp=4)
    assert (dims.dp, dims.cp, dims.world, dims.mesh_dims) == (2, 4, 8, ("dp", "pp", "cp", "tp"))
    assert dims.data_parallel == "ddp" and ParallelDims(cp=2).data_parallel == "ddp"
    assert "cp=4" in str(dims)
    with pytest.raises(SchedulingError, match="cp=4 x tp=1 x pp=1 = 4 ranks .* does not divide "
                       "the 6"):
        ParallelDims.for_world(6, cp=4)


def test_zigzag_split_shifts_labels_before_splitting():
    assert zigzag_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(sum((zigzag_index(16, 4, r).tolist() for r in range(4)), [])) == list(range(16))
    assert padded_length(14, 2) == 16 and padded_length(16, 4) == 16
    x = torch.arange(100, 114).reshape(1, 14)
    mask = torch.ones(1, 14, dtype=torch.long)
    parts = [cp_batch({"input_ids": x, "labels": x, "attention_mask": mask}, 2, r)
             for r in range(2)]
    # rank 0: chunks 0 and 3 of the padded 16 -> positions 0-3 and 12-15 (14, 15 padding)
    assert parts[0]["position_ids"].tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert parts[0]["input_ids"].tolist() == [[100, 101, 102, 103, 112, 113, 0, 0]]
    # label t is the token at t + 1 of the whole sequence: chunk 0's last token predicts 104,
    # held by rank 1; the last real token and the padding predict nothing
    assert parts[0]["labels"].tolist() == [[101, 102, 103, 104, 113, -100, -100, -100]]
    assert parts[1]["labels"].tolist() == [[105, 106, 107, 108, 109, 110, 111, 112]]
    assert parts[0]["shift_labels"] is parts[0]["labels"]
    # every cp rank's key flags, by rank (rank 0's chunks end in the 2 padded keys)
    assert parts[0]["cp_key_valid"].tolist() == [[[True] * 6 + [False] * 2, [True] * 8]]
    assert torch.equal(parts[1]["cp_key_valid"], parts[0]["cp_key_valid"])
    assert "attention_mask" not in parts[0]


def test_a_packed_row_splits_its_positions_and_documents():
    """Packed documents (positions restarting): each rank gets the tokens' own positions and
    every rank's tokens' documents, numbered as HF's `find_packed_sequence_indices`."""
    from transformers.masking_utils import find_packed_sequence_indices

    from slapo.op.context_parallel import KEY_DOC

    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    batch = {"input_ids": torch.arange(16).view(2, 8), "labels": torch.arange(16).view(2, 8),
             "position_ids": pos}
    docs = find_packed_sequence_indices(pos)
    for rank in range(2):
        part = cp_batch(batch, 2, rank)
        index = zigzag_index(8, 2, rank)
        assert torch.equal(part["position_ids"], pos[:, index])
        assert torch.equal(part[KEY_DOC][:, rank], docs[:, index])
        assert torch.equal(part[KEY_DOC], cp_batch(batch, 2, 1 - rank)[KEY_DOC])
    assert KEY_DOC not in cp_batch({k: batch[k] for k in ("input_ids", "labels")}, 2, 0)


@pytest.mark.parametrize("batch, match", [
    ((torch.zeros(1, 8, dtype=torch.long),), "dict batch"),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, "input_ids` and `labels`"),
    ({"input_ids": torch.zeros(1, 8, dtype=torch.long), "labels": torch.zeros(1, 8,
      dtype=torch.long), "inputs_embeds": torch.zeros(1, 8, 4)}, "'inputs_embeds'"),
    ({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.zeros(2, 8,
      dtype=torch.long), "position_ids": torch.arange(8)[None]}, "position_ids under context"),
])
def test_batches_cp_cannot_split_are_refused(batch, match):
    with pytest.raises(SchedulingError, match=match):
        cp_batch(batch, 2, 0)


# ---- cp=2 on two gloo ranks -------------------------------------------------------------------
def _model(family: str, dtype=torch.float64, aux: bool | None = None):
    """In float64: AdamW's first steps divide each gradient by its own magnitude (+ eps
    1e-8), so fp32 summation-order noise on a gradient entry of ~1e-8 moves a parameter by
    ~1e-4 of lr; in float64 what is left is the comparison itself. `aux=False`: an MoE
    model without its load-balancing loss."""
    import models

    model = getattr(models, family)(seed=0).to(dtype)
    if aux is False:
        model.config.output_router_logits = False
    return model


def _batches(family: str = "llama") -> list[dict]:
    """Two global batches of two sequences of SEQ tokens; the second sequence left-padded by 3
    (mask 0, labels -100). BERT's: masked-LM labels on about half of the tokens (a different
    count on each cp rank, so the loss's token weighting is under test) and token types."""
    import models

    out = []
    for seed in (1, 2):
        x = models.ids(2, SEQ, seed=seed)
        mask = torch.ones_like(x)
        mask[1, :3] = 0
        if family == "roberta":
            x[1, :3] = 1  # RoBERTa's padding id: its positions skip these tokens
        batch = {"input_ids": x, "attention_mask": mask,
                 "labels": x.masked_fill(mask == 0, -100)}
        if family in MASKED:
            drop = torch.rand(x.shape, generator=torch.Generator().manual_seed(seed)) < 0.5
            batch["labels"] = batch["labels"].masked_fill(drop, -100)
        if family == "bert_mlm":
            batch["token_type_ids"] = (torch.arange(SEQ) >= SEQ // 2).long().expand(2, SEQ)
        out.append(batch)
    return out


def _reference(ref, batches):
    """One process on the whole batch: losses, first-step gradients, AdamW."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grads = [], None
    for batch in batches:
        opt.zero_grad()
        loss = ref(**batch).loss
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone()
                     for n, p in ref.named_parameters(remove_duplicate=False)}
        opt.step()
        losses.append(loss.item())
    return losses, grads


def _rel(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """The worst difference relative to `want`'s largest entry, or to `floor` when that is
    larger (a gradient that is zero analytically: BERT's key bias shifts every score of a
    query by one constant, which the softmax cancels, so both sides hold roundoff only)."""
    scale = max(want.abs().max().item(), floor)
    return (got - want).abs().max().item() / (scale if scale > 0 else 1.0)


def _full(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard (a DTensor) and a tensor-parallel shard (`p`'s) gathered whole."""
    from slapo.sharding import gather_full, shard_spec

    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    spec = shard_spec(p)
    return gather_full(t, spec) if spec is not None and spec.world_size > 1 else t


def _held(tm, pp: int) -> dict:
    """This rank's parameters by their names in the model (a pipeline rank: its stages')."""
    if pp == 1:
        return dict(tm.named_parameters())
    return {n: p for stage in tm.stages for n, p in stage.named_parameters()}


def _mine(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """One process's `value` of parameter `p` as this rank holds it: an expert-parallel
    shard's experts (`op.moe.expert_shard`), anything else whole."""
    from slapo.op.moe import expert_shard

    s = expert_shard(p)
    return value if s is None else value[s.first:s.first + s.count]


def _one_rank():
    """A group of this rank alone (the one-process reference under an initialised world);
    every rank creates every rank's group, in order, as `new_group` requires, once."""
    import torch.distributed as dist

    if "one" not in _GROUPS:
        groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
        _GROUPS["one"] = groups[dist.get_rank()]
    return _GROUPS["one"]


_GROUPS: dict = {}


def _worst(family: str, mode: str, mesh, batches, dtype=torch.float64,
           data_parallel: str = "ddp", pp: int = 1, knobs: dict | None = None) -> dict:
    """With `knobs` the reference is one process with the same knobs (the fused loss and
    compiled blocks differ from HF's model by their own roundoff, ~1e-7, which AdamW then
    amplifies; what is under test is that cp changes nothing)."""
    import slapo

    # with dp > 1 the load-balancing loss is per dp rank (its samples: docs/model_schedule.md),
    # not the global batch's one process computes: compared without it there
    model = _model(family, dtype, aux=False if MeshInfo.of(mesh).dp > 1 else None)
    ref = copy.deepcopy(model)
    if knobs:
        ref = slapo.model_schedule.apply(slapo.create_schedule(ref, group=_one_rank()),
                                         **knobs).mod
    sch = slapo.create_schedule(model, mesh=mesh)
    slapo.model_schedule.apply(sch, cp_attention=mode, pp_stages=pp, **(knobs or {}))
    piped = {"pipeline": "1F1B", "num_microbatches": 2} if pp > 1 else {}
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR},
                        data_parallel=data_parallel, grad_clip=1e6, **piped)
    losses, grads, norm = [], None, None
    for batch in batches:
        losses.append(tm.train_step(batch))
        if grads is None:
            grads = {n: _full(p.grad, p) for n, p in _held(tm, pp).items()}
            norm = (tm._trainer if pp > 1 else tm.train_step.__self__).last_grad_norm
    ref_losses, ref_grads = _reference(ref, batches)
    # a pipeline's last stage holds a tied head under its own name (one process: a duplicate)
    params = _held(tm, pp)
    ref_params = dict(ref.named_parameters(remove_duplicate=pp == 1))
    assert params.keys() == grads.keys() and (pp > 1 or params.keys() == ref_params.keys())
    assert params.keys() <= ref_params.keys()
    unique = dict(ref.named_parameters())  # a tied weight's gradient counts once in the norm
    want_norm = torch.stack([ref_grads[n].double().norm() for n in unique]).norm()
    biggest = max(g.abs().max().item() for g in ref_grads.values())
    return {"loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad": max(_rel(g, _mine(ref_grads[n], params[n]), 1e-9 * biggest)
                        for n, g in grads.items()),
            # a roundoff-only gradient (BERT's key bias, `_rel`) moves its parameter by +-lr
            # in AdamW whatever the noise's size: no comparison is defined for it
            "param": max(_rel(_full(p.detach(), p), _mine(ref_params[n].detach(), p))
                         for n, p in params.items()
                         if ref_grads[n].abs().max().item() > 1e-9 * biggest),
            "norm": _rel(norm.double(), want_norm),
            "split": sum(_full(p, p) is not p for p in params.values()),
            "held": sorted(params),
            "experts": sum(_mine(p, p) is not p for p in params.values()),
            "cores": sorted({type(m).__name__ for m in tm.modules()
                             if type(m).__name__ == "ContextParallelAttention"})}


def _skip_last_step(honest):
    return lambda cp: honest(cp)[:-1]


def _without_lse(out, lse, out_b, lse_b):
    """The mutation: blocks added as if each were normalised over all keys."""
    return (out_b, lse_b) if out is None else (out + out_b, torch.maximum(lse, lse_b))


def _heads_reversed(honest):
    """The mutation: Ulysses' way back puts the head groups in reverse rank order."""
    def back(y, group):
        cp = torch.distributed.get_world_size(group)
        out = honest(y, group)
        b, h, s, d = out.shape
        return out.reshape(b, cp, h // cp, s, d).flip(1).reshape(b, h, s, d)
    return back


def _rule_broken(honest, mutation):
    """The mutations of the mask rule: the window ignored, or every layer made causal."""
    def visible(q_pos, k_pos, k_valid, causal=True, window=None):
        if mutation == "no_window":
            return honest(q_pos, k_pos, k_valid, causal, None)
        return honest(q_pos, k_pos, k_valid, True, window)
    return visible


def job_cp_equals_one_process(families=FAMILIES, modes=MODES, mutation=None, cp=2, tp=1,
                              data_parallel="ddp", pairs=None, pp=1, knobs=None, ep=1):
    """{(family, mode): the worst relative difference of loss, gradients, parameters, the
    clipped norm}, for every family with every mode, or for the (family, mode) `pairs`.
    `mutation`: "skip_step" or "no_lse", patched into the ring (`op/ring_attention.py`),
    "heads_reversed" into Ulysses' all-to-all back (`op/context_parallel.py`), "no_window"
    or "all_causal" into the mask rule (`visible`, both modules), "index_positions": the
    tokens' indices as positions for every model (`runtime.context_parallel.position_rule`),
    "local_aux": the load-balancing loss without its sum over the cp ranks;
    `tp`: tensor-parallel ranks
    per cp rank; `data_parallel`: "fsdp" shards over the dp x cp ranks; `pp`: pipeline stages
    (1F1B, 2 micro-batches; FSDP2 over the cp ranks of each stage); `knobs`: more
    `model_schedule.apply` knobs (fused_loss, compile_blocks, ckpt_ratio); `ep`: expert
    parallelism over as many data-parallel ranks (dp = ep)."""
    import importlib

    import slapo.op.context_parallel as cpa
    import slapo.op.ring_attention as ring
    import slapo.op.router_balance as rb
    from slapo.runtime.mesh import init_mesh

    build = importlib.import_module("slapo.runtime.build")  # the module, not `slapo.build`

    mesh = init_mesh(dims=ParallelDims(cp=cp, tp=tp, pp=pp, ep=ep, dp_replicate=ep,
                                       device="cpu"))
    rule, balance = build.position_rule, rb.balance_loss
    honest = ring.ring_steps, ring.merge_partials, cpa._heads_to_seq, ring.visible
    if mutation == "skip_step":
        ring.ring_steps = _skip_last_step(honest[0])
    elif mutation == "no_lse":
        ring.merge_partials = _without_lse
    elif mutation == "heads_reversed":
        cpa._heads_to_seq = _heads_reversed(honest[2])
    elif mutation in ("no_window", "all_causal"):
        ring.visible = cpa.visible = _rule_broken(honest[3], mutation)
    elif mutation == "index_positions":
        build.position_rule = lambda model: None
    elif mutation == "local_aux":  # the load-balancing statistics of this rank's tokens only
        rb.balance_loss = lambda *a: balance(*a[:-1], _one_rank())
    try:
        every = pairs is None  # the fp32 runs join the full grid only
        pairs = pairs or [(f, m) for f in families for m in modes]
        out = {(f, m): _worst(f, m, mesh, _batches(f), data_parallel=data_parallel, pp=pp,
                              knobs=knobs) for f, m in pairs}
        if every and mutation is None and cp == 2 and tp == 1 and data_parallel == "ddp":  # float32: loss and gradients (AdamW amplifies fp32 noise: _model)
            out.update({(f, m, "fp32"): _worst(f, m, mesh, _batches(), torch.float32)
                        for f in families[:1] for m in modes})
        return out
    finally:
        ring.ring_steps, ring.merge_partials, cpa._heads_to_seq, ring.visible = honest
        cpa.visible = honest[3]
        build.position_rule, rb.balance_loss = rule, balance


@pytest.mark.dist
def test_cp2_equals_one_process(dist2):
    results = dist2.run(job_cp_equals_one_process)
    assert len(results[0]) == len(FAMILIES) * len(MODES) + len(MODES)
    _check_equal(results)


# Each tp plan once and each attention choice with LLaMA (the choices act on the local heads,
# whatever the family; Mistral's window and BERT's bidirectional rule with every choice are
# under test at cp=2; Mistral takes LLaMA's tp plan and RoBERTa BERT's): 8 runs, not 24.
COVER = [("llama", m) for m in MODES] + [("qwen2", "ring"), ("qwen3", "ulysses"),
                                          ("gpt2", "allgather"), ("bert_mlm", "ulysses"),
                                          ("opt", "allgather")]


# cp=4 and FSDP2 act the same whatever the family's positions (tested at cp=2): each choice
# with LLaMA, the mask rules that span ranks differently (a window, bidirectional) once each
FOUR = [("llama", m) for m in MODES] + [("mistral", "ring"), ("bert_mlm", "allgather")]


@pytest.mark.dist
def test_cp4_equals_one_process(dist4):
    """Four ranks: a ring of four steps (each dK/dV travels three hops home), chunks of 2
    (Mistral's window of 4 spans three ranks' chunks)."""
    results = dist4.run(job_cp_equals_one_process, cp=4, pairs=FOUR)
    assert set(results[0]) == set(FOUR)
    _check_equal(results)


@pytest.mark.dist
def test_cp2_with_tp2_equals_one_process(dist4):
    """cp=2 x tp=2 on 4 ranks: each layer's heads split over tp, each tp rank's heads attending
    over the cp ranks of its tp index, DDP over the cp ranks; every cp family (GPT-2's fused
    c_attn included) and every attention choice (Ulysses then splits 2 local heads; LLaMA's
    single local KV head is repeated)."""
    results = dist4.run(job_cp_equals_one_process, tp=2, pairs=COVER)
    assert set(results[0]) == set(COVER)
    assert all(w["split"] > 0 for r in results for w in r.values())
    _check_equal(results)


@pytest.mark.dist
def test_cp2_with_fsdp2_equals_one_process(dist2):
    """cp=2 with FSDP2: the parameters sharded over the dp x cp ranks (the cp ranks hold the
    same parameters), reduce-scattered as DDP all-reduces; the clipped norm summed over them
    (`FOUR`: sharding does not depend on the family)."""
    results = dist2.run(job_cp_equals_one_process, data_parallel="fsdp", pairs=FOUR)
    assert set(results[0]) == set(FOUR)
    assert all(w["split"] > 0 for r in results for w in r.values())
    _check_equal(results)


# every cp family's pipeline (decoder and encoder stages), each attention choice at least once
PIPED = [("llama", "ring"), ("qwen3", "allgather"), ("gpt2", "ulysses"), ("mistral", "ring"),
         ("opt", "allgather"), ("bert_mlm", "ulysses"), ("roberta", "ring")]


@pytest.mark.dist
def test_cp2_with_pp2_equals_one_process(dist4):
    """cp=2 x pp=2 on 4 ranks (1F1B, 2 micro-batches): each stage's layers get the cp batch's
    positions and key flags from the runner, the last stage's loss the pre-shifted labels and
    the global token count; FSDP2 over each stage's cp ranks. Every parameter is held by some
    rank, and each equals one process's."""
    results = dist4.run(job_cp_equals_one_process, data_parallel="fsdp", pairs=PIPED, pp=2)
    assert set(results[0]) == set(PIPED)
    for pair in PIPED:
        held = {n for r in results for n in r[pair]["held"]}
        model = _model(pair[0])  # every parameter, under one of its names (tied: any)
        assert set(dict(model.named_parameters())) <= held, pair
        assert held <= set(dict(model.named_parameters(remove_duplicate=False))), pair
    _check_equal(results)
    refused = dist4.run(job_seq2seq_pipeline_is_refused)
    assert all("not built for context parallelism" in r for r in refused), refused


def job_seq2seq_pipeline_is_refused() -> str:
    """T5's stages take no cp inputs: `build` refuses them on a cp x pp mesh, before any
    change. (`apply` refuses T5 on a cp mesh first; here the model is marked as scheduled for
    cp by hand, as a user's own cp attention would be, so the stage check is what answers.)"""
    import models

    import slapo
    from slapo.module_patch import module_meta
    from slapo.runtime.context_parallel import CP_META
    from slapo.runtime.mesh import init_mesh

    sch = slapo.create_schedule(models.t5(seed=0), mesh=init_mesh(
        dims=ParallelDims(cp=2, pp=2, device="cpu")))
    sch["encoder.block.0"].cut_pipeline_stage()
    module_meta(sch.mod, create=True)[CP_META] = 2
    with pytest.raises(SchedulingError) as err:
        slapo.build(sch, optimizer=torch.optim.AdamW, pipeline="1F1B", num_microbatches=2,
                    data_parallel="fsdp")
    return str(err.value)


@pytest.mark.dist
def test_cp2_with_fused_loss_and_checkpointing_equals_one_process(dist2):
    """The fused head + loss under cp (the kernel takes the pre-shifted labels and the global
    token count; a masked LM's labelled rows), and full activation checkpointing (the
    recomputed forward repeats the core's collectives), each equal to one process with the
    same knob, for a causal and a masked family of each kind of positions."""
    pairs = [("llama", "allgather"), ("gpt2", "ring"), ("opt", "ulysses"),
             ("bert_mlm", "ring"), ("roberta", "ulysses")]
    for knobs in ({"fused_loss": True}, {"ckpt_ratio": 1.0}):
        results = dist2.run(job_cp_equals_one_process, pairs=pairs, knobs=knobs)
        assert set(results[0]) == set(pairs), knobs
        _check_equal(results)


@pytest.mark.dist
@pytest.mark.compile
@pytest.mark.slow
def test_cp2_with_compiled_blocks_equals_one_process(dist2):
    """Compiled blocks under cp: the ring's autograd function (its point-to-point steps) and
    Ulysses' all-to-all (whose gradient torch 2.11's compiler lost: docs/runtime.md) inside
    inductor-compiled layers, equal to one process's compiled model."""
    pairs = [("llama", "ring"), ("llama", "ulysses")]
    results = dist2.run(job_cp_equals_one_process, pairs=pairs, knobs={"compile_blocks": True})
    assert set(results[0]) == set(pairs)
    _check_equal(results)


MOE = [("mixtral", "ring"), ("qwen3_moe", "ulysses"), ("deepseek_v3", "allgather"),
       ("deepseek_v3", "ring")]


@pytest.mark.dist
def test_cp2_mixtures_of_experts_equal_one_process(dist2):
    """MoE families under cp (experts replicated, ep=1): each rank routes its own tokens to
    HF's experts; Mixtral (GQA) and Qwen3-MoE with HF's load-balancing loss (its statistics
    summed over the cp ranks: `op/router_balance.py`), DeepSeek-V3 (multi-head latent
    attention: query and key heads wider than the values, its own RoPE and scaling)."""
    results = dist2.run(job_cp_equals_one_process, pairs=MOE)
    assert set(results[0]) == set(MOE)
    _check_equal(results)


@pytest.mark.dist
def test_cp2_with_ep2_equals_one_process(dist4):
    """cp=2 x ep=2 on 4 ranks (ep borrows the 2 data-parallel ranks): each rank's chunks of its
    sample routed to the experts of its ep group (the ranks of its cp index) by all-to-all,
    each expert's gradient averaged over the ranks holding it (dp_rest x cp), the rest over
    dp x cp; every expert shard compared with one process's experts."""
    results = dist4.run(job_cp_equals_one_process, pairs=MOE[:3], ep=2)
    assert set(results[0]) == set(MOE[:3])
    assert all(w["experts"] > 0 for r in results for w in r.values())
    _check_equal(results)


def _check_equal(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for key, worst in res.items():
            assert worst["cores"] == ["ContextParallelAttention"], (rank, key)
            kinds = ("loss", "grad", "norm") if "fp32" in key else ("loss", "grad", "param",
                                                                    "norm")
            bad = {k: worst[k] for k in kinds if worst[k] > REL}
            assert not bad, (rank, key, bad)


BROKEN = {"skip_step": ("llama", "ring"), "no_lse": ("llama", "ring"),
          "heads_reversed": ("llama", "ulysses"), "no_window": ("mistral", "allgather"),
          "all_causal": ("bert_mlm", "ring"), "index_positions": ("opt", "allgather"),
          "local_aux": ("mixtral", "allgather")}


@pytest.mark.dist
def test_a_broken_ring_fails(dist2):
    """Each mutation (`job_cp_equals_one_process`) on the family and attention choice it
    breaks: a ring step skipped, blocks merged without the log-sum-exp, Ulysses' head groups
    returned in the wrong order, Mistral's window ignored, BERT's bidirectional layers masked
    causally, OPT's positions taken as the tokens' indices, Mixtral's load-balancing loss from
    each rank's tokens alone: each moves the loss and the gradients."""
    results = {m: dist2.run(job_cp_equals_one_process, pairs=[pair], mutation=m)[0][pair]
               for m, pair in BROKEN.items()}
    for mutation, worst in results.items():  # 10x the tests' tolerance, at least
        assert worst["loss"] > 10 * REL and worst["grad"] > 10 * REL, (mutation, worst)


def _three_heads(seed: int = 0):
    """A LLaMA whose 3 heads cp=2 cannot split (Ulysses)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=48, num_attention_heads=3,
                                        num_key_value_heads=3, intermediate_size=64,
                                        num_hidden_layers=1, vocab_size=128))


def job_bad_input_is_refused():
    """On a cp=2 mesh: families and knobs cp cannot run, builds it cannot run and a batch it
    cannot split; each a SchedulingError, the model unchanged."""
    import models

    import slapo
    from slapo.runtime.mesh import init_mesh

    mesh = init_mesh(dims=ParallelDims(cp=2, device="cpu"))
    refused = {}
    cases = {"gpt_neo": (models.gpt_neo, {}), "albert": (models.albert, {}),
             "t5": (models.t5, {}), "dropout": (lambda seed: models.bert_mlm(seed, dropout=0.1), {}),
             "attention": (models.llama, {"attention": "sdpa"}),
             "fused_loss": (models.llama, {"fused_loss": True, "pp_stages": 2}),
             "router_pp": (models.mixtral, {"pp_stages": 2}),
             "ulysses_heads": (_three_heads, {"cp_attention": "ulysses"})}
    for name, (make, kw) in cases.items():
        model = make(seed=0)
        before = [(n, type(m)) for n, m in model.named_modules()]
        state = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(SchedulingError) as err:
            slapo.model_schedule.apply(slapo.create_schedule(model, mesh=mesh), **kw)
        assert [(n, type(m)) for n, m in model.named_modules()] == before
        assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
        refused[name] = str(err.value)
    for name, (apply, kw) in {"unscheduled": (False, {"data_parallel": "ddp"}),
                              "no_ddp": (True, {}),
                              "loss_fn": (True, {"data_parallel": "ddp",
                                                 "loss_fn": lambda out, b: out.logits.sum()}),
                              }.items():
        sch = slapo.create_schedule(models.llama(seed=0), mesh=mesh)
        if apply:
            slapo.model_schedule.apply(sch)
        with pytest.raises(SchedulingError) as err:
            slapo.build(sch, optimizer=torch.optim.AdamW, **kw)
        refused[name] = str(err.value)
    sch = slapo.create_schedule(models.llama(seed=0), mesh=mesh)
    slapo.model_schedule.apply(sch)
    tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, data_parallel="ddp")
    x = models.ids(2, 8)
    with pytest.raises(SchedulingError) as err:
        tm.train_step({"input_ids": x, "labels": x, "inputs_embeds": torch.zeros(2, 8, 4)})
    refused["inputs_embeds"] = str(err.value)
    return refused


@pytest.mark.dist
def test_bad_input_is_refused(dist2):
    refused = dist2.run(job_bad_input_is_refused)[0]
    assert "family 'gpt_neo'" in refused["gpt_neo"] and "registry" in refused["gpt_neo"]
    assert "family 'albert'" in refused["albert"] and "shared layer" in refused["albert"]
    assert "attention_probs_dropout_prob=0.1" in refused["dropout"], refused["dropout"]
    assert "relative position bias" in refused["t5"]
    assert "attention does not compose" in refused["attention"]
    assert "fused_loss with pp_stages > 1 does not compose" in refused["fused_loss"], \
        refused["fused_loss"]
    assert "output_router_logits with pp_stages > 1" in refused["router_pp"], refused["router_pp"]
    assert "splits the 3 query heads" in refused["ulysses_heads"], refused["ulysses_heads"]
    assert "not made context-parallel" in refused["unscheduled"]
    assert "data_parallel='ddp'" in refused["no_ddp"]
    assert "language-modelling loss" in refused["loss_fn"]
    assert "'inputs_embeds'" in refused["inputs_embeds"]


# ---- slapo train --cp ----------------------------------------------------------------------------
TRAIN = dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=30, batch_size=4, steps=4,
             progress=False, plot=False, eval_batches=0, dropout=0.0, lr=1e-2)


def job_train_cp(runs: list[dict], out: str) -> list:
    """`slapo train`'s entry point per options (--cp 2): its losses, or the refusal's text."""
    from slapo.errors import SlapoError
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    results = []
    for i, opts in enumerate(runs):
        opts = {**TRAIN, **opts}
        if opts.get("save_every") or opts.get("resume"):
            opts.setdefault("out", f"{out}/run{i}")
        try:
            data = train(TrainConfig(**opts))
            assert "cp=2" in data["schedule"], data["schedule"]  # not DDP over 2 ranks
            results.append(data["losses"])
        except (SlapoError, ValueError) as e:
            results.append(str(e))
    return results


@pytest.mark.dist
def test_slapo_train_cp2_trains_like_one_process_and_resumes(dist2, tmp_path):
    """`slapo train --cp 2` (sequence 30: padded to 32 for the zig-zag split) logs one
    process's losses for LLaMA and GPT-2 with both attention choices, BERT and RoBERTa (masked
    LMs, bidirectional), OPT (positions counting unpadded tokens), Mixtral (its load-balancing
    loss over the cp ranks) and LLaMA with `--dp-shard`
    (FSDP2 sharding over the cp ranks); a run
    saved at step 2 and resumed logs the uninterrupted run's losses bit for bit; a family
    without a cp plan is refused by name."""
    from slapo.train import TrainConfig, train

    runs = [{"model": m, "cp": 2, "cp_attention": a}
            for m in ("llama", "gpt2") for a in MODES[:2]]
    runs += [{"model": "llama", "cp": 2, "save_every": 2},
             {"model": "llama", "cp": 2, "resume": str(tmp_path / "run4" / "checkpoints" /
                                                        "step_000002"), "out": str(tmp_path / "b")},
             {"model": "albert", "cp": 2, "steps": 1},
             {"model": "llama", "cp": 2, "dp_shard": True},  # FSDP2 over the cp ranks
             {"model": "bert", "cp": 2}, {"model": "roberta", "cp": 2},
             {"model": "opt", "cp": 2, "cp_attention": "ring"}, {"model": "mixtral", "cp": 2}]
    ranks = dist2.run(job_train_cp, runs, str(tmp_path), timeout=600)
    assert ranks[0] == ranks[1], ranks
    got = ranks[0]
    for i, run in [*enumerate(runs[:4]), *list(enumerate(runs))[7:]]:
        one = train(TrainConfig(**{**TRAIN, "model": run["model"]}))["losses"]
        assert got[i] == pytest.approx(one, rel=REL, abs=1e-6), (run, got[i], one)
    assert got[5][2:] == got[4][2:], (got[4], got[5])
    assert isinstance(got[6], str) and "cp" in got[6] and "albert" in got[6].lower(), got[6]


@pytest.mark.dist
def test_slapo_train_cp2_with_tp2_trains_like_one_process(dist4, tmp_path):
    """`slapo train --cp 2 --tp 2` on 4 ranks (each rank: its chunks, its heads) and `--cp 2
    --pp-stages 2 --dp-shard` (each stage's ranks: their chunks) and DeepSeek-V3 with `--cp 2
    --ep 2` (ep borrows the two data-parallel ranks) log one process's losses (the attention
    choice travels from the command line too); float32, so to rel 1e-5 (tp's all-reduces and
    the cp split sum in another order)."""
    from slapo.train import TrainConfig, train

    runs = [{"model": "llama", "cp": 2, "tp": 2, "cp_attention": "ulysses"},
            {"model": "llama", "cp": 2, "pp_stages": 2, "cp_attention": "ring",
             "dp_shard": True},
            {"model": "gpt2", "cp": 2, "pp_stages": 2, "dp_shard": True},
            {"model": "deepseek_v3", "cp": 2, "ep": 2}]
    ranks = dist4.run(job_train_cp, runs, str(tmp_path), timeout=600)
    assert all(r == ranks[0] for r in ranks), ranks
    for run, got in zip(runs, ranks[0], strict=True):
        one = train(TrainConfig(**{**TRAIN, "model": run["model"]}))["losses"]
        assert got == pytest.approx(one, rel=REL, abs=1e-6), (run, got, one)


def job_training_rng_per_cp_rank() -> dict:
    """`slapo train`'s seeding on a cp=2 mesh: what each rank's default stream draws next."""
    import torch.distributed as dist

    from slapo.runtime.mesh import init_mesh
    from slapo.train.setup import Env, seed_training_rng

    mesh = init_mesh(dims=ParallelDims(cp=2))
    seed_training_rng(0, Env(rank=dist.get_rank(), world=2, mesh=mesh, dims=ParallelDims(cp=2)))
    return {"default": torch.rand(8)}


@pytest.mark.dist
def test_cp_ranks_draw_their_own_dropout_masks(dist2):
    """cp ranks hold other tokens of the same rows: one stream would repeat each chunk's
    dropout mask on the other rank (a distribution one process never draws)."""
    a, b = (r["default"] for r in dist2.run(job_training_rng_per_cp_rank))
    assert not torch.equal(a, b)
