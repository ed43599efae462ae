"""`slapo train` with all three dimensions at once: `--tp 2 --pp-stages 2 --dp-shard` on 8 gloo
ranks under torchrun (FSDP2 shards each TP shard of each pipeline stage). Its losses equal one
process's, and its checkpoint exports to the model one process trains.

One launch (8 ranks oversubscribe the 2-core CI machine: ~1 min); each pair of dimensions,
and resuming, is tested on 4 ranks in test_train_dist.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slapo.cli import main
from slapo.train import MODELS
from slapo.train.export import export_run

ROOT = Path(__file__).resolve().parents[1]
FLAGS = ["--hidden-size", "64", "--num-layers", "4", "--num-heads", "4", "--seq-len", "32",
         "--batch-size", "8", "--steps", "3", "--dropout", "0", "--no-progress", "--no-plot",
         "--eval-batches", "0", "--save-every", "3"]


@pytest.mark.dist
@pytest.mark.slow
def test_tp_pp_fsdp2_on_eight_ranks_trains_and_exports_like_one_process(tmp_path, one_thread):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "8", "-m", "slapo.cli", "train", *FLAGS,
                           "--tp", "2", "--pp-stages", "2", "--dp-shard", "--dist-timeout",
                           "300", "--out", str(tmp_path / "3d")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "8 process(es) (dp=2 x pp=2 x tp=2)" in proc.stdout, proc.stdout[-2000:]
    assert main(["train", *FLAGS, "--out", str(tmp_path / "one")]) == 0
    losses = {k: json.loads((tmp_path / k / "metrics.json").read_text())["losses"]
              for k in ("3d", "one")}
    assert losses["3d"] == pytest.approx(losses["one"], rel=1e-5)
    models = {}
    for k in ("3d", "one"):
        export_run(tmp_path / k, tmp_path / f"hf-{k}", log=lambda *a: None)
        models[k] = load_file(str(tmp_path / f"hf-{k}" / "model.safetensors"))
    assert models["3d"].keys() == models["one"].keys()
    for name, value in models["one"].items():  # 3 AdamW steps apart only by fp32 sum order
        assert (models["3d"][name] - value).abs().max() < 1e-4, name


TINY = dict(hidden_size=32, num_layers=4, num_heads=4, seq_len=32, batch_size=8, steps=3,
            progress=False, plot=False, eval_batches=0, dropout=0.0, lr=1e-2)


def job_losses(options: dict) -> list[float]:
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    return train(TrainConfig(**options))["losses"]


OTHERS = sorted(set(MODELS) - {"albert", "gpt2"})


def job_losses_per_model(options: dict) -> dict[str, list[float]]:
    return {model: job_losses({**options, "model": model}) for model in OTHERS}


@pytest.mark.dist
@pytest.mark.slow
def test_tp_pp_fsdp2_trains_like_one_process_for_every_other_family(dist8, one_thread):
    """All three dimensions for every pipelinable family but GPT-2 (the launch above): BERT's
    and RoBERTa's last stage holds the MLM transform (the head a pipeline once dropped), T5's
    cut falls between encoder and decoder (the decoder stage takes the encoder's output as
    well), LLaMA shards grouped k/v, OPT's layers return views; on 8 ranks the losses are one
    process's (lr 1e-2, so a wrong gradient shows; a 1% lr change fails every family). ALBERT's
    one shared layer cannot be cut (test_train_families). One job runs them all: the 8-rank
    pool starts once (~4 s), then each family takes ~1 s."""
    ranks = dist8.run(job_losses_per_model, {**TINY, "tp": 2, "pp_stages": 2, "dp_shard": True},
                      timeout=600)
    assert all(r == ranks[0] for r in ranks), ranks
    for model in OTHERS:
        one = job_losses({**TINY, "model": model})
        assert ranks[0][model] == pytest.approx(one, rel=1e-5, abs=1e-6), (model, ranks[0], one)
