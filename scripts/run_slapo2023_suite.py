#!/usr/bin/env python
"""Run the original Slapo project's own test suite (awslabs/slapo, `tests/` at its last release
tag) against today's slapo, or against the original code itself, on CPU.

The setting (issue 32, "Done when"): 2 gloo ranks launched by torchrun, as 2023's CI ran the
suite (`torchrun --nproc_per_node 2 -m pytest tests`, ci/task_unit_test.sh), CUDA calls mapped
to CPU, no network. Nothing from the original project is copied into this repository: the tests
are exported from a local git mirror into a scratch directory and run there.

    python scripts/run_slapo2023_suite.py                      # today's slapo
    python scripts/run_slapo2023_suite.py --against original   # the 2023 package itself
    python scripts/run_slapo2023_suite.py --files test_shard.py --json out.json

The mirror: `--repo` (a git directory, e.g. the one the `fetch` tool of this project's sessions
writes to /work/.mirror/awslabs+slapo/repo) or $SLAPO2023_REPO. Each test file runs under its own
torchrun (a hang or crash in one file costs only that file). Every rank records each test's
outcome; a test passes when it passes on both ranks. Per-file counts are printed and written as
JSON (`--json`, default <scratch>/results-<against>.json).

The CPU mapping is this file used as a pytest plugin (`-p run_slapo2023_suite`), loaded before
2023's conftest and tests: `torch.cuda.is_available()` is False; `Tensor.cuda` / `Module.cuda`
return the CPU object; the `torch.cuda` device, stream and memory calls are no-ops; its RNG calls
(`manual_seed`, `get_rng_state`, `set_rng_state`, `initial_seed`) are the CPU generator's;
`device="cuda"` in torch's factory functions and `.to()` becomes "cpu"; the NCCL backend is gloo
(with a 120 s timeout, so a rank waiting on a failed peer errors instead of hanging). The `mock`
package (a backport 2023's tests import) is `unittest.mock`. Tests that download from a model
hub or need a GPU-only kernel package are excluded (`EXCLUDED`, with the reason), as is
`tests/end2end.py` (benchmark runs on downloaded data; 2023's CI ran it separately).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

DEFAULT_REPO = "/work/.mirror/awslabs+slapo/repo"
DEFAULT_REF = "v0.0.3"  # the last release tag of awslabs/slapo
PG_TIMEOUT_S = 120

# (file, test function name) -> why it is not run here (parametrised cases share the name).
EXCLUDED: dict[tuple[str, str], str] = {
    **{("test_op.py", t): "downloads the gpt2-medium config from the HF hub "
                          "(AutoConfig.from_pretrained); no network"
       for t in ("test_attention", "test_fused_mlp")},
    **{("test_trace.py", t): "downloads a model config from the HF hub "
                             "(AutoConfig.from_pretrained); no network"
       for t in ("test_hf_bert", "test_hf_gpt_neo", "test_flattened_hf_bert",
                 "test_two_level_flattened_hf_bert")},
    ("test_trace.py", "test_torchvision_wideresnet"): "needs torchvision",
    # tests added after the release (run with --ref HEAD)
    **{(f, t): "downloads a model config from the HF hub; no network"
       for f, t in (("test_pipeline_partition.py", "test_gpt_neo_two_stages"),
                    ("test_pipeline_partition.py", "test_gpt_neo_four_stages"),
                    ("test_trace.py", "test_hf_tracer_gpt_attn"), ("test_trace.py", "test_dynamo"),
                    ("test_replace.py", "test_qkv"), ("test_replace.py", "test_efficient_attn"),
                    ("test_verify.py", "test_bert"))},
}


# ------------------------------------------------------------------------------------------------
# The pytest plugin (runs inside each rank's pytest)
# ------------------------------------------------------------------------------------------------
def _device_mapped_to(original):
    """A `Tensor.to` / `Module.to` whose device (first positional or `device=`) is mapped."""
    @functools.wraps(original)
    def to(self, *args, **kwargs):
        args = tuple(_map_device(a) if i == 0 else a for i, a in enumerate(args))
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        return original(self, *args, **kwargs)
    return to


def _map_device(dev):
    import torch

    if isinstance(dev, str) and dev.split(":")[0] == "cuda":
        return "cpu"
    if isinstance(dev, torch.device) and dev.type == "cuda":
        return torch.device("cpu")
    if isinstance(dev, int) and not isinstance(dev, bool):
        return "cpu"  # 2023's `.to(local_rank)` / `device=rank`
    return dev


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        return fn(*args, **kwargs)
    return wrapper


def install_cpu_mapping() -> None:
    """Map 2023's CUDA calls to CPU (module docstring). Idempotent."""
    import torch
    import torch.distributed as dist

    if getattr(torch, "_slapo2023_cpu", False):
        return
    torch._slapo2023_cpu = True
    cuda = torch.cuda
    cuda.is_available = lambda: False
    for name in ("set_device", "synchronize", "empty_cache", "reset_peak_memory_stats",
                 "reset_max_memory_allocated"):
        setattr(cuda, name, lambda *a, **k: None)
    cuda.current_device = lambda: 0
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                 "max_memory_reserved"):
        setattr(cuda, name, lambda *a, **k: 0)
    # torch.manual_seed calls cuda.manual_seed_all: seed the CPU generator directly.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.initial_seed = torch.initial_seed
    cuda.seed = lambda: torch.default_generator.seed()
    cuda.seed_all = lambda: None

    def tensor_cuda(self, device=None, non_blocking=False, memory_format=None):
        return self

    def module_cuda(self, device=None):
        return self

    torch.Tensor.cuda = tensor_cuda
    torch.nn.Module.cuda = module_cuda
    # `with torch.device(...)` (meta init) recognises torch's own factory functions by identity
    # in a cached set: build that set before the names below are wrapped.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("randn", "rand", "randint", "zeros", "ones", "empty", "full", "tensor",
                 "arange", "as_tensor", "eye", "randperm", "linspace", "zeros_like",
                 "ones_like", "empty_like", "randn_like", "rand_like", "full_like"):
        setattr(torch, name, _cpu_factory(getattr(torch, name)))

    torch.Tensor.to = _device_mapped_to(torch.Tensor.to)
    torch.nn.Module.to = _device_mapped_to(torch.nn.Module.to)

    init_pg = dist.init_process_group

    @functools.wraps(init_pg)
    def init_process_group(backend=None, *args, **kwargs):
        if backend is None or "nccl" in str(backend):
            backend = "gloo"
        kwargs.setdefault("timeout", datetime.timedelta(seconds=PG_TIMEOUT_S))
        return init_pg(backend, *args, **kwargs)

    dist.init_process_group = init_process_group
    if "mock" not in sys.modules:
        import unittest.mock

        sys.modules["mock"] = unittest.mock


_OUTCOMES: dict[str, dict] = {}
_RANK_ORDER = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def pytest_configure(config):
    install_cpu_mapping()


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        fname = Path(str(item.fspath)).name
        reason = EXCLUDED.get((fname, item.originalname or item.name))
        if reason:
            item.add_marker(pytest.mark.skip(reason=f"excluded: {reason}"))


def pytest_runtest_logreport(report):
    rec = _OUTCOMES.setdefault(report.nodeid, {"outcome": "passed", "reason": ""})
    if report.skipped:
        outcome = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        reason = _short_reason(report)
    else:
        return
    if _RANK_ORDER[outcome] > _RANK_ORDER[rec["outcome"]]:
        rec["outcome"], rec["reason"] = outcome, str(reason)


def _short_reason(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return crash.message.splitlines()[0][:300] if crash.message else ""
    return str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("SLAPO2023_RESULTS")
    if out:
        rank = os.environ.get("RANK", "0")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"rank{rank}.json").write_text(json.dumps(_OUTCOMES, indent=1))


# ------------------------------------------------------------------------------------------------
# The harness
# ------------------------------------------------------------------------------------------------
def export(repo: Path, ref: str, paths: list[str], dest: Path) -> None:
    """`git archive <ref> <paths>` of the mirror, unpacked under `dest` (read-only on the
    mirror: archive does not change the repository)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile() as tar:
        subprocess.run(["git", "--git-dir", str(repo), "archive", ref, *paths], stdout=tar,
                       check=True)
        tar.seek(0)
        with tarfile.open(fileobj=tar) as tf:
            tf.extractall(dest, filter="data")


def merge(ranks: list[dict], nproc: int) -> dict[str, dict]:
    """One outcome per test over all ranks: passed only when every rank passed; a rank with no
    record of a test another rank ran crashed or timed out on it."""
    names = sorted({n for r in ranks for n in r})
    merged = {}
    for n in names:
        recs = [r.get(n) for r in ranks]
        if len(ranks) < nproc or any(rec is None for rec in recs):
            have = [rec for rec in recs if rec is not None]
            if have and all(rec["outcome"] == "skipped" for rec in have):
                merged[n] = have[0]
                continue
            merged[n] = {"outcome": "failed", "reason": "no result from every rank (a rank "
                         "crashed or timed out)"}
            continue
        worst = max(recs, key=lambda rec: _RANK_ORDER[rec["outcome"]])
        merged[n] = dict(worst)
    return merged


def run_file(suite: Path, fname: str, nproc: int, env: dict, timeout: int, logs: Path):
    res = logs / fname.replace(".py", "")
    shutil.rmtree(res, ignore_errors=True)
    env = dict(env, SLAPO2023_RESULTS=str(res))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "-m", "pytest", "-q", "-p", "run_slapo2023_suite",
           "-p", "no:cacheprovider", "-p", "no:randomly", "-rfEs", f"tests/{fname}"]
    log = logs / f"{fname}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=suite, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    ranks = [json.loads(p.read_text()) for p in sorted(res.glob("rank*.json"))]
    merged = merge(ranks, nproc)
    if not merged:
        merged = {f"tests/{fname}": {"outcome": "error", "reason": f"no test ran (rc={rc}); "
                                     f"see {log}"}}
    return rc, merged


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=os.environ.get("SLAPO2023_REPO", DEFAULT_REPO),
                    help="git directory of an awslabs/slapo mirror")
    ap.add_argument("--ref", default=DEFAULT_REF, help="the tag or commit whose tests/ run")
    ap.add_argument("--against", choices=("today", "original"), default="today",
                    help="today's slapo (this checkout) or the original package at --ref")
    ap.add_argument("--scratch", default=None, help="scratch directory (default: a new temp "
                    "directory); never inside this repository")
    ap.add_argument("--files", nargs="*", default=None, help="test files (default: all)")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per test file")
    ap.add_argument("--json", default=None, help="where to write the results")
    args = ap.parse_args(argv)

    repo = Path(args.repo)
    if not (repo / "HEAD").exists() and not (repo / ".git").exists():
        print(f"error: no git mirror of awslabs/slapo at {repo}; fetch it (e.g. git clone "
              "--mirror https://github.com/awslabs/slapo) and pass --repo.", file=sys.stderr)
        return 2
    here = Path(__file__).resolve().parent
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="slapo2023-"))
    if here.parent in [scratch.resolve(), *scratch.resolve().parents]:
        print("error: the scratch directory must be outside this repository.", file=sys.stderr)
        return 2
    suite = scratch / f"suite-{args.against}"
    shutil.rmtree(suite, ignore_errors=True)
    export(repo, args.ref, ["tests", "conftest.py"], suite)
    pythonpath = [str(here)]
    if args.against == "original":
        src = scratch / "original-src"
        shutil.rmtree(src, ignore_errors=True)
        export(repo, args.ref, ["slapo"], src)
        pythonpath.insert(0, str(src))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(pythonpath), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONDONTWRITEBYTECODE="1")
    files = args.files or sorted(p.name for p in (suite / "tests").glob("test_*.py"))
    logs = scratch / f"logs-{args.against}"
    logs.mkdir(parents=True, exist_ok=True)

    report = {"ref": args.ref, "against": args.against, "nproc": args.nproc, "files": {}}
    total = dict.fromkeys(("passed", "failed", "error", "skipped", "excluded"), 0)
    for fname in files:
        rc, merged = run_file(suite, fname, args.nproc, env, args.timeout, logs)
        counts = dict.fromkeys(total, 0)
        for rec in merged.values():
            key = rec["outcome"]
            if key == "skipped" and "excluded: " in rec["reason"]:
                key = "excluded"
            counts[key] += 1
        for k in total:
            total[k] += counts[k]
        report["files"][fname] = {"rc": rc, "counts": counts, "tests": merged}
        print(f"{fname:28s} " + " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    report["total"] = total
    print("TOTAL" + " " * 24 + " ".join(f"{k}={v}" for k, v in total.items()))
    out = Path(args.json or scratch / f"results-{args.against}.json")
    out.write_text(json.dumps(report, indent=1))
    print(f"results: {out}\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
