"""Backend choice and launch heuristics shared by the fused kernels.

Why a separate module: Triton is optional. Nothing here imports it; `triton_available()` only
asks whether it is installed, and the Triton kernels live in `_*_triton.py` modules imported on
the first Triton launch. So `import slapo` works (and the reference path runs) without Triton,
and a process that never launches a kernel never pays Triton's import time.

Backends: "auto" runs Triton on CUDA tensors when Triton is installed and PyTorch's reference
math otherwise; "triton" forces the Triton kernels (on CPU tensors only under
`TRITON_INTERPRET=1`, Triton's interpreter, which is how the kernels are tested without a GPU);
"reference" forces the PyTorch math (the exact computation of the module being replaced).

One policy for every Triton kernel in Slapo (these fused ops and Tempo's, `op/tempo_kernels.py`):
`use_triton`, whose "auto" answer one environment variable, `SLAPO_TRITON`, can change for the
whole process: `0` runs the references everywhere (to compare on a GPU), `1` also runs the
kernels on CPU tensors under `TRITON_INTERPRET=1` (tests); unset, "auto" is as above. An
explicit `backend="triton"` or `"reference"` wins over the variable.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "triton", "reference")
ENV = "SLAPO_TRITON"

# Widest chunk of a row one program holds in registers; longer rows loop over chunks. Tests lower
# it (monkeypatch) so tiny rows take the multi-chunk path too.
MAX_ROW_BLOCK = 8192
# Elementwise kernels: elements of a row per program.
ELEMENTWISE_BLOCK = 1024
# Dtypes the Triton kernels accept; anything else (fp64, ints) takes the reference path.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_TRITON_INSTALLED: bool | None = None


def triton_available() -> bool:
    """Whether the `triton` package is installed (it is not imported here)."""
    global _TRITON_INSTALLED
    if _TRITON_INSTALLED is None:
        _TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """True under `TRITON_INTERPRET=1`: Triton kernels then run on CPU tensors (slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; use one of {', '.join(BACKENDS)}")
    return backend


def use_triton(backend: str, *tensors: torch.Tensor | None) -> bool:
    """Whether to launch the Triton kernels for these tensors (see the module docstring).

    "triton" on tensors Triton cannot run (CPU without the interpreter, fp64) raises instead of
    silently falling back, so a test or benchmark that asks for the kernels gets them.
    """
    ts = [t for t in tensors if t is not None]
    if backend == "reference":
        return False
    supported = all(t.dtype in TRITON_DTYPES for t in ts)
    on_device = all(t.is_cuda for t in ts)
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' but the triton package is not installed "
                               "(pip install triton); use backend='auto'.")
        if not supported:
            raise RuntimeError(f"backend='triton' supports {TRITON_DTYPES}, got "
                               f"{sorted({str(t.dtype) for t in ts})}.")
        if not (on_device or interpreting()):
            raise RuntimeError("backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 to "
                               "run the kernels on CPU.")
        return True
    flag = os.environ.get(ENV)
    if flag == "0" or not (supported and triton_available()):
        return False
    return on_device or (flag == "1" and interpreting() and all(t.device.type == "cpu" for t in ts))


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def row_block(n: int) -> int:
    """Chunk width for a row of `n` elements (the whole row when it fits)."""
    return min(next_power_of_2(n), MAX_ROW_BLOCK)


def num_warps(block: int) -> int:
    """Warps per program for a row chunk of `block` elements (Liger-Kernel's rule of thumb)."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def reduction_programs(rows: int, device: torch.device) -> int:
    """Programs for a backward that also reduces a weight gradient over rows.

    Each program handles a contiguous run of rows and keeps one fp32 partial sum of the weight
    gradient; the partials ([programs, N]) are summed afterwards. On CUDA: two programs per SM;
    under the interpreter: at most 4, so small tests still give each program several rows.
    """
    if device.type == "cuda":
        return max(1, min(rows, 2 * _sm_count(device.index or 0)))
    return max(1, min(rows, 4))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, last dim] view with a unit last-dim stride (copying only if needed)."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def define_op(name: str, schema: str, impl, fake):
    """Register `slapo_kernels::<name>` as an opaque custom op (Triton launch inside `impl`).

    Why a custom op: `torch.compile` then keeps each launch as one node of its graph (no graph
    break, no attempt to trace Triton's launcher); `fake` gives it output shapes and dtypes. The
    schema is explicit so the annotations of `impl` do not matter.
    """
    op = torch.library.custom_op(f"slapo_kernels::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    return op
