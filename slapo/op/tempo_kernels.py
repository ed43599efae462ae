"""Launchers of Tempo's fused Triton kernels (GELU and LayerNorm, forward and backward).

Why a separate module: the kernels (`slapo.op.tempo_triton`) import `triton` at import time and
Triton decides at decoration time whether to compile or interpret (`TRITON_INTERPRET=1`). This
module imports them on first use only, so `import slapo` never needs triton, and tests can set
`TRITON_INTERPRET=1` before the first launch to run the very same kernels on CPU tensors.

Policy: Slapo's one Triton policy, `op.kernels._common.use_triton("auto", ...)`: CUDA tensors use
the kernels when triton is installed; CPU tensors use them only under `TRITON_INTERPRET=1` *and*
`SLAPO_TRITON=1` (tests), otherwise the exact PyTorch references in `tempo_gelu` /
`tempo_layernorm` run. `SLAPO_TRITON=0` forces the references everywhere (to compare on GPU).
"""

from __future__ import annotations

import os
from typing import Any

import torch


def compiled_path() -> str:
    """How Tempo runs inside `torch.compile`: "fused" (default) or "opaque".

    "fused": the LayerNorm is a pure-PyTorch autograd.Function that dynamo traces, so inductor
    fuses it with the residual adds, dropouts and casts around it; the GELU's y is computed by
    inductor and only its code byte and backward are custom ops (docs/tempo.md says why).
    "opaque" (`SLAPO_TEMPO_COMPILED=opaque`): the earlier whole-op custom ops, kept to measure
    against on GPU (benchmarks/tempo_gpu.py). Read at trace time.
    """
    mode = os.environ.get("SLAPO_TEMPO_COMPILED", "fused")
    if mode not in ("fused", "opaque"):
        raise ValueError(f"SLAPO_TEMPO_COMPILED must be 'fused' or 'opaque', got {mode!r}")
    return mode


def _k() -> Any:
    from . import tempo_triton

    return tempo_triton


def _gelu_module() -> Any:
    """The tempo_gelu module (`slapo.op.tempo_gelu` the attribute is the function of that name)."""
    import importlib

    return importlib.import_module("slapo.op.tempo_gelu")


def _gelu_consts(approximate: str, dtype: torch.dtype) -> dict:
    tg = _gelu_module()

    hl, hr = tg.table_steps(approximate)
    return dict(
        xm=tg.X_MIN[approximate],
        ym=tg.Y_MIN[approximate],
        inv_hl=1.0 / hl,
        inv_hr=1.0 / hr,
        scale=tg.correction_scale(dtype),
        TANH=approximate == "tanh",
        TAB_N=tg.TABLE_N,
    )


_BLOCK = 1024


def gelu_fwd(x: torch.Tensor, approximate: str = "none") -> tuple[torch.Tensor, torch.Tensor]:
    """One fused pass: y = GELU(x) (x's dtype) and the 1-byte code (see `tempo_gelu`)."""
    tg = _gelu_module()

    x = x.contiguous()
    y = torch.empty_like(x)
    code = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        table = tg.derivative_table(approximate, x.device)
        c = _gelu_consts(approximate, x.dtype)
        grid = (triton_cdiv(n, _BLOCK),)
        _k().gelu_fwd_kernel[grid](x, y, code, table, n, c["xm"], c["ym"], c["inv_hl"],
                                   c["inv_hr"], 1.0 / c["scale"], TANH=c["TANH"],
                                   BF16=x.dtype == torch.bfloat16, TAB_N=c["TAB_N"], BLOCK=_BLOCK)
    return y, code


def gelu_code(x: torch.Tensor, y: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """One pass: the 1-byte code of x for a y = GELU(x) already stored (by inductor's kernel)."""
    tg = _gelu_module()

    x, y = x.contiguous(), y.contiguous()
    code = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    n = x.numel()
    if n:
        table = tg.derivative_table(approximate, x.device)
        c = _gelu_consts(approximate, y.dtype)
        grid = (triton_cdiv(n, _BLOCK),)
        _k().gelu_code_kernel[grid](x, y, code, table, n, c["xm"], c["ym"], c["inv_hl"],
                                    c["inv_hr"], 1.0 / c["scale"], TANH=c["TANH"],
                                    TAB_N=c["TAB_N"], BLOCK=_BLOCK)
    return code


def gelu_bwd(dy: torch.Tensor, y: torch.Tensor, code: torch.Tensor,
             approximate: str = "none") -> torch.Tensor:
    """One fused pass: dx = dy * GELU'(x) recovered from (y, code)."""
    tg = _gelu_module()

    dy = dy.contiguous()
    dx = torch.empty_like(dy)
    n = dy.numel()
    if n:
        table = tg.derivative_table(approximate, y.device)
        c = _gelu_consts(approximate, y.dtype)
        grid = (triton_cdiv(n, _BLOCK),)
        _k().gelu_bwd_kernel[grid](dy, y, code, dx, table, n, c["ym"], c["inv_hl"], c["inv_hr"],
                                   c["scale"], TAB_N=c["TAB_N"], BLOCK=_BLOCK)
    return dx


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _block_n(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def layer_norm_fwd(x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                   eps: float, out_dtype: torch.dtype, save_dtype: torch.dtype):
    """Rows of `x2d` (M, N) normalised: (y in out_dtype, y_saved in save_dtype, rstd fp32 (M,)).

    y_saved is y itself (same storage) when save_dtype == out_dtype, else a second output written
    by the same pass (autocast: y fp32 for the residual stream, y_saved bf16 for backward).
    """
    m, n = x2d.shape
    y = torch.empty((m, n), dtype=out_dtype, device=x2d.device)
    ys = y if save_dtype == out_dtype else torch.empty((m, n), dtype=save_dtype,
                                                       device=x2d.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x2d.device)
    if m:
        dummy = rstd
        _k().ln_fwd_kernel[(m,)](x2d, weight if weight is not None else dummy,
                                 bias if bias is not None else dummy, y, ys, rstd, n, eps,
                                 HAS_W=weight is not None, HAS_B=bias is not None,
                                 SEPARATE=ys is not y,
                                 BF16_SAVE=save_dtype == torch.bfloat16, BLOCK_N=_block_n(n))
    return y, ys, rstd


def layer_norm_bwd(dy2d: torch.Tensor, ys: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, rstd: torch.Tensor, dx_dtype: torch.dtype):
    """(dx (M, N) in dx_dtype, dweight fp32 (N,) or None, dbias fp32 (N,) or None) from y_saved.

    One pass over the rows: per row the two row means of the LayerNorm backward; dweight/dbias are
    accumulated per program in registers, written as (programs, N) partial sums and summed here.
    """
    m, n = dy2d.shape
    dx = torch.empty((m, n), dtype=dx_dtype, device=dy2d.device)
    progs = max(1, min(m, _programs(dy2d.device)))
    rows = triton_cdiv(m, progs) if m else 0
    dw = torch.zeros((progs, n), dtype=torch.float32, device=dy2d.device)
    db = torch.zeros((progs, n), dtype=torch.float32, device=dy2d.device)
    if m:
        dummy = rstd
        _k().ln_bwd_kernel[(progs,)](dy2d, ys, weight if weight is not None else dummy,
                                     bias if bias is not None else dummy, rstd, dx, dw, db,
                                     m, n, rows, HAS_W=weight is not None,
                                     HAS_B=bias is not None, BLOCK_N=_block_n(n))
    return dx, (dw.sum(0) if weight is not None else None), (db.sum(0) if bias is not None
                                                               else None)


def _programs(device: torch.device) -> int:
    """Programs of the LayerNorm backward: a few per SM on CUDA, a handful when interpreting."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4
