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
from safetensors.torch import load_file

from slapo.cli import main
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
