"""Attention over `torch.nn.functional.scaled_dot_product_attention`, with flash-attn on GPU.

Why: SDPA (and flash-attn) compute softmax(q k^T) v without materialising the s*s probabilities,
so activation memory is O(s) per head instead of O(s^2), and on GPU they are the fastest kernels.
Exact (same math; results differ from eager attention only by summation order). With dropout the
random stream differs from eager attention's, so compare runs with dropout 0. Query rows whose
mask hides every key (left padding) never reach a kernel (torch's CPU kernel computes their
backward wrong for float masks); they get what the model's own configuration computes there:
eager's uniform attention for a float mask, SDPA's zeros for a bool one (docs/ops.md).

Devices: CPU (SDPA's flash-for-CPU or math kernel; fp32/bf16, forward and backward) and CUDA
(flash / memory-efficient / cuDNN kernels chosen by PyTorch, except one case below).
`flash_attn.flash_attn_func` is used
when the package is importable, the tensors are fp16/bf16 on CUDA and there is no explicit mask;
it is imported lazily so CPU installs never need it.

Dropout on CUDA before torch 2.12: some cuDNN SDPA kernels resolve the dropout probability only
in steps of 1/16, so torch 2.11 (the GPU image's) trains `p=0.1` as a rounded probability,
silently. torch 2.12 stops routing such probabilities to cuDNN (pytorch#174245); before it,
`attend` does the same by running SDPA with the other backends (`sdpa_kernel`, which dynamo
traces, so compiled blocks keep one graph). Only in training with such a `p` on CUDA: dropout 0
(or 1/8, 1/16, ...) keeps cuDNN, the fastest H100 kernel. HF's own attention (schedules with
`attention=None`) is left as HF runs it.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .attention_core import (
    AttentionCore,
    causal_mask,
    dead_rows,
    fill_dead_rows,
    open_dead_rows,
    padding_mask,
    repeat_kv,
)

# SDPA takes grouped-query K/V without materialising repeated heads since torch 2.5.
_SDPA_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
# cuDNN may round SDPA's dropout probability to a multiple of 1/16 before torch 2.12 (above).
_CUDNN_MAY_ROUND_DROPOUT = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)


def cudnn_would_round_dropout(p: float, on_cuda: bool) -> bool:
    """Whether this torch could run SDPA with dropout `p` on a cuDNN kernel that rounds it to a
    multiple of 1/16 (the condition torch 2.12 checks before choosing cuDNN)."""
    return _CUDNN_MAY_ROUND_DROPOUT and on_cuda and p > 0 and (p * 16) % 1 != 0


def _sdpa_without_cudnn():
    """SDPA's backends other than cuDNN, in the default order of preference."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH])


@functools.cache
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    return flash_attn_func


def flash_attn_available() -> bool:
    """True when the flash-attn package imports and a CUDA device exists."""
    return torch.cuda.is_available() and _flash_attn_func() is not None


class SDPAttention(AttentionCore):
    """Attention core over SDPA / flash-attn (see module docstring).

    `use_flash`: None = automatic, False = never use the flash-attn package.
    Masks: bool (True = attend) or additive float, broadcastable to (b, heads, s_q, s_k).
    GQA: k/v may have fewer heads than q (heads % kv_heads == 0).
    """

    def __init__(self, use_flash: bool | None = None):
        super().__init__()
        self.use_flash = use_flash
        # looked up here, not in `attend`: dynamo cannot trace the (failing) import, and a
        # compiled block would break its graph at every call
        self._flash = _flash_attn_func() if use_flash is not False else None

    def attend(self, q, k, v, mask=None, is_causal=False, dropout=0.0, scaling=None):
        p = dropout if self.training else 0.0
        s_q, s_k = q.shape[-2], k.shape[-2]
        flash = self._flash if self.use_flash is not False else None
        if (
            flash is not None
            and q.is_cuda
            and mask is None
            and q.dtype in (torch.float16, torch.bfloat16)
        ):
            # flash-attn layout is (b, s, heads, d); it handles GQA and bottom-right causal itself.
            out = flash(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                dropout_p=p,
                softmax_scale=scaling,
                causal=is_causal,
            )
            return out.transpose(1, 2)
        if is_causal and s_q != s_k:  # SDPA's is_causal is top-left aligned; we want bottom-right
            mask, is_causal = causal_mask(s_q, s_k, q.device), False
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(q.dtype)
        n_rep = q.shape[1] // k.shape[1]
        gqa = {}
        if n_rep > 1:
            # the flash kernel reads shared K/V heads directly (no mask); others need copies
            if _SDPA_GQA and q.is_cuda and mask is None:
                gqa = {"enable_gqa": True}
            else:
                k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        # rows that mask every key (left padding) never reach a kernel: they attend to all keys
        # there and get the model's own values afterwards (see `attention_core.dead_rows`)
        dead = dead_rows(mask) if mask is not None else None
        backends = _sdpa_without_cudnn() if cudnn_would_round_dropout(p, q.is_cuda) else \
            contextlib.nullcontext()
        with backends:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if dead is None else open_dead_rows(mask, dead),
                dropout_p=p, is_causal=is_causal, scale=scaling, **gqa
            )
        if dead is None:
            return out
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        return fill_dead_rows(out, dead, q, k, v, mask, scale)


class SelfAttention(nn.Module):
    """Multi-head self-attention with GQA, built on any `AttentionCore` (default: SDPA).

    For models written from scratch (not HF): fused QKV projection, output projection, optional
    causal masking and key padding mask (b, s) with 1 for real tokens.
    """

    def __init__(
        self,
        hidden: int,
        heads: int,
        kv_heads: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        core: AttentionCore | None = None,
    ):
        super().__init__()
        kv_heads = kv_heads or heads
        if hidden % heads or heads % kv_heads:
            raise ValueError(
                f"SelfAttention: need hidden % heads == 0 and heads % kv_heads == 0, got "
                f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}"
            )
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.dropout = dropout
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.head_dim, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)
        self.core = core if core is not None else SDPAttention()

    def forward(
        self,
        x: torch.Tensor,
        key_padding: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        b, s, h = x.shape
        d = self.head_dim
        q, k, v = self.qkv(x).split([self.heads * d, self.kv_heads * d, self.kv_heads * d], -1)
        q = q.view(b, s, self.heads, d).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, d).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, d).transpose(1, 2)
        mask = None
        if key_padding is not None:
            mask = padding_mask(key_padding)
            if is_causal:
                mask = mask & causal_mask(s, s, x.device)
                is_causal = False
        o = self.core.attend(q, k, v, mask, is_causal, self.dropout, None)
        return self.out(o.transpose(1, 2).reshape(b, s, h))
