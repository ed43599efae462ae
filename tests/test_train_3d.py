"""`slapo train` with all three dimensions at once: `tp=2 x pp=2 x dp_shard` on 8 gloo ranks
(FSDP2 shards each TP shard of each pipeline stage). Its losses equal one process's for every
pipelinable family, and its checkpoint exports to the model one process trains.

One job on an 8-rank pool (8 ranks oversubscribe the 2-core CI machine); each pair of
dimensions, and resuming, is tested on 4 ranks in test_train_dist.py, and `slapo train` under
torchrun itself in test_faults.py, test_lifecycle.py and test_multinode.py (an 8-rank torchrun
launch here cost ~1-2 min of CI for nothing those do not check)."""

from __future__ import annotations

import pytest
import sweep
import torch
from safetensors.torch import load_file

from slapo.train import MODELS
from slapo.train.export import export_run

TINY = dict(hidden_size=32, num_layers=4, num_heads=4, seq_len=32, batch_size=8, steps=3,
            progress=False, plot=False, eval_batches=0, dropout=0.0, lr=1e-2)


def job_losses(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


# ALBERT's one shared layer cannot be cut; CI's default sample (tests/sweep.py): an encoder, two
# decoders (learned positions; RoPE with GQA) and T5, every family with SLAPO_SWEEP=all (every
# one trains tp x pp and tp x FSDP2 on 4 ranks in test_train_families)
PIPELINED = sweep.sample(sorted(set(MODELS) - {"albert"}), ["bert", "gpt2", "llama", "t5"])


def job_losses_per_model(options: dict, out: str) -> dict[str, list[float]]:
    """Every family on the 8 ranks; GPT-2's run saves its last step under `out` to export."""
    return {model: job_losses({**options, "model": model,
                               **({"out": out, "save_every": 3} if model == "gpt2" else {})})
            for model in PIPELINED}


@pytest.mark.dist
@pytest.mark.slow
def test_tp_pp_fsdp2_trains_and_exports_like_one_process_for_every_family(dist8, tmp_path,
                                                                          one_thread):
    """All three dimensions for every pipelinable family: BERT's and RoBERTa's last stage holds
    the MLM transform (the head a pipeline once dropped), T5's cut falls between encoder and
    decoder (the decoder stage takes the encoder's output as well), LLaMA shards grouped k/v,
    OPT's layers return views; on 8 ranks the losses are one process's (lr 1e-2, so a wrong
    gradient shows; a 1% lr change fails every family), and GPT-2's 3-D checkpoint exports to
    the weights one process trains. One job runs them all: the 8-rank pool starts once (~4 s),
    then each family takes ~1 s."""
    out_3d = tmp_path / "3d"
    ranks = dist8.run(job_losses_per_model, {**TINY, "tp": 2, "pp_stages": 2, "dp_shard": True},
                      str(out_3d), timeout=600)
    assert all(r == ranks[0] for r in ranks), ranks
    for model in PIPELINED:
        one = job_losses({**TINY, "model": model,
                          **({"out": str(tmp_path / "one"), "save_every": 3}
                             if model == "gpt2" else {})})
        assert ranks[0][model] == pytest.approx(one, rel=1e-5, abs=1e-6), (model, ranks[0], one)
    models = {}
    for k in ("3d", "one"):
        export_run(tmp_path / k, tmp_path / f"hf-{k}", log=lambda *a: None)
        models[k] = load_file(str(tmp_path / f"hf-{k}" / "model.safetensors"))
    assert models["3d"].keys() == models["one"].keys()
    for name, value in models["one"].items():  # 3 AdamW steps apart only by fp32 sum order
        assert (models["3d"][name] - value).abs().max() < 1e-4, name
