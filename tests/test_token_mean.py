"""The step's loss is one mean over the supervised tokens of the global batch
(`slapo.runtime.token_mean`), however the batch is split: accumulation slices, DDP / FSDP2
ranks, pipeline micro-batches. Masked-LM labels (a different number of -100s per row) and padded
causal-LM labels train exactly like one process on the whole batch; a user `loss_fn` keeps the
mean over units."""

from __future__ import annotations

import copy

import pytest
import torch
from reference import LR

import slapo
from slapo.runtime.token_mean import label_shift, supervised_tokens, token_mean

STEPS = 3


def _masked(ids: torch.Tensor, seed: int, keep: float) -> torch.Tensor:
    """Labels with -100 outside a random `keep` share of positions (rows differ in count)."""
    g = torch.Generator().manual_seed(seed)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) > keep] = -100
    return labels


def batches(kind: str) -> list[dict]:
    import models

    out = []
    for s in range(STEPS):
        ids = models.ids(batch=8, seq=16, seed=20 + s)
        if kind == "mlm":
            labels = _masked(ids, s, keep=0.15)
        elif kind == "mlm_empty":  # the first two rows supervise nothing: a whole slice of
            labels = _masked(ids, s, keep=0.5)  # the accumulation / micro-batch split is empty
            labels[:2] = -100
        else:  # causal LM, right-padded rows of different lengths
            labels = ids.clone()
            for row, length in enumerate((16, 3, 9, 16, 5, 12, 2, 16)):
                labels[row, length:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def one_process(model, data, loss_fn=None) -> list[float]:
    """AdamW on each whole batch, the model's own (token-mean) loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for b in data:
        opt.zero_grad()
        out = model(**b)
        loss = loss_fn(out, b) if loss_fn else out.loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _model(kind: str, layers: int = 2):
    import models

    return models.bert_mlm(seed=0, layers=layers) if kind.startswith("mlm") else \
        models.gpt2(seed=0, layers=layers)


def _params_equal(tm_params: dict, ref) -> None:
    for name, p in ref.named_parameters():
        if name in tm_params:
            torch.testing.assert_close(tm_params[name], p.detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


def job_splits(kind: str) -> dict:
    import slapo.runtime

    out = {}
    cases = {"ddp+accum": ({"dp": 2}, {"data_parallel": "ddp", "grad_accum": 2}),
             "fsdp": ({"dp": 2}, {"data_parallel": "fsdp"}),
             "gpipe": ({"pp": 2}, {"pipeline": "GPipe", "num_microbatches": 4})}
    for name, (dims, kw) in cases.items():
        mesh = slapo.runtime.init_mesh(**dims)
        model = _model(kind, layers=4 if "pipeline" in kw else 2)
        ref = copy.deepcopy(model)
        sch = slapo.create_schedule(model, mesh=mesh)
        if "pipeline" in kw:
            prefix = "bert.encoder.layer" if kind.startswith("mlm") else "transformer.h"
            sch[f"{prefix}.1"].cut_pipeline_stage()
        tm, _ = slapo.build(sch, optimizer=torch.optim.AdamW, optimizer_kwargs={"lr": LR}, **kw)
        data = batches(kind)
        losses = [tm.train_step(b) for b in data]
        want = one_process(ref, data)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-5, atol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                  for n, p in tm.named_parameters()}
        _params_equal(params, ref)
        out[name] = losses
        out[name + " eval"] = tm.eval_step(data[0])
    return out


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["mlm", "padded_causal", "mlm_empty"])
def test_every_split_trains_like_one_process(dist2, kind):
    """`mlm_empty`: a slice or micro-batch with no supervised token adds nothing (HF's own
    mean over it is NaN; the step must not turn that into NaN gradients)."""
    res = dist2.run(job_splits, kind, timeout=300)
    assert res[0] == res[1]


def test_a_user_loss_fn_keeps_the_mean_over_slices():
    """A user's loss is a black box: slices are weighted equally, as the docs say."""
    def loss_fn(out, batch):
        return out.loss

    model = _model("mlm")
    ref = copy.deepcopy(model)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, grad_accum=2, loss_fn=loss_fn)
    data = batches("mlm")
    got = tm.train_step(data[0])
    halves = [{k: v[i * 4:(i + 1) * 4] for k, v in data[0].items()} for i in range(2)]
    want = sum(ref(**h).loss.item() for h in halves) / 2
    assert got == pytest.approx(want, rel=1e-6)
    token_mean_loss = ref(**data[0]).loss.item()
    assert abs(got - token_mean_loss) > 1e-4  # the two means differ on these labels


def test_label_shift_and_counts():
    import models

    assert label_shift(models.gpt2()) == 1
    assert label_shift(models.llama()) == 1
    assert label_shift(models.bert_mlm()) == 0
    assert label_shift(models.t5()) == 0
    assert label_shift(models.bert()) is None  # BertModel: no loss of its own
    assert label_shift(torch.nn.Linear(2, 2)) is None
    labels = torch.tensor([[1, 2, -100, 4], [-100, -100, 5, 6]])
    assert supervised_tokens({"labels": labels}, 0).item() == 5
    assert supervised_tokens({"labels": labels}, 1).item() == 4  # the first label is never a target
    assert supervised_tokens({"input_ids": labels}, 0) is None
    from slapo.runtime.mesh import MeshInfo

    info = MeshInfo.of(None)
    assert token_mean(None, [{"labels": labels}], info) is None
    assert token_mean(0, [{"labels": torch.full((2, 3), -100)}], info) is None
    assert token_mean(0, [{"input_ids": labels}], info) is None
    tm = token_mean(0, [{"labels": labels[:1]}, {"labels": labels[1:]}], info)
    assert tm.total.item() == 5
    assert tm.weight({"labels": labels[:1]}).item() == pytest.approx(3 / 5)


FAMILY_KINDS = {"bert_mlm": "mlm", "roberta": "mlm", "albert": "mlm", "gpt2": "causal",
                "gpt_neo": "causal", "opt": "causal", "llama": "causal", "qwen2": "causal",
                "qwen3": "causal", "mistral": "causal", "t5": "seq2seq", "t5_gated": "seq2seq",
                "mt5": "seq2seq"}


def family_batches(family: str) -> list[dict]:
    """Labels with a different number of supervised tokens per row: masked positions (MLM),
    right padding (causal LM, and T5's decoder labels)."""
    import models

    out = []
    for s in range(STEPS):
        b = models.batch_for(family, batch=8, seed=30 + s)
        labels = b["labels"].clone()
        if FAMILY_KINDS[family] == "mlm":
            labels = _masked(b["input_ids"], s, keep=0.3)
        else:
            for row, length in enumerate((16, 3, 9, 16, 5, 12, 2, 16)):
                labels[row, length:] = -100
        out.append({**b, "labels": labels})
    return out


@pytest.mark.parametrize("family", sorted(FAMILY_KINDS))
def test_every_family_accumulates_to_the_token_mean(family):
    """Four accumulation slices of every family's batch train like the whole batch on the
    model's own loss: the step knows each family's label shift (causal LMs 1, masked LMs and
    T5 0), so its slices are weighted by their supervised tokens, not equally."""
    import models

    model = getattr(models, family)(seed=0)
    ref = copy.deepcopy(model)
    tm, _ = slapo.build(slapo.create_schedule(model), optimizer=torch.optim.AdamW,
                        optimizer_kwargs={"lr": LR}, grad_accum=4)
    data = family_batches(family)
    losses = [tm.train_step(b) for b in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(one_process(ref, data)),
                               rtol=1e-5, atol=0)
    # a key projection's bias adds one constant to a query's every logit, which softmax cancels:
    # its true gradient is 0, what it gets is roundoff, and AdamW turns that into steps
    _params_equal({n: p for n, p in tm.named_parameters() if not n.endswith("k_proj.bias")},
                  ref)
    quarters = [{k: v[i * 2:(i + 1) * 2] for k, v in data[0].items()} for i in range(4)]
    equal_weights = sum(ref(**q).loss.item() for q in quarters) / 4
    assert abs(equal_weights - ref(**data[0]).loss.item()) > 1e-4  # the weighting matters
