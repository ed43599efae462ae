"""A Verify mismatch inside an MoE layer names the expert (issue 33, item 6), and Verify on
expert-parallel shards (`slapo.verify.experts`).

One process (tiny Mixtral and Qwen3-MoE, every layer checkpointed by `model_schedule.apply`):
one expert corrupted in the scheduled model (a weight nudged, two experts' weights swapped, one
expert's gradient offset by a hook) fails Verify and the report names exactly that expert, by
index, with its layer and tensor; the same schedule without the corruption passes.

ep=2 on 2 gloo ranks (`model_schedule.apply` on an ep mesh swaps the experts for
`op.moe.ExpertParallelExperts`), each rank on its own tokens: Verify compares each rank's
experts with the matching rows of the original's [E, ...] tensors (gradients: the original's
summed over the ep group) and passes; an expert corrupted on one rank is named by its global
index and the rank holding it, on both ranks; a token sent to the wrong rank is attributed to
the expert whose tokens it belongs to; weights that differ across the ep ranks are refused.
"""

from __future__ import annotations

import re

import pytest
import torch

FAMILIES = ("mixtral", "qwen3_moe")
_NAMED = re.compile(r"  (?:experts?) ([\d, ]+) of (\d+) \(layer ([\w.]+), ([^;)]+)")


def _named(text: str) -> list[tuple[tuple[int, ...], int, str, str]]:
    """Each expert line of a report: (expert indices, of how many, layer, what)."""
    return [(tuple(int(e) for e in m[1].split(", ")), int(m[2]), m[3], m[4])
            for m in _NAMED.finditer(text)]


def _verify(model, mutate, ids) -> str | None:
    """`model_schedule.apply(ckpt_ratio=1)` then `mutate(model)` under Verify (the model's
    own loss): None when it passes, else the report."""
    import slapo

    sch = slapo.create_schedule(model)
    try:
        with slapo.Verify(sch, example_kwargs={"input_ids": ids, "labels": ids},
                          loss_fn=lambda out: out.loss):
            slapo.model_schedule.apply(sch, ckpt_ratio=1.0)
            assert [p for p, _ in sch.applied()] == ["model.layers.0", "model.layers.1"]
            mutate(model)
        return None
    except slapo.VerificationError as e:
        return str(e)


def _nudge(layer: int, expert: int, name: str = "down_proj"):
    def mutate(model):
        with torch.no_grad():
            getattr(model.model.layers[layer].mlp.experts, name)[expert] += 0.01
    return mutate


def _swap(layer: int, a: int, b: int, name: str = "gate_up_proj"):
    def mutate(model):
        p = getattr(model.model.layers[layer].mlp.experts, name)
        with torch.no_grad():
            p[[a, b]] = p[[b, a]].clone()
    return mutate


def _grad_offset(layer: int, expert: int, name: str = "down_proj"):
    """The forward untouched; the expert's gradient offset by 1e-3 (a tensor hook)."""
    def mutate(model):
        p = getattr(model.model.layers[layer].mlp.experts, name)
        offset = torch.zeros_like(p)
        offset[expert] = 1e-3
        p.register_hook(lambda g: g + offset)
    return mutate


@pytest.mark.parametrize("family", FAMILIES)
def test_correct_schedule_passes(family, one_thread):
    import models

    assert _verify(getattr(models, family)(seed=0, experts=8), lambda m: None,
                   models.ids(2, 16)) is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_nudged_expert_is_named(family, one_thread):
    """Expert 2's down_proj of layer 1 off by 0.01: the experts module is the first divergence,
    its output differs on expert 2's tokens only, and expert 2's weights differ."""
    import models

    text = _verify(getattr(models, family)(seed=0, experts=8), _nudge(1, 2), models.ids(2, 16))
    assert text is not None
    layer = "model.layers.1.mlp.experts"
    assert f"\n  {layer}: forward output differs" in text, text
    assert _named(text) == [((2,), 8, layer, "forward output on its tokens"),
                            ((2,), 8, layer, "down_proj")], text
    rows = re.search(r"token rows differing: (\d+) of its (\d+)", text)
    assert rows and int(rows[1]) == int(rows[2]) > 0, text  # every token row of expert 2


@pytest.mark.parametrize("family", FAMILIES)
def test_two_swapped_experts_are_named(family, one_thread):
    import models

    text = _verify(getattr(models, family)(seed=0, experts=8), _swap(0, 3, 5),
                   models.ids(2, 16))
    layer = "model.layers.0.mlp.experts"
    assert text is not None and f"\n  {layer}: forward output differs" in text, text
    assert _named(text) == [((3, 5), 8, layer, "forward output on their tokens"),
                            ((3, 5), 8, layer, "gate_up_proj")], text
    assert "experts 3, 5 of 8 (layer model.layers.0.mlp.experts, gate_up_proj)" in text


@pytest.mark.parametrize("family", FAMILIES)
def test_one_experts_gradient_is_named(family, one_thread):
    """Outputs and input gradients agree, expert 6's down_proj gradient does not: Verify fails
    on that gradient and the localisation names expert 6 (the others' gradients agree)."""
    import models

    text = _verify(getattr(models, family)(seed=0, experts=8), _grad_offset(1, 6),
                   models.ids(2, 16))
    assert text is not None
    assert text.startswith("grad model.layers.1.mlp.experts.down_proj does not match"), text
    assert "no module's forward output or input gradient differs" in text, text
    assert _named(text) == [((6,), 8, "model.layers.1.mlp.experts", "grad down_proj")], text


# ---- ep=2 on two gloo ranks ------------------------------------------------------------------
def _ep_case(family: str, mesh, mutate=None, seed: int = 0) -> str | None:
    """Verify around `model_schedule.apply` on the ep mesh, each rank on its own tokens, then
    `mutate(model, rank)`: None when it passes, else the report."""
    import models
    import torch.distributed as dist

    import slapo

    rank = dist.get_rank()
    model = getattr(models, family)(seed=seed)
    sch = slapo.create_schedule(model, mesh=mesh)
    ids = models.ids(2, 16, seed=1 + rank)
    try:
        with slapo.Verify(sch, example_kwargs={"input_ids": ids, "labels": ids},
                          loss_fn=lambda out: out.loss) as v:
            slapo.model_schedule.apply(sch)
            if mutate is not None:
                mutate(model, rank)
    except slapo.VerificationError as e:
        return str(e)
    experts = model.model.layers[1].mlp.experts
    assert type(experts).__name__ == "ExpertParallelExperts", type(experts)
    assert tuple(experts.down_proj.shape) == (2, 64, 32)  # E/ep local experts
    # the experts' gradients and stepped values were compared, whole
    assert {k for k in v.report if "layers.1.mlp.experts" in k} == {
        f"{kind} model.layers.1.mlp.experts.{n}" for kind in ("grad", "param after step")
        for n in ("gate_up_proj", "down_proj")}, v.report
    return None


def _on_rank(rank: int, mutate):
    return lambda model, r: mutate(model) if r == rank else None


def job_verify_on_expert_parallel_shards() -> dict:
    """Each case's report (None: passed), the same on both ranks."""
    import torch.distributed as dist
    from test_moe import _off_by_one

    import slapo.op.moe as moe
    from slapo.runtime.mesh import ParallelDims, init_mesh

    mesh = init_mesh(dims=ParallelDims(dp_replicate=2, ep=2, device="cpu"))
    out = {f"correct {f}": _ep_case(f, mesh) for f in FAMILIES}
    # rank 1 holds experts 2, 3: its local expert 1 is expert 3
    out["nudged"] = _ep_case("mixtral", mesh, _on_rank(1, _nudge(1, 1)))
    out["grad"] = _ep_case("qwen3_moe", mesh, _on_rank(0, _grad_offset(0, 1, "gate_up_proj")))
    honest = moe.send_splits
    try:
        out["misrouted"] = _ep_case("mixtral", mesh, lambda m, r: setattr(
            moe, "send_splits", _off_by_one(honest)))
    finally:
        moe.send_splits = honest
    # each rank's model created with its own seed: refused on entry
    out["seeds"] = _ep_case("mixtral", mesh, seed=dist.get_rank())
    return out


@pytest.mark.dist
def test_verify_on_expert_parallel_shards(dist2):
    results = dist2.run(job_verify_on_expert_parallel_shards, timeout=300)
    assert results[0] == results[1], "the ranks disagree"
    res = results[0]
    assert res["correct mixtral"] is None and res["correct qwen3_moe"] is None, res
    layer1, layer0 = "model.layers.1.mlp.experts", "model.layers.0.mlp.experts"

    text = res["nudged"]
    assert text is not None and f"\n  {layer1}: forward output differs" in text, text
    assert _named(text) == [((3,), 4, layer1, "forward output on its tokens"),
                            ((3,), 4, layer1, "down_proj")], text
    assert "held by ep rank 1" in text and "replace(" in text, text

    text = res["grad"]
    assert text is not None and text.startswith(
        f"grad {layer0}.gate_up_proj does not match"), text
    assert _named(text) == [((1,), 4, layer0, "grad gate_up_proj")], text
    assert "held by ep rank 0" in text, text

    # one row sent to the other rank: a token of one expert computed by another, no weight
    # differs; the expert whose tokens it was is named, with fewer rows differing than it has
    text = res["misrouted"]
    assert text is not None, "a misrouted token passed"
    named = _named(text)
    assert len(named) == 1 and named[0][3] == "forward output on its tokens", text
    rows = re.search(r"token rows differing: (\d+) of its (\d+)", text)
    assert rows and 0 < int(rows[1]) < int(rows[2]), text

    assert "differs across the ranks of the expert-parallel (ep) group" in res["seeds"]
