"""`num_items_in_batch` (what HF's Trainer passes) and token-level heads train like one process.

Issue 29 items 1 and 4: a batch that carries `num_items_in_batch` was handed unchanged to every
accumulation slice, so an HF causal LM divided each slice's sum by the global count and the
step's token weights divided again (one process with `grad_accum=2`: loss 11.6% off); a
`*ForTokenClassification` head's -100 labels were averaged per unit under DDP and
accumulation. Every layout below is compared with one process on the whole batch: its loss, and
the gradient it applies (SGD at lr 1: the update is the gradient, which AdamW's first step, about
`lr * sign(g)`, would hide). `num_items_in_batch` is given as the true count (HF Trainer's) and
as another number (the loss is then `sum / that number`, which only a step that honours it
reproduces); BERT's heads ignore it in one process, and so must the step.
"""

from __future__ import annotations

import pytest
import torch

import slapo
from slapo.errors import SchedulingError
from slapo.runtime.token_mean import UnitMeanNotice, label_shift, loss_divides_by_num_items

LR = 1.0


def token_classifier(seed: int = 0):
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                        num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.BertForTokenClassification(cfg).eval()


def make_model(family: str):
    import models

    if family == "bert_tok":
        return token_classifier()
    if family == "bert_mlm":
        return models.bert_mlm(seed=0, layers=2)
    return getattr(models, family)(seed=0, layers=2)


def make_batch(family: str, num_items: str) -> dict:
    """Eight rows whose supervised-token counts differ (padding, masking); `num_items`: "none",
    "true" (the count HF's Trainer passes) or "other" (a different number)."""
    import models

    ids = models.ids(batch=8, seq=16, seed=3)
    g = torch.Generator().manual_seed(4)
    if family == "bert_tok":
        labels = torch.randint(0, 5, ids.shape, generator=g)
    else:
        labels = ids.clone()
    if family in ("roberta", "albert"):
        ids = ids.clamp(min=3)  # clear of padding and special ids
        labels = ids.clone()
    if family in ("bert_mlm", "roberta", "albert", "bert_tok"):
        labels[torch.rand(ids.shape, generator=g) > 0.4] = -100
    else:
        for row, length in enumerate((16, 3, 9, 16, 5, 12, 2, 16)):
            labels[row, length:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if num_items != "none":
        shift = label_shift(make_model(family))
        n = int((labels[..., shift:] != -100).sum())
        batch["num_items_in_batch"] = torch.tensor(n if num_items == "true" else n + 37)
    return batch


def one_process(family: str, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The unscheduled model on the whole batch: loss and every parameter's gradient."""
    model = make_model(family)
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None}


def _full(state: dict) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.items()}


def step_like_one_process(family: str, batch: dict, *, mesh=None, knobs: dict | None = None,
                          cut: str | None = None, **build_kw) -> tuple[float, float]:
    """One `train_step` of SGD(lr=1) on the scheduled model: (relative loss difference, largest
    gradient difference / largest gradient) against `one_process`."""
    from slapo import model_schedule
    from slapo.consolidate import consolidate

    want_loss, want_grads = one_process(family, batch)
    model = make_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if knobs is not None:
        sch = model_schedule.apply(model, mesh=mesh, **knobs)
    else:
        sch = slapo.create_schedule(model, mesh=mesh)
    if cut is not None:
        sch[cut].cut_pipeline_stage()
    tm, _ = slapo.build(sch, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": LR}, mesh=mesh,
                        **build_kw)
    loss = tm.train_step(batch)
    after = _full(tm.state_dict()) if "pipeline" in build_kw else consolidate(tm)
    scale = max(g.abs().max().item() for g in want_grads.values())
    worst = 0.0
    for name, g in want_grads.items():
        if name not in after:  # another pipeline rank's stage
            continue
        got = (before[name] - after[name]) / LR
        worst = max(worst, (got - g).abs().max().item() / scale)
    return abs(loss - want_loss) / abs(want_loss), worst


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------

FAMILIES = ["gpt2", "gpt_neo", "opt", "llama", "qwen2", "qwen3", "mistral", "bert_mlm", "roberta",
            "albert", "bert_tok", "t5", "t5_gated"]


def test_which_heads_divide_by_num_items():
    """Read from the installed transformers: HF's causal LMs divide their sum by it, BERT's
    heads and T5 take the plain mean (so a batch's number changes nothing there)."""
    assert loss_divides_by_num_items(make_model("gpt2")) is True
    assert loss_divides_by_num_items(make_model("llama")) is True
    assert loss_divides_by_num_items(make_model("bert_mlm")) is False
    assert loss_divides_by_num_items(make_model("bert_tok")) is False
    assert label_shift(make_model("bert_tok")) == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_accumulation_with_num_items_equals_one_process(family, one_thread):
    """grad_accum 2 and 4, the number true and other: loss and gradient of one process."""
    for num_items in ("true", "other"):
        batch = make_batch(family, num_items)
        for k in (2, 4):
            dl, dg = step_like_one_process(family, batch, grad_accum=k)
            assert dl < 1e-5 and dg < 1e-5, (family, num_items, k, dl, dg)


def test_the_number_is_honoured_not_replaced():
    """A causal LM given another number trains on `sum / that number` (not the token mean);
    without accumulation as with it."""
    true, other = make_batch("gpt2", "true"), make_batch("gpt2", "other")
    assert abs(one_process("gpt2", true)[0] - one_process("gpt2", other)[0]) > 1e-2
    dl, dg = step_like_one_process("gpt2", other)
    assert dl < 1e-6 and dg < 1e-6


def llama_head(kind: str):
    """A tiny LLaMA with a per-sample head: HF's generic sequence-classification head calls
    `self.loss_function` *without* `num_items_in_batch` (a plain mean), the question-answering
    head hands it on (a sum over the batch divided by it)."""
    import models
    import transformers as tf

    cfg = models.llama(seed=0, layers=2).config
    cfg.pad_token_id, cfg.num_labels = 0, 3
    torch.manual_seed(0)
    cls = tf.LlamaForSequenceClassification if kind == "seq" else tf.LlamaForQuestionAnswering
    return cls(cfg).eval()


def _per_sample_step(kind: str, batch: dict, k: int) -> tuple[float, float]:
    """`step_like_one_process` for the per-sample heads (built by `llama_head`)."""
    ref = llama_head(kind)
    want = ref(**batch).loss
    want.backward()
    model = llama_head(kind)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR}, grad_accum=k)
    loss = tm.train_step(batch)
    scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    worst = max(((before[n] - p.detach()) / LR - g.grad).abs().max().item() / scale
                for (n, p), g in zip(model.named_parameters(), ref.parameters(), strict=True)
                if g.grad is not None)
    return abs(loss - want.item()) / abs(want.item()), worst


def test_per_sample_heads_with_num_items_equal_one_process(one_thread):
    """Whether a head divides by the number is read from its call of `self.loss_function`,
    not from the call's presence: LLaMA's sequence-classification head ignores the number (a
    rule that only looked for `self.loss_function` summed its unit means, k times the loss),
    its question-answering head divides by it (each unit's loss is then a share of one sum:
    `UnitSum`)."""
    import models

    from slapo.runtime.token_mean import forward_divides_by_num_items

    seq, qa = llama_head("seq"), llama_head("qa")
    assert forward_divides_by_num_items(type(seq).forward) is False
    assert forward_divides_by_num_items(type(qa).forward) is True
    ids = models.ids(batch=8, seq=16, seed=5).clamp(min=1)  # no padding id: the last token
    g = torch.Generator().manual_seed(6)
    batches = {"seq": {"input_ids": ids, "labels": torch.randint(0, 3, (8,), generator=g)},
               "qa": {"input_ids": ids, "start_positions": torch.randint(0, 16, (8,), generator=g),
                      "end_positions": torch.randint(0, 16, (8,), generator=g)}}
    for kind, batch in batches.items():
        for n in (8, 45):
            for k in (2, 4):
                dl, dg = _per_sample_step(kind, {**batch, "num_items_in_batch": torch.tensor(n)}, k)
                assert dl < 1e-5 and dg < 1e-5, (kind, n, k, dl, dg)


def test_fused_loss_with_num_items_equals_one_process(one_thread):
    for num_items in ("true", "other"):
        batch = make_batch("llama", num_items)
        dl, dg = step_like_one_process("llama", batch, knobs={"fused_loss": True}, grad_accum=2)
        assert dl < 1e-5 and dg < 1e-5, (num_items, dl, dg)


def test_a_loss_fn_with_num_items_over_several_units_is_refused():
    """Whether a user's loss divides by the number is its own code: over several units the
    step cannot weight it, and says so before any gradient is taken."""
    model = make_model("gpt2")
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR}, grad_accum=2,
                        loss_fn=lambda out, b: out.loss)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(SchedulingError, match="num_items_in_batch"):
        tm.train_step(make_batch("gpt2", "true"))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # one unit: nothing to weight, the loss_fn's value is the step's
    tm1, _ = slapo.build(slapo.create_schedule(make_model("gpt2")), optimizer=torch.optim.SGD,
                         optimizer_kwargs={"lr": LR}, loss_fn=lambda out, b: out.loss)
    assert tm1.train_step(make_batch("gpt2", "true")) == pytest.approx(
        one_process("gpt2", make_batch("gpt2", "true"))[0], rel=1e-6)


def test_a_unit_mean_of_per_token_labels_is_noticed():
    """A head whose denominator the step does not know, given -100 labels per token over
    several units, is averaged per unit: a notice says that it is not the token mean."""
    from slapo.notices import reset_notices

    reset_notices()
    model = make_model("gpt2")
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR}, grad_accum=2,
                        loss_fn=lambda out, b: out.loss)
    with pytest.warns(UnitMeanNotice, match="not the mean one process"):
        tm.train_step(make_batch("gpt2", "none"))


# ------------------------------------------------------------------------------------------------
# real gloo ranks: DDP, FSDP2, TP, pipelines
# ------------------------------------------------------------------------------------------------

CAUSAL_CUT = {"gpt2": "transformer.h.0", "llama": "model.layers.0"}


def job_layouts(families: list[str]) -> dict:
    import slapo.runtime

    out = {}
    for family in families:
        for num_items in ("true", "other"):
            batch = make_batch(family, num_items)
            cases = {
                "ddp": ({"dp": 2}, {"data_parallel": "ddp"}, None, None),
                "ddp+accum": ({"dp": 2}, {"data_parallel": "ddp", "grad_accum": 2}, None, None),
                "fsdp+accum": ({"dp": 2}, {"data_parallel": "fsdp", "grad_accum": 2}, None,
                               None),
                "tp+accum": ({"tp": 2}, {"grad_accum": 2}, {}, None),
            }
            if family in CAUSAL_CUT:
                cases["tp+fused_loss"] = ({"tp": 2}, {"grad_accum": 2},
                                          {"fused_loss": True, "vocab_parallel": False}, None)
                cases["1f1b"] = ({"pp": 2}, {"pipeline": "1F1B", "num_microbatches": 4}, None,
                                 CAUSAL_CUT[family])
            if family == "bert_mlm":
                cases["gpipe+accum"] = ({"pp": 2}, {"pipeline": "GPipe", "num_microbatches": 2,
                                                    "grad_accum": 2}, None,
                                        "bert.encoder.layer.0")
            for name, (dims, kw, knobs, cut) in cases.items():
                mesh = slapo.runtime.init_mesh(**dims)
                out[f"{family} {num_items} {name}"] = step_like_one_process(
                    family, batch, mesh=mesh, knobs=knobs, cut=cut, **kw)
    return out


@pytest.mark.dist
def test_every_layout_with_num_items_equals_one_process(dist2):
    res = dist2.run(job_layouts, ["gpt2", "llama", "bert_mlm", "bert_tok"], timeout=400)
    bad = {k: v for k, v in res[0].items() if not (v[0] < 1e-5 and v[1] < 1e-5)}
    assert not bad, bad
    assert res[0].keys() == res[1].keys()


def job_unequal_counts() -> str:
    import torch.distributed as dist

    import slapo.runtime

    mesh = slapo.runtime.init_mesh(dp=2)
    model = make_model("gpt2")
    tm, _ = slapo.build(slapo.create_schedule(model, mesh=mesh), optimizer=torch.optim.SGD,
                        optimizer_kwargs={"lr": LR}, mesh=mesh, data_parallel="ddp",
                        batch_is_global=False)
    batch = make_batch("gpt2", "true")
    local = {**batch, "num_items_in_batch": batch["num_items_in_batch"] + dist.get_rank()}
    try:
        tm.train_step(local)
    except SchedulingError as e:
        return str(e)
    return "trained"


@pytest.mark.dist
def test_num_items_that_differ_between_ranks_are_refused_on_every_rank(dist2):
    """Local counts (HF Trainer with average_tokens_across_devices=False) would scale the
    gradient by the dp degree: every rank refuses, none hangs."""
    res = dist2.run(job_unequal_counts, timeout=120)
    assert all("differs between the data-parallel ranks" in r for r in res), res
