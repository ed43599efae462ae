"""`generate()` after scheduling equals the unscheduled model's, for every ready family with a
`generate` and every knob set the knob grids cover, in one process and under TP=2 (issue 29).

Why a sweep: after `fused_loss=True`, or `slapo.build` under TP with a vocabulary-parallel
head, the root's `forward` became `(*args, **kwargs)` (the fused-loss kernel and the shape-error
wrapper swap the module's class, `slapo.module_patch`). Hugging Face's `generate` reads
`inspect.signature(model.forward)` to decide what to pass, so it stopped passing
`position_ids`: left-padded prompts were generated with positions counted from the pads
(GPT-2's first-token logits 0.86 relative off, GPT-Neo 3 of 4 rows other tokens). Any class
Slapo installs must keep the signature; here every knob set is checked end to end: the
signature, the tokens of greedy decoding with a KV cache, and every step's logits.

`ckpt_ratio` / `compile_blocks` used to set `config.use_cache=False` on the user's model, which
`save_pretrained` wrote to disk (issue 29, item 6): the configs must stay the user's, and a
training forward must still build no cache (checkpointed layers would append to it twice).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import json
import warnings

import pytest
import test_knob_grid_tp as grid_tp
import torch
from test_knob_grid import FACTORS, _apply_or_refuse_untouched, _knobs, all_pairs, family_factors

import slapo
from slapo import model_schedule

# every ready family with a `generate` (decoder-only LMs, and T5 for encoder-decoder)
FAMILIES = ["gpt2", "gpt_neo", "opt", "llama", "mistral", "qwen2", "qwen3", "t5"]
PADS = (0, 1, 3, 5)  # left pads per row: rows of different lengths in one batch
NEW = 4


def prompts(family: str, seq: int = 8) -> dict:
    """A left-padded batch: `input_ids` with the family's pad id where `attention_mask` is 0."""
    import models

    pad = 1 if family == "opt" else 0
    ids = models.ids(len(PADS), seq, seed=3).clamp(min=2)
    mask = torch.ones_like(ids)
    for row, n in enumerate(PADS):
        mask[row, :n] = 0
    return {"input_ids": ids.masked_fill(mask == 0, pad), "attention_mask": mask,
            "pad_token_id": pad}


def generate(model: torch.nn.Module, batch: dict):
    """Greedy decoding of `NEW` tokens with the KV cache, every step's raw logits kept."""
    with torch.no_grad():
        return model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              use_cache=True, output_logits=True, return_dict_in_generate=True)


def assert_generates_alike(model: torch.nn.Module, ref: torch.nn.Module, batch: dict,
                           what: str, want=None):
    """`model` generates `ref`'s tokens with `ref`'s logits at every step (`want`: `ref`'s
    output, if already computed); returns `ref`'s output."""
    model.eval()
    ref.eval()
    want = generate(ref, batch) if want is None else want
    got = generate(model, batch)
    assert torch.equal(got.sequences, want.sequences), \
        f"{what}: generated\n{got.sequences}\ninstead of\n{want.sequences}"
    for step, (g, w) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, s=step: f"{what}, step {s} logits: {m}")
    assert inspect.signature(model.forward) == inspect.signature(ref.forward), what
    return want


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Compiled rows leave no compiled code behind (the recompile limit is per code object)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# The knob grid's factors split by cost: the cheap ones meet in all pairs; `fuse` (an
# aot_eager-compiled MLP region) and `compile_blocks` (each decoding step's new cache length is a
# recompile: 5-30 s a row here) join one row each, the compiled row on GPT-2 only.
HEAVY = ("fuse", "compile_blocks")
COMPILED = ("gpt2",)


def generate_rows(family: str) -> list[dict]:
    """The knob sets checked on `family` (see `HEAVY`): all pairs of the cheap factors' values
    the family takes, then the fullest such row with `fuse=True` (where the family fuses), and
    with `compile_blocks="eager"` (on `COMPILED`)."""
    cheap = {name: values if name not in HEAVY else values[:1]
             for name, values in FACTORS.items()}
    rows = all_pairs(family_factors(family, cheap))
    fullest = max(rows, key=lambda r: sum(r[n] != cheap[n][0] for n in cheap))
    heavy = [{**fullest, "fuse": True}]
    if family in COMPILED:
        heavy.append({**fullest, "compile_blocks": "eager"})
    return rows + heavy


@pytest.mark.compile
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_after_every_knob_set_equals_the_unscheduled_model(family):
    """Each knob set of `generate_rows` (attention, checkpointing full/selective, kernels,
    Tempo, fused loss in all pairs; fuse; compiled blocks) on this family, in eval mode: the
    signature, tokens and every step's logits of the unscheduled model, with left padding."""
    import models

    batch = prompts(family)
    want = assert_generates_alike(getattr(models, family)(seed=0),
                                  getattr(models, family)(seed=0), batch, "unscheduled")
    checked = 0
    for row in generate_rows(family):
        knobs = _knobs(row)
        built = _apply_or_refuse_untouched(family, knobs)
        if built is None:  # a heavy knob the family refuses (T5 v1 and OPT: nothing to fuse)
            assert row["fuse"], knobs
            continue
        model, ref, _ = built
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # compiled rows' recompile notices
            assert_generates_alike(model, ref, batch, f"{family} {knobs}", want)
        torch._dynamo.reset()
        checked += 1
    assert checked >= 8, (family, checked)


@pytest.mark.parametrize("knobs", [{"fused_loss": True}, {"ckpt_ratio": 1.0},
                                   {"compile_blocks": "eager"}])
def test_scheduled_root_keeps_the_forward_signature(knobs):
    """The cheap, direct form of the class: after the knobs that patch the root (the fused-loss
    kernel), and after `slapo.build` (which wraps shape-changing modules; mixed precision wraps
    the forward in autocast), the root's forward has the original's signature, and a second
    patch keeps it."""
    import models

    from slapo import module_patch
    from slapo.runtime.shape_errors import ShapeErrorWrapper

    model, ref = models.gpt2(seed=0), models.gpt2(seed=0)
    sch = model_schedule.apply(model, **knobs)
    slapo.build(sch, mixed_precision="bf16")
    module_patch.add_wrapper(model, ShapeErrorWrapper("", None))
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert model.forward.__name__ == "forward"


@pytest.mark.parametrize(("family", "knobs"), [("llama", {"ckpt_ratio": 1.0}),
                                               ("t5", {"ckpt_ratio": 1.0}),
                                               ("llama", {"compile_blocks": "eager"})])
def test_scheduling_leaves_use_cache_as_the_user_set_it(family, knobs, tmp_path):
    """Item 6: `save_pretrained` of a checkpointed (or compiled) model writes the user's
    `use_cache`, every config in the model keeps its value, and a training forward still runs
    without a KV cache (no warning from the checkpointed layers, no cache returned)."""
    import models

    from slapo.primitives import checkpoint as ckpt_primitive

    model = getattr(models, family)(seed=0)

    def configs(m):
        return [(n, mod.config.use_cache) for n, mod in m.named_modules()
                if "config" in mod.__dict__ and hasattr(mod.config, "use_cache")]

    before = configs(model)
    assert any(v for _, v in before)
    model_schedule.apply(model, **knobs)
    assert configs(model) == before
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
    ckpt_primitive._WARNED.clear()  # the warning is once per class and process
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*runs without its KV cache")
        out = model(**models.batch_for(family))
    assert getattr(out, "cache", None) is None and getattr(out, "past_key_values", None) is None
    out.loss.backward()
    # a call that asks for the cache (or continues one) gets it: generation keeps its cache
    model.eval()
    with torch.no_grad():
        asked = model(**models.batch_for(family), use_cache=True)
    # transformers 5.24 names it `cache`, earlier 5.x (the GPU image's 5.17) `past_key_values`
    assert (getattr(asked, "cache", None) or getattr(asked, "past_key_values", None)) is not None


# ---- tensor parallelism: one pool job for every family ----------------------------------------

def each_value_once(factors: dict[str, list], exclusive) -> list[dict]:
    """A few rows in which every value of every factor appears at least once (greedy; the
    rows `exclusive` refuses by design are never made). Under TP each row costs a generate on
    two ranks, so the TP sweep covers values, the one-process sweep pairs."""
    names = list(factors)
    product = [dict(zip(names, values, strict=True))
               for values in itertools.product(*(factors[n] for n in names))]
    product = [row for row in product if not exclusive(row)]
    uncovered = {(n, repr(v)) for n in names for v in factors[n]}
    rows = []
    while uncovered:
        best = max(product, key=lambda r: len({(n, repr(r[n])) for n in names} & uncovered))
        uncovered -= {(n, repr(best[n])) for n in names}
        rows.append(best)
    return rows


SP_ERROR = "sequence parallelism needs the sequence length"


def job_tp_generate(families: list[str]) -> list[str]:
    """On each rank: for every family, each TP knob set applied on the mesh's tp group and
    built (`slapo.build` wraps the sharded modules' parents, the LM head's included), then
    `generate` compared with the unscheduled model. Sequence parallelism cannot decode token by
    token (one new token does not split over two ranks): generating must fail loudly there,
    naming the cause, never run on. Returns the rows checked."""
    import models

    mesh = slapo.runtime.init_mesh(tp=2)
    checked = []
    for family in families:
        batch = prompts(family)
        want = None
        factors = family_factors(family, grid_tp.FACTORS, grid_tp.exclusive, tp=2)
        sp = factors.pop("sequence_parallel")
        rows = each_value_once(factors, grid_tp.exclusive)
        rows += [{**rows[0], "sequence_parallel": True}] if True in sp else []
        for row in rows:
            knobs = _knobs(row)
            model = getattr(models, family)(seed=0)
            ref = copy.deepcopy(model)
            sch = model_schedule.apply(model, mesh=mesh, **knobs)
            model, _ = slapo.build(sch, mesh=mesh)
            what = f"{family} tp=2 {knobs}"
            if knobs.get("sequence_parallel"):
                try:
                    generate(model.eval(), batch)
                except RuntimeError as e:
                    assert SP_ERROR in str(e), (what, e)
                else:
                    raise AssertionError(f"{what}: generated under sequence parallelism")
            else:
                want = assert_generates_alike(model, ref, batch, what, want)
            checked.append(f"{family} {knobs}")
    return checked


@pytest.mark.dist
def test_generate_under_tp_equals_the_unscheduled_model(dist2):
    """Every ready family at tp=2 on two gloo ranks, every TP knob value at least once (the
    vocabulary-parallel head, whose parent `build` wraps, in most rows), in one pool job."""
    ranks = dist2.run(job_tp_generate, FAMILIES, timeout=600)
    assert ranks[0] == ranks[1]
    assert len(ranks[0]) >= 3 * len(FAMILIES), ranks[0]


def job_fsdp_generate_stopping_apart(family: str) -> dict:
    """FSDP2 over 2 ranks, each rank its own prompts: rank 0's rows all end at their first
    token (its EOS), rank 1's run to the limit. Every FSDP2 forward all-gathers, so the ranks
    must stay in step, or rank 1 waits for an all-gather rank 0 never joins: torch's
    `fully_shard` marks the modules `_is_fsdp_managed_module`, which HF's `generate` reads to
    turn on `synced_gpus` (an ep model sets the same flag itself: `moe.generate_in_step`).
    Returns whether each rank generated what the unscheduled model does."""
    import models
    import torch.distributed as dist

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = getattr(models, family)(seed=0).eval()
    batch = {k: v[2 * rank:2 * rank + 2] if torch.is_tensor(v) else v
             for k, v in prompts(family).items()}
    mesh = slapo.runtime.init_mesh(dp=2)
    sch = model_schedule.apply(copy.deepcopy(ref), mesh=mesh)
    model, _ = slapo.build(sch, mesh=mesh, data_parallel="fsdp")
    with torch.no_grad():
        first = ref.generate(**batch, max_new_tokens=1, do_sample=False)[:, -1]
    eos = sorted(set(first.tolist())) if rank == 0 else [127]
    kw = dict(max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    with torch.no_grad():
        got, want = model.eval().generate(**batch, **kw), ref.generate(**batch, **kw)
    return {"equal": torch.equal(got, want), "new": got.shape[1] - batch["input_ids"].shape[1]}


@pytest.mark.dist
def test_fsdp2_ranks_generate_in_step_when_they_stop_apart(dist2):
    ranks = dist2.run(job_fsdp_generate_stopping_apart, "llama", timeout=120)
    assert all(r["equal"] for r in ranks), ranks
    assert ranks[0]["new"] < ranks[1]["new"], ranks  # they did stop apart
