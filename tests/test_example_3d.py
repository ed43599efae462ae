"""`examples/train_3d.py --check` on 4 real gloo ranks (tp=2 x pp=2, checkpointing, 1F1B): its
losses must equal a one-process plain-PyTorch run of the same model and batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.torchrun
@pytest.mark.slow
def test_train_3d_matches_one_process_pytorch():
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           str(ROOT / "examples" / "train_3d.py"), "--check", "--steps", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "-> OK" in proc.stdout
