"""`slapo train --sft pad` (one right-padded document per row, an attention mask, labels -100
on the prompt and the padding) under `--cp 2` and under `--pp-stages 2` trains what one process
trains: the same loss at every step, the same val loss, and the same parameters after the
optimizer steps, in float64, to rel 1e-5 (measured: losses to 4e-16, parameters to
6e-13 of their tensor's largest entry).

The runs are `slapo train`'s own entry point (`train(TrainConfig)`: loader, schedule,
`build_trainer`, step, evaluation) with one change: the model, and its loss, in float64 right
after it is built (`in_float64`), before anything schedules it. The CLI has no float64, and in
float32 AdamW's first steps turn summation-order noise on tiny gradients into parameter
differences of ~1e-4 of the learning rate, which would hide the comparison.

What is under test, on the rows of `write_rows` at `--seq-len 50` (not a multiple of
2 x cp = 4: cp pads every row by 2 more; the longest rows truncated):

- cp splits each row zig-zag (rank 0: its start and its padded end, rank 1: its middle), so
  the two cp ranks hold different numbers of response tokens (checked on the first batch): a
  loss that averaged each rank's own mean would not be one process's token mean (the
  mutation `mean_of_cp_rank_means` fails this test);
- pp cuts each batch into 2 micro-batches (x 2 accumulation slices with `--grad-accum 2`),
  again with different counts, each weighted by its share of the global count
  (`runtime/token_mean.py`; the mutation `mean_of_microbatch_means` fails it);
- GPT-2 too: learned absolute positions (cp passes each token's index in the whole row) and
  its tied embedding and head, on the two pp ranks' two stages (`runtime/pipeline_tied.py`).

The padding mask itself cannot change a right-padded causal row: padding sits after every
real token, so no real query sees it, and its labels are -100. Left padding under cp (where
the key flags matter) is tests/test_context_parallel.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from test_train_sft import write_rows

REL = 1e-5
ATOL = 1e-12  # entries that one process leaves at ~1e-16 (a bias whose gradient sums to ~0)
STEPS = 2
TRAIN = dict(hidden_size=32, num_layers=2, num_heads=4, seq_len=50, batch_size=4,
             steps=STEPS, progress=False, plot=False, dropout=0.0, lr=1e-2, sft="pad",
             val_fraction=0.25, eval_batches=1)
RUNS = [{"model": "llama", "cp": 2}, {"model": "llama", "cp": 2, "cp_attention": "ring"},
        {"model": "llama", "pp_stages": 2}, {"model": "llama", "pp_stages": 2, "grad_accum": 2},
        {"model": "gpt2", "cp": 2}, {"model": "gpt2", "pp_stages": 2}]


def in_float64(model: torch.nn.Module) -> torch.nn.Module:
    """The model in float64, its loss too (HF's causal loss upcasts the logits to float32,
    which would leave float32 rounding in every loss and gradient: `models.causal_loss_as_is`
    is the same loss in the model's dtype)."""
    import models

    model = model.to(torch.float64)
    model.loss_function = models.causal_loss_as_is
    return model


def run_float64(opts: dict) -> dict:
    """`slapo train`'s entry point with the model built in float64: its losses, val loss and
    this rank's parameters after the run (a pipeline rank: its own stages', the trainer's
    parts; the rest of its copy of the model is never trained). Tied weights under each of
    their names (GPT-2's last stage holds the embedding as `lm_head.weight`)."""
    import slapo.train.assemble as assemble
    import slapo.train.loop as loop
    from slapo.train import TrainConfig, train

    runs, new_model, build = [], assemble._new_model, loop.build

    def kept(*args, **kwargs):
        run = build(*args, **kwargs)
        runs.append(run)
        return run

    assemble._new_model = lambda *a, **k: in_float64(new_model(*a, **k))
    loop.build = kept
    try:
        metrics = train(TrainConfig(**opts))
    finally:
        assemble._new_model, loop.build = new_model, build
    params = {n: _whole(p.detach()).cpu().clone() for part in runs[0].trainer.parts
              for n, p in part.named_parameters(remove_duplicate=False)}
    assert params and all(p.dtype == torch.float64 for p in params.values())
    return {"losses": metrics["losses"], "val_loss": metrics["val_loss"], "params": params,
            "schedule": metrics["schedule"]}


def _whole(t: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard's whole tensor (a collective over its mesh: every rank of a stage asks
    for the same names in the same order)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def job_sft_pad(runs: list[dict], data: str) -> list[dict]:
    torch.set_num_threads(1)
    return [run_float64({**TRAIN, **opts, "data": data}) for opts in runs]


def _compare(got: list[dict], want: dict, run: dict) -> None:
    """Every rank logs one process's losses and val loss; the parameters each rank holds (all
    of them under cp, its stages' under pp, together all of them) are one process's."""
    assert len(want["losses"]) == STEPS
    seen: set[str] = set()
    for rank in got:
        assert rank["losses"] == pytest.approx(want["losses"], rel=REL), (run, rank, want)
        assert rank["val_loss"] == pytest.approx(want["val_loss"], rel=REL), (run, rank, want)
        for name, p in rank["params"].items():
            torch.testing.assert_close(p, want["params"][name], rtol=REL, atol=ATOL,
                                       msg=lambda m, name=name: f"{run} {name}: {m}")
        seen |= set(rank["params"])
        if run.get("cp"):
            assert set(rank["params"]) == set(want["params"]), run
            assert f"cp={run['cp']}" in rank["schedule"], rank["schedule"]
    assert seen == set(want["params"]), (run, sorted(set(want["params"]) ^ seen))


def test_the_rows_split_unevenly_over_cp_ranks_and_microbatches(tmp_path):
    """The property the parallel test's mutations need: the first batch's response tokens
    are not split evenly over the cp ranks, nor over the pipeline's micro-batches (a mean of
    per-rank or per-micro-batch means would then differ from the token mean)."""
    from slapo.data import load_tokenizer
    from slapo.data.sft_loader import make_sft_data
    from slapo.runtime.context_parallel import cp_batch

    data = make_sft_data(write_rows(tmp_path / "rows.jsonl"), "pad", TRAIN["seq_len"],
                         load_tokenizer(None), 0, TRAIN["val_fraction"])
    batch = data.train.next_batch(TRAIN["batch_size"])
    assert (batch["attention_mask"] == 0).any() and batch["input_ids"].shape[1] % 4 == 2
    per_cp = [int((cp_batch(batch, 2, r)["labels"] != -100).sum()) for r in range(2)]
    shifted = batch["labels"][:, 1:] != -100
    per_mb = [int(shifted[:2].sum()), int(shifted[2:].sum())]
    assert sum(per_cp) == sum(per_mb) and per_cp[0] != per_cp[1] and per_mb[0] != per_mb[1], \
        (per_cp, per_mb)


@pytest.mark.dist
def test_sft_pad_under_cp2_and_pp2_trains_like_one_process(dist2, tmp_path, one_thread):
    """One process vs `--cp 2` (all-gather and ring attention) and vs `--pp-stages 2` (with
    and without `--grad-accum 2`), LLaMA and GPT-2, 2 gloo ranks: module docstring."""
    data = write_rows(tmp_path / "rows.jsonl")
    ranks = dist2.run(job_sft_pad, RUNS, data, timeout=400)
    one = {m: run_float64({**TRAIN, "model": m, "data": data}) for m in ("llama", "gpt2")}
    for i, run in enumerate(RUNS):
        _compare([r[i] for r in ranks], one[run["model"]], run)


@contextmanager
def mutated(name: str) -> Iterator[None]:
    """The two ways to get the token mean wrong, patched into this process and undone after:
    each cp rank's loss its own tokens' mean (`GlobalSum.guard` handing the model the rank's
    count instead of the global one), or each micro-batch's mean weighted equally (the
    pipeline runner given no token weights)."""
    import slapo.runtime.pipeline_runner as pr
    import slapo.runtime.token_mean as tm

    if name == "mean_of_cp_rank_means":
        owner, attr = tm.GlobalSum, "guard"

        def bad(self, unit):
            own = tm.supervised_tokens(unit, 0).clamp(min=1)
            return {**tm._without_num_items(unit), tm.NUM_ITEMS: own}
    else:
        owner, attr, good = pr.PipelineRunner, "_run", pr.PipelineRunner._run

        def bad(self, batch, scale, tokens, *args, **kwargs):
            return good(self, batch, scale, None, *args, **kwargs)
    saved = owner.__dict__[attr]
    setattr(owner, attr, bad)
    try:
        yield
    finally:
        setattr(owner, attr, saved)


def job_mutated(name: str, opts: dict, data: str) -> list[dict]:
    with mutated(name):
        return job_sft_pad([opts], data)


@pytest.mark.dist
def test_a_mean_of_rank_or_microbatch_means_fails_the_comparison(dist2, tmp_path, one_thread):
    """The comparison above catches the bugs it is for: with either mutation (`mutated`) the
    cp or pp run no longer trains like one process (measured: the first loss 11.18 for one
    process's 5.60 under cp, off by 6.8e-3 relative under pp; parameters off by up to 0.45
    of their tensor's largest entry under both)."""
    data = write_rows(tmp_path / "rows.jsonl")
    one = run_float64({**TRAIN, "model": "llama", "data": data})
    for name, run in [("mean_of_cp_rank_means", {"model": "llama", "cp": 2}),
                      ("mean_of_microbatch_means", {"model": "llama", "pp_stages": 2})]:
        ranks = dist2.run(job_mutated, name, run, data, timeout=300)
        with pytest.raises(AssertionError):
            _compare([r[0] for r in ranks], one, run)
