"""Multi-node launch of `slapo train` (docs/train.md), as far as one machine allows: two
torchrun agents ("nodes" of one rank each) meeting through the c10d rendezvous on localhost
train exactly what one agent with two local ranks trains. Both "nodes" get the same --out:
checkpoints are written by every rank into one directory, so on a real cluster --out must be on
a filesystem all nodes share (docs/train.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_pool import _free_port

ARGS = ["-m", "slapo.cli", "train", "--model", "gpt2", "--hidden-size", "32", "--num-layers",
        "2", "--num-heads", "2", "--seq-len", "32", "--batch-size", "4", "--steps", "3",
        "--tp", "2", "--no-progress", "--no-plot", "--eval-batches", "0"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def _torchrun(*launch: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch]


def _two_nodes(rdzv_id: str, *outs: Path) -> tuple[list[int], str]:
    """Two torchrun agents of one rank each meeting through the c10d rendezvous on localhost,
    node i writing to outs[i]; their exit codes and output."""
    port = _free_port()
    nodes = [subprocess.Popen(
        _torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                  *ARGS, "--out", str(out)),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for out in outs]
    try:
        logs = [n.communicate(timeout=300)[0] for n in nodes]
    finally:
        for n in nodes:
            n.kill()
    return [n.returncode for n in nodes], "\n".join(logs)


def _losses(out: Path) -> list[float]:
    return json.loads((out / "metrics.json").read_text())["losses"]


def job_train_losses(flags: list[str]) -> list[float]:
    import torch

    from slapo.cli import parse_train_args
    from slapo.train import train

    torch.set_num_threads(1)
    return train(parse_train_args(flags))["losses"]


@pytest.mark.torchrun
@pytest.mark.dist
def test_two_nodes_of_one_rank_train_like_one_node_of_two(dist2, tmp_path):
    codes, logs = _two_nodes("slapo-test", tmp_path / "multi", tmp_path / "multi")
    assert codes == [0, 0], logs[-3000:]
    # one node of two ranks: the same flags on the in-process 2-rank pool (the same code path
    # as torchrun's ranks, without a third launch)
    single = dist2.run(job_train_losses, [*ARGS[3:], "--out", str(tmp_path / "single")])
    assert _losses(tmp_path / "multi") == single[0]


def job_out_not_shared(base: str) -> str:
    """Each rank given its own --out, as two nodes without a shared filesystem would be."""
    import torch.distributed as dist

    try:
        job_train_losses([*ARGS[3:], "--out", f"{base}/node{dist.get_rank()}"])
    except ValueError as e:
        return str(e)
    return "trained"


@pytest.mark.dist
def test_out_not_shared_between_nodes_is_a_clear_error(dist2, tmp_path):
    """Each "node" given its own --out (as on nodes without a shared filesystem): the job stops
    at start-up on every rank, naming the ranks that cannot see rank 0's files, not inside a
    checkpoint save. On the pool's 2 ranks (the check is a collective over the job's ranks,
    whoever launched them; how `slapo train` reports a ValueError: test_cli.py)."""
    said = dist2.run(job_out_not_shared, str(tmp_path))
    assert all("is not shared: rank 1 on " in s for s in said), said
    assert "rank 0" not in said[0].split("is not shared: ")[1].split(" cannot")[0], said
    assert not (tmp_path / "node0" / "checkpoints").exists()
    assert not (tmp_path / "node1").exists() or not any((tmp_path / "node1").iterdir())
