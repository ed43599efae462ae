"""`slapo train --sft pack` with `--pp-stages 2` and with `--cp 2` trains what one process
trains.

A packed row holds several documents, its `position_ids` restarting at each one and no
attention mask: HF's forward builds a block-diagonal causal mask from the positions, so packed
documents do not see each other.
- Pipeline stages take the batch's `position_ids` (`HFDecoderStage.position_inputs`, handed
  to every stage by the runner: `pipeline_inputs.stage_position_inputs`), so each stage's
  embeddings, rotary embeddings and masks are the model's.
- Context parallelism splits the positions with the tokens and gives every rank's tokens
  their document (`runtime.context_parallel.documents`, `KEY_DOC`): the cp attention (all-gather,
  ring, Ulysses) masks keys of other documents.
Compared in float64 through `slapo train`'s own entry point
(`test_sft_pad_parallel.run_float64`): every loss, the val loss and every parameter after the
steps, LLaMA (RoPE) and GPT-2 (learned positions; its tied embedding and head on two ranks
under pp), pp with and without `--grad-accum 2`, and cp=2 x pp=2 on 4 ranks (FSDP2 over each stage's cp ranks; the
stages take the cp batch's documents too). The mutations (stages given no positions;
cp ranks given one document per row) must fail.
"""

from __future__ import annotations

import pytest
import torch
from test_sft_pad_parallel import TRAIN, _compare, run_float64
from test_train_sft import write_rows

# 96 tokens: every row holds response tokens of a second or later document (the ones a
# missing block-diagonal mask would change; at the pad test's 50 a row's later documents are
# cut-off prompts, labelled -100, and nothing could tell the masks apart)
PACK = {**TRAIN, "sft": "pack", "seq_len": 96}
RUNS = [{"model": "llama", "pp_stages": 2}, {"model": "llama", "pp_stages": 2, "grad_accum": 2},
        {"model": "gpt2", "pp_stages": 2}, {"model": "llama", "cp": 2},
        {"model": "llama", "cp": 2, "cp_attention": "ring"},
        {"model": "llama", "cp": 2, "cp_attention": "ulysses"}, {"model": "gpt2", "cp": 2}]


def job_sft_pack(runs: list[dict], data: str, mutate: bool = False) -> list[dict]:
    """The runs; `mutate`: pipeline stages get no positions, cp ranks one document per row."""
    import slapo.runtime.context_parallel as cpr
    import slapo.runtime.pipeline_runner as pr

    torch.set_num_threads(1)
    saved = pr.stage_position_inputs, cpr.documents
    if mutate:
        pr.stage_position_inputs = lambda stage, batch: {}
        cpr.documents = lambda pos: torch.zeros_like(pos)
    try:
        return [run_float64({**PACK, **opts, "data": data}) for opts in runs]
    finally:
        pr.stage_position_inputs, cpr.documents = saved


def test_the_packed_rows_hold_several_documents(tmp_path):
    """What the comparison needs: every row holds response tokens (labels != -100) of a
    document after its first, whose loss the block-diagonal mask changes."""
    from slapo.data import load_tokenizer
    from slapo.data.sft_loader import make_sft_data

    data = make_sft_data(write_rows(tmp_path / "rows.jsonl"), "pack", PACK["seq_len"],
                         load_tokenizer(None), 0, PACK["val_fraction"])
    batch = data.train.next_batch(PACK["batch_size"])
    later = (batch["position_ids"] == 0).cumsum(dim=1) > 1
    labelled = ((batch["labels"] != -100) & later).sum(dim=1)
    assert batch.get("attention_mask") is None
    assert bool((labelled > 0).all()), labelled


@pytest.mark.dist
def test_sft_pack_under_pp2_and_cp2_trains_like_one_process(dist2, tmp_path, one_thread):
    data = write_rows(tmp_path / "rows.jsonl")
    ranks = dist2.run(job_sft_pack, RUNS, data, timeout=400)
    one = {m: run_float64({**PACK, "model": m, "data": data}) for m in ("llama", "gpt2")}
    for i, run in enumerate(RUNS):
        _compare([r[i] for r in ranks], one[run["model"]], run)


@pytest.mark.dist
def test_stages_without_positions_or_cp_without_documents_fail(dist2, tmp_path, one_thread):
    data = write_rows(tmp_path / "rows.jsonl")
    runs = [{"model": "llama", "pp_stages": 2}, {"model": "llama", "cp": 2}]
    ranks = dist2.run(job_sft_pack, runs, data, True, timeout=400)
    one = run_float64({**PACK, "model": "llama", "data": data})
    for i, run in enumerate(runs):
        with pytest.raises(AssertionError):
            _compare([r[i] for r in ranks], one, run)


@pytest.mark.dist
@pytest.mark.slow
def test_sft_pack_under_cp2_x_pp2_trains_like_one_process(dist4, tmp_path, one_thread):
    data = write_rows(tmp_path / "rows.jsonl")
    run = {"model": "llama", "cp": 2, "pp_stages": 2, "dp_shard": True}
    ranks = dist4.run(job_sft_pack, [run], data, timeout=600)
    one = run_float64({**PACK, "model": "llama", "data": data})
    assert all("cp=2" in r[0]["schedule"] for r in ranks)
    # `_compare`'s cp rule (each rank holds every parameter) is not a pipeline's: left out
    _compare([r[0] for r in ranks], one, {k: v for k, v in run.items() if k != "cp"})
