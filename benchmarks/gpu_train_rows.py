"""The issue-36 rows of `benchmarks/gpu_train.py`: FP8 GEMMs and offloading (its helper module).

- slapo_fp8: the Slapo GPU schedule (`attention="sdpa", compile_blocks=True, fused_loss=True`;
  FP8 needs compiled blocks for speed: torchao's casts and scales fuse there) built with
  `precision="fp8"` and `Float8Config(min_dim=1024)` (docs/runtime.md: torchao's H100 tables
  show the gain from about 1024; `--fp8-min-dim` changes it, 64 under `--tiny`), tensorwise
  scaling, the LM head and small GEMMs in bf16. Needs torchao and, on CUDA, compute capability
  8.9+; without them the row is `skipped: ...` (no process). On CPU torchao's emulation.
- slapo_offload: the GPU schedule with selective checkpointing of the first half of the layers
  and the other half offloaded (`ckpt_ratio=0.5, ckpt_policy="selective", offload_ratio=0.5`:
  every layer recomputes its cheap ops or waits in pinned host memory, none keeps everything).
  On CPU there is no device memory to free, so the host-copy path is forced (every saved
  tensor copied out and back, as tests/test_offload.py does): the plumbing runs, nothing saved.
- slapo_optim_offload: the GPU schedule built with `optimizer_offload=True` (AdamW state and
  step on the host; `fused=True` there: torch's fused CPU AdamW).

Each row adds what it changed: `fp8_gemms` / `fp8_min_dim` / `fp8_emulated`,
`offloaded_layers` / `offload_tensors` / `offload_gib` (the last forward's copies; on CPU
forced), `optimizer_offload`. `--knob NAME=VALUE` replaces a knob of every Slapo row (e.g.
`offload_ratio=0.25`, or `compile_blocks=false` for an eager CPU check).
"""

from __future__ import annotations

import importlib.util
import subprocess

_GPU = dict(attention="sdpa", compile_blocks=True, fused_loss=True)
KNOBS = {
    "slapo_fp8": dict(_GPU),
    "slapo_offload": dict(_GPU, ckpt_ratio=0.5, ckpt_policy="selective", offload_ratio=0.5),
    "slapo_optim_offload": dict(_GPU),
}
FP8 = ("slapo_fp8",)
FP8_MIN_DIM = 1024  # a large model's (docs/runtime.md); --tiny: TINY_FP8_MIN_DIM
TINY_FP8_MIN_DIM = 64


def build_kwargs(variant: str, fp8_min_dim: int) -> dict:
    """The `slapo.build` arguments of a row beyond bf16 (empty for the other Slapo rows)."""
    if variant in FP8:
        from slapo.runtime.fp8 import Float8Config

        return dict(precision="fp8", fp8=Float8Config(min_dim=fp8_min_dim))
    if variant == "slapo_optim_offload":
        return dict(optimizer_offload=True)
    return {}


def gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability from nvidia-smi (no CUDA context in the parent:
    it would hold memory for the whole run); None without a GPU or an answer."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        major, minor = out.stdout.splitlines()[0].strip().split(".")
        return int(major), int(minor)
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


def problem(variant: str, capability=gpu_capability) -> str | None:
    """Why the row cannot run on this machine, or None: checked in the parent, so that a row
    that cannot run costs no process. (The child checks again: `slapo.build` refuses fp8
    where torchao does not import or the GPU has no FP8, and that refusal is a skipped row.)"""
    if variant not in FP8:
        return None
    if importlib.util.find_spec("torchao") is None:
        return "fp8 needs torchao, not installed (pip install slapo[fp8]; carry its wheel)"
    cap = capability()
    if cap is not None and cap < (8, 9):
        return (f"fp8 needs FP8 tensor cores (compute capability 8.9+); this GPU is "
                f"{cap[0]}.{cap[1]}")
    return None


def prepare(model, variant: str) -> None:
    """After the schedule: on a CPU model, force the offloaded layers' host-copy path (CUDA
    tensors only otherwise: on CPU nothing would move)."""
    from slapo.primitives.offload import offload_wrapper

    if next(model.parameters()).device.type != "cpu":
        return
    for m in model.modules():
        w = offload_wrapper(m)
        if w is not None:
            w.devices, w.min_bytes = ("cpu",), 0


def report(model, variant: str, fp8_min_dim: int) -> dict:
    """What the row changed, read from the built model after its steps."""
    from slapo.primitives.offload import offload_wrapper

    out = {}
    prec = getattr(model, "precision", None)
    if variant in FP8 and prec is not None:
        out.update(fp8_gemms=len(prec.fp8_modules), fp8_min_dim=fp8_min_dim,
                   fp8_emulated=next(model.parameters()).device.type == "cpu")
    wrappers = [w for m in model.modules() if (w := offload_wrapper(m)) is not None]
    if wrappers:
        out.update(offloaded_layers=len(wrappers),
                   offload_tensors=sum(w.stats.tensors for w in wrappers),
                   offload_gib=sum(w.stats.bytes for w in wrappers) / 2**30,
                   offload_prefetched=sum(w.stats.prefetched for w in wrappers),
                   offload_path=("host copies forced (CPU)" if "cpu" in wrappers[0].devices
                                 else "cuda: pinned host, side stream"))
    if variant == "slapo_optim_offload":
        out["optimizer_offload"] = True
    return out
