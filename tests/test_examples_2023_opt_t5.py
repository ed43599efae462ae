"""The 2023-style example programs `examples/slapo2023/opt_train.py` (DeepSpeed ZeRO-3 target,
`config=` dict) and `t5_train.py` (native target, TP over the world), each launched as a user
would: `python -m torch.distributed.run --nproc-per-node 2 <script>` on gloo.

Each must exit 0, pass its own `slapo.Verify` of the schedule against the unscheduled model
(outputs and gradients), and log losses equal to a one-process plain-PyTorch AdamW run of the
unscheduled model built by the script's own `get_model` (so the numbers, not only "finite and
falling", are checked): for OPT, rank 0's loss on its half of the global batch, with gradients
averaged over both halves (DeepSpeed's data parallelism); for T5, the full loss (TP keeps it).
The two launches run concurrently to keep the wall time down.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist
ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
HAS_DS = importlib.util.find_spec("deepspeed") is not None
LOSS = re.compile(r"step (\d+) loss ([0-9.]+)")


def _script(name: str):
    """The example module itself (its get_model/get_batch build the reference)."""
    spec = importlib.util.spec_from_file_location(f"slapo2023_{name}", ROOT / "examples" /
                                                  "slapo2023" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(name: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_port()),
           str(ROOT / "examples" / "slapo2023" / f"{name}.py"), "--steps", str(STEPS), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"timed out:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _losses(out: str) -> list[float]:
    """Rank 0's logged losses, in step order (each logged once: `ranks=0`)."""
    found = [(int(s), float(v)) for s, v in LOSS.findall(out)]
    assert [s for s, _ in found] == list(range(STEPS)), out[-4000:]
    return [v for _, v in found]


def _adamw_losses(model, batches: list[dict], lr: float, clip: float = 0.0) -> list[float]:
    """Plain PyTorch: per step, the mean of the per-batch losses' gradients (data parallel),
    clipped to global 2-norm `clip` (0: not), returning the first batch's loss (rank 0's)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    first = []
    for _ in range(STEPS):
        losses = [model(**b).loss for b in batches]
        (sum(losses) / len(losses)).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        first.append(losses[0].item())
    return first


def _opt_reference() -> list[float]:
    mod = _script("opt_train")
    args = mod.parse_args(["--steps", str(STEPS)])
    _, model = mod.get_model(args)
    halves = [mod.get_batch(args, 2, r) for r in range(2)]
    return _adamw_losses(model, [{"input_ids": ids, "labels": ids} for ids in halves], args.lr,
                         clip=args.grad_clip)


def _t5_reference() -> list[float]:
    mod = _script("t5_train")
    args = mod.parse_args(["--steps", str(STEPS)])
    _, model = mod.get_model(args)
    return _adamw_losses(model, [mod.get_batch(args)], args.lr)


def _check(out: str, want: list[float], what: str) -> None:
    got = _losses(out)
    assert all(math.isfinite(v) for v in got) and got[-1] < got[0], got
    assert f"Verify: the scheduled {what} matches the unscheduled one" in out, out[-4000:]
    # logged with 4 decimals: half a unit of the last digit, plus float noise
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1.5e-4)


@pytest.mark.torchrun
@pytest.mark.skipif(not HAS_DS, reason="needs deepspeed (the 'deepspeed' extra)")
@pytest.mark.slow
def test_opt_zero3_and_t5_tp2_scripts_train_like_plain_pytorch(one_thread):
    procs = {"opt": _launch("opt_train", "--zero-stage", "3", "--grad-clip", "1.0"),
             "t5": _launch("t5_train")}
    want = {"opt": _opt_reference(), "t5": _t5_reference()}  # computed while the ranks run
    outs = {k: _finish(p) for k, p in procs.items()}
    _check(outs["opt"], want["opt"], "OPT")
    assert "ZeRO-3" in outs["opt"]
    _check(outs["t5"], want["t5"], "T5")
    holds = re.search(r"TP=(\d+): rank 0 holds (\d+) parameters", outs["t5"])
    assert holds and holds.group(1) == "2", outs["t5"][-4000:]
    _, full = _script("t5_train").get_model(_script("t5_train").parse_args([]))
    assert int(holds.group(2)) < sum(p.numel() for p in full.parameters())  # really sharded
