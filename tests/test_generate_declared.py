"""`generate()` after scheduling equals the unscheduled model's for the decoders Slapo schedules
from the tensor-parallel plan their config declares (`model_schedule/hf_plan.py`), and for the
hand-written MoE families: greedy decoding with a KV cache of a left-padded batch, tokens and
every step's logits (`test_generate_schedule`'s helpers), in one process over the knob sets a
declared family takes, at tp=2 and, for the MoE families, at ep=2 on 2 gloo ranks.

Architectures: `test_hf_plans.EQUIVALENT` (Gemma 2/3, Phi-3, OLMo 2, GLM-4, Granite, GPT-OSS,
Qwen2-MoE, the hybrids Qwen3.5, MiniMax, LFM3, Llama 4, ...) plus Mixtral, Qwen3-MoE and
DeepSeek-V3; `SLAPO_SWEEP=all` every declared decoder (`tests/hf_tiny.py`). Float32: HF's eager
attention upcasts scores to float32 for the softmax, where a float64 mask's `finfo.min` becomes
-inf, so a float64 model's left-padding rows are NaN and spread to the real tokens (HF's own
numbers, scheduled or not; Gemma 2, GPT-OSS and GraniteSWA default to eager).

Found by this file and fixed: `attention="sdpa"` (and Tempo's core) on attention that passes its
attention function a logit soft-cap (Gemma 2, VaultGemma) or sinks (GPT-OSS, GraniteSWA,
MiMo-V2, ...) crashed at the first forward after `apply` had changed the model, and silently
dropped Inkling 2's `sinks` and DeepSeek-V3.2's sparse `indices` (logits 0.67 off with 4 keys
selected): now refused by `apply` before any change, Tempo keeping such modules' own attention;
and `generate` under ep hung when one rank's rows all reached EOS first (the other ranks waited
in their next all-to-all): an ep model now generates with HF's `synced_gpus`.
"""

from __future__ import annotations

import copy
import warnings

import hf_tiny
import pytest
import sweep
import test_hf_plans
import test_knob_grid_tp as grid_tp
import torch
from test_generate_schedule import (
    SP_ERROR,
    assert_generates_alike,
    each_value_once,
    generate,
    prompts,
)
from test_knob_grid import _alone, all_pairs

import slapo
from slapo import model_schedule

DEFAULT = (*test_hf_plans.EQUIVALENT, "mixtral", "qwen3_moe", "deepseek_v3")
# one process: every pair of these values meets (values a family refuses alone are dropped)
FACTORS = {"attention": [None, "sdpa", "eager"],
           "ckpt": [(0.0, "full"), (1.0, "full"), (1.0, "selective")],
           "tempo": [False, True], "fused_loss": [False, True]}
# tp=2: every value once (`each_value_once`); sequence parallelism, where a family has it,
# must refuse to decode (one new token does not split over the ranks)
TP_FACTORS = {"attention": [None, "sdpa"],
              "ckpt": [(0.0, "full"), (1.0, "full"), (1.0, "selective")],
              "tempo": [False, True], "vocab_parallel": [True, False],
              "fused_loss": [False, True], "sequence_parallel": [False, True]}
# compiled blocks: each decoding step's cache length is a recompile (3-20 s per architecture
# here): one row on Gemma 3 (sliding window, scaled embedding) by default, every one with
# SLAPO_SWEEP=all
COMPILED = ("gemma3_text",)
EP_ROWS = ({}, {"attention": "sdpa", "ckpt_ratio": 1.0})
# equivalent architectures of the full sweep, one process and tp=2 (transformers 5.24, measured:
# docs/model_schedule.md "Generation after scheduling")
ALL_FLOOR = {"one process": 113, "tp=2": 105}
# each input `op.attention_core.UNCOMPUTED` names, on an architecture that passes it
DROPPED = {"gemma2": "softcap=", "gpt_oss": "s_aux=", "inkling2_text": "sinks=",
           "deepseek_v32": "indices=", "minimax_m3_vl_text": "block_indices="}


def _archs() -> list[tuple[str, str]]:
    classes = dict(hf_tiny.decoders())
    return [(a, classes[a]) for a in sweep.sample(classes, DEFAULT)]


# Tiny configs (`hf_tiny`) whose 2 layers are all Mamba: HF's cache cannot decode a model without
# an attention layer (`get_seq_length` refuses), so generation takes one of each, as the released
# checkpoints interleave them
ATTENTION_LAYER = {"bamba": {"attn_layer_indices": [1]},
                   "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]}}


def _tiny(arch: str, cls: str, meta: bool = False) -> torch.nn.Module:
    """The tiny model in float32 (module docstring: why not float64)."""
    config = None
    if arch in ATTENTION_LAYER:
        cfg = hf_tiny.tiny_config(arch)
        given = {k: v for k, v in cfg.to_dict().items()
                 if k not in ("model_type", "transformers_version", "architectures")}
        config = type(cfg)(**{**given, **ATTENTION_LAYER[arch]})
    model = hf_tiny.build(arch, cls, meta=meta, config=config)
    return model if meta else model.float()


def _knobs(row: dict) -> dict:
    """`apply`'s keywords for a design row (its `ckpt` factor is the ratio and the policy)."""
    knobs = {k: v for k, v in row.items() if k != "ckpt"}
    knobs["ckpt_ratio"], knobs["ckpt_policy"] = row["ckpt"]
    return knobs


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__


def _apply(base: torch.nn.Module, knobs: dict, mesh=None):
    """(model, schedule): a copy of `base` with `knobs` applied, or the refusal's problem (str).
    A refusal must be a SchedulingError that left the schedule's history empty (checked)."""
    model = copy.deepcopy(base)
    sch = slapo.create_schedule(model, mesh=mesh)
    try:
        model_schedule.apply(sch, **knobs)
    except slapo.SchedulingError as e:
        assert not list(sch.applied()), (knobs, list(sch.applied()))
        return e.problem
    return model, sch


def _taken(base: torch.nn.Module, factors: dict, exclusive, mesh=None) -> tuple[dict, list]:
    """The factor values `base`'s architecture takes, each applied alone, and those it refuses
    (`name=value`)."""
    taken, refused = {}, []
    for name, values in factors.items():
        taken[name] = [values[0]]
        for v in values[1:]:
            got = _apply(base, _knobs(_alone(factors, name, v, exclusive)), mesh)
            if isinstance(got, str):
                refused.append(f"{name}={v!r}")
            else:
                taken[name].append(v)
    return taken, refused


def _reference(base: torch.nn.Module, knobs: dict, want):
    """The unscheduled model (and its output, when already computed) for `knobs`: with
    `attention="eager"` a copy set to HF's eager attention, what the knob means (HF's eager
    and SDPA paths differ on left-padded rows: MiniMax's decoding by 3e-3 in its own logits)."""
    if knobs.get("attention") == "eager":
        ref = copy.deepcopy(base)
        ref.set_attn_implementation("eager")
        return ref, None
    return base, want


def _generates_alike(model, base: torch.nn.Module, knobs: dict, batch: dict, want, what: str):
    """None when `model` generates what the unscheduled `base` does, else the mismatch."""
    ref, ref_want = _reference(base, knobs, want)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_generates_alike(model, ref, batch, what, ref_want)
    except AssertionError as e:
        return f"MISMATCH {knobs}: {str(e).splitlines()[0][:200]}"
    return None


def _unscheduled(arch: str, cls: str) -> tuple | str:
    """The prompts, the unscheduled model and its generation; why not, as a row's outcome."""
    try:
        _tiny(arch, cls, meta=True)
    except hf_tiny.CannotBuild as e:
        return f"cannot build tiny config: {e}"
    batch, base = prompts(arch), _tiny(arch, cls)
    try:
        want = generate(base.eval(), batch)
    except Exception as e:  # noqa: BLE001 - HF's own model cannot generate: not Slapo's
        return f"cannot generate unscheduled (HF): {_short(e)}"
    return batch, base, want


def _one_process(arch: str, cls: str) -> str:
    """One architecture in one process: 'equivalent (...)', 'cannot ...', 'MISMATCH ...'."""
    ref = _unscheduled(arch, cls)
    if isinstance(ref, str):
        return ref
    batch, base, want = ref
    taken, refused = _taken(base, FACTORS, lambda row: False)
    rows = [_knobs(row) for row in all_pairs(taken)]
    if sweep.full() or arch in COMPILED:
        rows.append({**rows[-1], "compile_blocks": "eager"})
    for knobs in rows:
        got = _apply(base, knobs)
        if isinstance(got, str):  # values that apply alone must apply together
            return f"MISMATCH {knobs}: refused together: {got[:160]}"
        bad = _generates_alike(got[0], base, knobs, batch, want, f"{arch} {knobs}")
        torch._dynamo.reset()
        if bad:
            return bad
    return f"equivalent ({len(rows)} knob sets" + \
        (f"; refused alone: {', '.join(refused)})" if refused else ")")


def _safely(fn, *args) -> str:
    """`fn(*args)`, an exception other than a refusal reported as a crash (its last lines)."""
    import traceback

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args)
    except Exception as e:  # noqa: BLE001 - a crash is a result the test fails on
        return f"CRASH: {_short(e)} @ {traceback.format_exc().strip().splitlines()[-3:-1]}"


def _check(results: dict[str, str], what: str) -> None:
    print(f"\n{what}\n" + test_hf_plans.table(results))
    bad = {k: v for k, v in results.items() if v.startswith(("MISMATCH", "CRASH"))}
    assert not bad, bad
    assert all(results[a].startswith("equivalent") for a in DEFAULT), results
    if sweep.full():
        n_eq = sum(v.startswith("equivalent") for v in results.values())
        assert n_eq >= ALL_FLOOR[what], (what, n_eq, results)


@pytest.mark.compile
@pytest.mark.timeout(3600)  # the full sweep's compiled rows (SLAPO_SWEEP=all); the default ~20 s
def test_generate_after_scheduling_equals_the_unscheduled_model():
    """Every architecture in one process, each knob set of `FACTORS` it takes in all pairs
    (and a compiled row, `COMPILED`): signature, tokens and every step's logits."""
    torch.manual_seed(0)
    results = {arch: _safely(_one_process, arch, cls) for arch, cls in _archs()}
    _check(results, "one process")


@pytest.mark.parametrize("arch", sorted(DROPPED))
def test_attention_core_is_refused_where_it_would_drop_an_input(arch):
    """`attention="sdpa"` on attention that passes its attention function an input Slapo's
    core does not compute is refused before any change, naming the architecture and the
    input; Tempo keeps such a module's own attention (the rest of Tempo applies)."""
    from slapo.op import is_hf_attention
    from slapo.op.tempo import attention_choice

    cls = dict(hf_tiny.decoders())[arch]
    model = hf_tiny.build(arch, cls, meta=True)
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match=f"model_type='{arch}'.*{DROPPED[arch]}"):
        model_schedule.apply(sch, attention="sdpa")
    assert not list(sch.applied())
    eager = [attention_choice(m) for m in model.modules()
             if is_hf_attention(m) and m.config._attn_implementation == "eager"]
    assert any(DROPPED[arch] in c for c in eager) or not eager, eager
    assert all(c == "tempo" or c.startswith("kept eager (passes") for c in eager), eager


def test_a_hybrid_is_refused_before_its_first_swap():
    """MiMo-V2 with its full-attention layer (no sinks) first and its sliding one (sinks)
    second: the refusal comes before layer 0's attention is swapped, not half-way through."""
    cfg = hf_tiny.tiny_config("mimo_v2_flash")
    cfg.layer_types = ["full_attention", "sliding_attention"]
    model = hf_tiny.build("mimo_v2_flash", "MiMoV2FlashForCausalLM", meta=True, config=cfg)
    assert model.model.layers[0].self_attn.sinks is None
    sch = slapo.create_schedule(model)
    with pytest.raises(slapo.SchedulingError, match=r"layers\.1\.self_attn .*s_aux=self\.sinks"):
        model_schedule.apply(sch, attention="sdpa")
    assert not list(sch.applied())


def test_a_core_refuses_inputs_it_would_drop():
    """The cores' own check, at the call: a named input (soft-cap, sinks, indices) or any
    tensor it does not know raises; what the mask already encodes passes."""
    from slapo.op import SDPAttention, TempoAttentionCore

    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    module = torch.nn.Module()
    for core in (SDPAttention(), TempoAttentionCore()):
        for extra in ({"softcap": 30.0}, {"sinks": torch.zeros(2)},
                      {"indices": torch.zeros(1, 3, 2)}, {"new_bias": torch.zeros(3)}):
            with pytest.raises(ValueError, match=f"`{next(iter(extra))}`"):
                core(module, q, k, v, None, **extra)
        core(module, q, k, v, None, sliding_window=2, position_ids=torch.arange(3)[None],
             s_aux=None)


# ---- tp=2 and ep=2: one pool job each over every architecture -------------------------------

def _tp(arch: str, cls: str, mesh) -> str:
    """One architecture at tp=2, each value of `TP_FACTORS` it takes at least once, built
    (`slapo.build` wraps the sharded modules' parents, the vocabulary-parallel head's too)."""
    ref = _unscheduled(arch, cls)
    if isinstance(ref, str):
        return ref
    batch, base, want = ref
    if isinstance(plain := _apply(base, {}, mesh), str):
        return f"refused: {plain[:160]}"
    taken, refused = _taken(base, TP_FACTORS, grid_tp.exclusive, mesh)
    sp = taken.pop("sequence_parallel")
    rows = [_knobs(r) for r in each_value_once(taken, grid_tp.exclusive)]
    rows += [{**rows[0], "sequence_parallel": True}] if True in sp else []
    for knobs in rows:
        got = _apply(base, knobs, mesh)
        if isinstance(got, str):
            return f"MISMATCH {knobs}: refused together: {got[:160]}"
        model, _ = slapo.build(got[1], mesh=mesh)
        if knobs.get("sequence_parallel"):
            try:
                generate(model.eval(), batch)
            except RuntimeError as e:
                if SP_ERROR not in str(e):
                    return f"MISMATCH {knobs}: {_short(e)}"
                continue
            return f"MISMATCH {knobs}: generated under sequence parallelism"
        bad = _generates_alike(model, base, knobs, batch, want, f"{arch} tp=2 {knobs}")
        if bad:
            return bad
    return f"equivalent ({len(rows)} knob sets" + \
        (f"; refused alone: {', '.join(refused)})" if refused else ")")


def job_tp(archs: list[tuple[str, str]]) -> dict[str, str]:
    torch.set_num_threads(1)
    mesh = slapo.runtime.init_mesh(tp=2)
    return {arch: _safely(_tp, arch, cls, mesh) for arch, cls in archs}


@pytest.mark.slow
def test_generate_under_tp_equals_the_unscheduled_model(dist2):
    """Every architecture at tp=2 on two gloo ranks, in one pool job."""
    ranks = dist2.run(job_tp, _archs(), timeout=3000 if sweep.full() else 600)
    assert ranks[0] == ranks[1], (ranks[0], ranks[1])
    _check(ranks[0], "tp=2")


def _ep(arch: str, cls: str, mesh) -> str:
    """One architecture on an ep=2 mesh: refused cleanly (no experts plan), or each rank's own
    prompts (half the batch) generated as the unscheduled model generates them, also when one
    rank's rows all stop at EOS at once while the other's continue."""
    import torch.distributed as dist

    rank = dist.get_rank()
    try:
        _tiny(arch, cls, meta=True)
    except hf_tiny.CannotBuild as e:
        return f"cannot build tiny config: {e}"
    batch = {k: v[2 * rank:2 * rank + 2] if torch.is_tensor(v) else v
             for k, v in prompts(arch).items()}
    base = _tiny(arch, cls)
    for knobs in EP_ROWS:
        got = _apply(base, knobs, mesh)
        if isinstance(got, str):
            return f"refused: {got[:160]}"
        bad = _generates_alike(got[0], base, knobs, batch, None, f"{arch} ep=2 {knobs}")
        if bad:
            return bad
    return _ep_stops_apart(base.eval(), batch, got[0])


def _ep_stops_apart(ref: torch.nn.Module, batch: dict, model) -> str:
    """Rank 0's rows all end at their first token (their EOS), rank 1's run to the limit: the
    ranks' forward counts differ unless `generate` keeps them in step (else rank 1 waits in an
    all-to-all rank 0 never joins, until gloo's timeout)."""
    import torch.distributed as dist

    with torch.no_grad():
        first = ref.generate(**batch, max_new_tokens=1, do_sample=False)[:, -1]
    eos = sorted(set(first.tolist())) if dist.get_rank() == 0 else [127]
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=eos)
    with torch.no_grad():
        got, want = model.eval().generate(**batch, **kw), ref.generate(**batch, **kw)
    if not torch.equal(got, want):
        return f"MISMATCH stopping apart: {got.tolist()} instead of {want.tolist()}"
    new = got.shape[1] - batch["input_ids"].shape[1]
    return f"equivalent ({len(EP_ROWS)} knob sets; stopping apart: {new} new tokens)"


def job_ep(archs: list[tuple[str, str]]) -> dict[str, str]:
    from slapo.runtime.mesh import ParallelDims, init_mesh

    torch.set_num_threads(1)
    mesh = init_mesh(dims=ParallelDims(dp_replicate=2, ep=2, device="cpu"))
    return {arch: _safely(_ep, arch, cls, mesh) for arch, cls in archs}


def test_generate_under_ep_equals_the_unscheduled_model(dist2):
    """The MoE families with an expert-parallel plan at ep=2 (each rank its own prompts); the
    other architectures refused with a SchedulingError (no experts plan: dense, or MoE whose
    experts only tensor parallelism splits)."""
    ranks = dist2.run(job_ep, _archs(), timeout=3000 if sweep.full() else 600)
    results = {a: r0 if r0.startswith(("refused", "cannot")) else f"{r0} | rank 1: {r1}"
               for (a, r0), r1 in zip(ranks[0].items(), ranks[1].values(), strict=True)}
    print("\nep=2\n" + test_hf_plans.table(results))
    bad = {k: v for k, v in results.items() if "MISMATCH" in v or "CRASH" in v}
    assert not bad, bad
    for moe in ("mixtral", "qwen3_moe", "deepseek_v3"):  # rank 0 stopped first, rank 1 ran on
        assert results[moe].startswith("equivalent"), results[moe]
        assert "apart: 1 new tokens" in ranks[0][moe] and "apart: 4 new" in ranks[1][moe]
    assert all(v.startswith(("equivalent", "refused", "cannot")) for v in results.values())
    assert "no mixture-of-experts plan" in results.get("qwen2_moe", "no mixture-of-experts plan")
