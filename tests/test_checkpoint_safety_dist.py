"""Crash-safe checkpoints on 2 gloo ranks: a damaged newest checkpoint (a flipped byte in the
shard that rank 1 hashes, a truncated rank-1 shard, a missing rank-1 RNG file) falls back to the
previous intact one on both ranks, with losses bit-identical to the uninterrupted run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from slapo.train import checkpoints
from slapo.train import run_state as ckpt

TINY = dict(hidden_size=64, num_layers=2, num_heads=4, seq_len=32, batch_size=8, steps=6,
            progress=False, plot=False, eval_batches=0, dropout=0.1)


def job_train(options: dict) -> dict:
    """Runs on every rank of the pool (process group already initialised)."""
    from slapo.train import TrainConfig, train

    torch.set_num_threads(1)
    m = train(TrainConfig(**options))
    return {"losses": m["losses"], "resumed_from": m["resumed_from"],
            "skipped": m["resume_skipped"]}


def _flip(ck: Path) -> str:
    # sorted files: .metadata __0_0.distcp __1_0.distcp rng_rank0.json ...: rank 1 hashes
    # __0_0.distcp, so only the gathered verdict of rank 1 can catch this
    shard = ck / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x80
    shard.write_bytes(bytes(data))
    return "__0_0.distcp does not match its sha256"


def _truncate(ck: Path) -> str:
    shard = ck / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    return "__1_0.distcp has 100 bytes"


def _missing(ck: Path) -> str:
    (ck / "rng_rank1.json").unlink()
    return "missing file rng_rank1.json"


@pytest.mark.dist
def test_two_ranks_fall_back_past_damaged_checkpoints(dist2, tmp_path):
    base = tmp_path / "base"
    straight = dist2.run(job_train, {**TINY, "out": str(base), "save_every": 3})
    assert straight[0]["losses"] == straight[1]["losses"]
    assert sorted(p.name for p in checkpoints.checkpoint_dir(base, 6).iterdir()) == [
        ".metadata", "COMPLETE.json", "__0_0.distcp", "__1_0.distcp", "rng_rank0.json",
        "rng_rank1.json", "trainer.json"]
    for damage in (_flip, _truncate, _missing):
        out = tmp_path / damage.__name__
        shutil.copytree(base, out)
        why = damage(checkpoints.checkpoint_dir(out, 6))
        resumed = dist2.run(job_train, {**TINY, "out": str(out), "resume": "latest"})
        for rank in (0, 1):
            assert resumed[rank]["resumed_from"] == 3, damage.__name__
            assert resumed[rank]["losses"] == straight[0]["losses"], damage.__name__
            [skipped] = resumed[rank]["skipped"]
            assert skipped["checkpoint"].endswith("step_000006") and why in skipped["reason"]
        assert ckpt.verify(checkpoints.checkpoint_dir(out, 6)) is None  # re-saved intact
