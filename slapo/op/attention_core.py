"""The common contract of attention cores: q, k, v in, context out; projections stay outside.

Why a separate "core": every HF model computes its own Q/K/V projections (Linear, Conv1D, fused
QKV, rotary embeddings) and then calls one attention function. Replacing only that function lets a
schedule swap the memory/speed-critical part without touching parameters, state-dict keys or
checkpoints. A core is an `nn.Module` (it follows `.train()`/`.eval()` of its parent) whose
`forward` has HF's attention-interface signature; `attend` is the plain tensor API.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d), each kv head repeated n_rep times."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """Bool (q_len, k_len) mask, True = attend; aligned bottom-right (queries are the last keys)."""
    i = torch.arange(q_len, device=device)[:, None] + (k_len - q_len)
    return torch.arange(k_len, device=device)[None, :] <= i


def padding_mask(key_padding: torch.Tensor) -> torch.Tensor:
    """(b, k_len) with True/1 for real tokens -> bool (b, 1, 1, k_len) attention mask."""
    return key_padding.bool()[:, None, None, :]


def masked_entries(mask: torch.Tensor) -> torch.Tensor:
    """Bool, True where `mask` hides a key: False entries of a bool mask (True = attend), and
    entries of an additive float mask at most half of `finfo.min` (HF writes exactly
    `finfo.min`; -inf counts too). At that size a float entry absorbs any score added to it
    (`s + min == min` in fp32 for |s| < 2**103), which is what makes a row of them special."""
    if mask.dtype == torch.bool:
        return ~mask
    return mask <= torch.finfo(mask.dtype).min / 2


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """Bool (..., s_q, 1): the query rows in which `mask` hides every key (left padding under a
    causal mask makes one per padding position). No kernel should see such a row: torch's CPU
    flash kernel computes its backward wrong for a float mask (docs/ops.md), CUDA kernels
    have produced NaN for it; `open_dead_rows` + `fill_dead_rows` give them defined values."""
    return masked_entries(mask).all(-1, keepdim=True)


def open_dead_rows(mask: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """`mask` with every dead row attending to all keys (finite, ordinary rows for any kernel);
    their results are then replaced by `fill_dead_rows`."""
    if mask.dtype == torch.bool:
        return mask | dead
    return mask.masked_fill(dead, 0.0)


class _UniformDeadRows(torch.autograd.Function):
    """Dead rows of an additive float mask as HF's eager attention computes them, in O(s d^2).

    Eager adds `finfo.min` to every score of the row; in floating point the sum is `min`
    whatever the score, so softmax is exactly uniform (1/n over the n keys) and the output is
    the mean of v. Autograd still sends softmax's backward through the addition: with P = 1/n
    and the row's output gradient g, dS_j = (g . (v_j - mean v)) / n, hence
    dq = scale * g (Vc^T K), dk = scale * Vc (G^T Q), dv_j += g / n, dmask = dS (T5's learned
    position bias is folded into the mask). Those are d x d products, so no s x s tensor is
    built and nothing beyond the attention's own q, k, v is saved.
    """

    @staticmethod
    def forward(ctx, out, dead, q, k, v, mask, scale):
        ctx.save_for_backward(dead, q, k, v)
        ctx.scale, ctx.mask_shape = scale, mask.shape
        return torch.where(dead, v.mean(-2, keepdim=True).to(out.dtype), out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dead, q, k, v = ctx.saved_tensors
        n = k.shape[-2]
        g_live = g.masked_fill(dead, 0.0)
        g_dead = (g - g_live).to(v.dtype)
        vc = v - v.mean(-2, keepdim=True)
        w = ctx.scale / n
        need = ctx.needs_input_grad
        dq = w * (g_dead @ (vc.transpose(-1, -2) @ k)) if need[2] else None
        dk = w * (vc @ (g_dead.transpose(-1, -2) @ q)) if need[3] else None
        dv = (g_dead.sum(-2, keepdim=True) / n).expand_as(v) if need[4] else None
        dmask = None
        if need[5]:
            dmask = ((g_dead @ vc.transpose(-1, -2)) / n).sum_to_size(ctx.mask_shape)
        return g_live, None, dq, dk, dv, dmask, None


def fill_dead_rows(
    out: torch.Tensor,
    dead: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Replace the dead rows of attention output `out` (b, h, s_q, d) with what the model that
    built `mask` computes there, values and gradients.

    A bool mask comes from a model configured for SDPA: torch defines a fully masked row as
    zeros (output and gradients), so zeros. A float mask comes from a model configured eager:
    uniform attention over all keys with eager's gradient (`_UniformDeadRows`); `k`, `v` have
    q's heads (repeated for GQA)."""
    if mask.dtype == torch.bool:
        return out.masked_fill(dead, 0.0)
    return _UniformDeadRows.apply(out, dead, q, k, v, mask, scale)


def prepare_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scaling: float | None,
) -> torch.Tensor:
    """q k^T * scaling with a bool mask (True = attend), an additive float mask, or causal masking.

    Same op order as HF's eager attention, so results agree to the last bit in the forward pass.
    GQA: k may have fewer heads than q; it is repeated here.
    """
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    elif is_causal:
        keep = causal_mask(q.shape[-2], k.shape[-2], q.device)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    return scores


# Inputs Hugging Face passes to an attention function that change what it computes and that no
# core here computes: Gemma 2's logit soft-cap, attention sinks (GPT-OSS's `s_aux`, Inkling 2's
# `sinks`), the keys a sparse-attention indexer selected (DeepSeek-V3.2's `indices`, MiniMax-M3's
# `block_indices`: passed when the attention module's own config names no eager/SDPA, which a
# Slapo core's does). Dropping one computes another attention, silently (tests/test_generate_declared.py).
UNCOMPUTED = ("softcap", "s_aux", "sinks", "indices", "block_indices")
# Tensors HF passes that a core may ignore: the mask it receives already encodes them (positions,
# packed sequences, the cache), as for HF's own SDPA function, or they are another input's
# (cross-attention states reach the core as k and v).
IGNORED_TENSORS = ("position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k",
                   "encoder_hidden_states")


def refuse_uncomputed(core: str, module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise for an input of HF's attention call that core `core` would drop: a name in
    `UNCOMPUTED`, or any tensor not in `IGNORED_TENSORS` (a new model's extra input is refused,
    never silently skipped). Flags and sizes (`sliding_window`, `output_attentions`, ...) pass:
    the mask encodes the window, as for HF's SDPA function."""
    for name, value in kwargs.items():
        if value is None or not (name in UNCOMPUTED or
                                 (torch.is_tensor(value) and name not in IGNORED_TENSORS)):
            continue
        raise ValueError(
            f"{core}: {type(module).__name__} passed `{name}` to its attention function, which "
            "this core does not compute (it would be dropped); keep the model's own attention "
            "implementation for this layer (leave `attention` unset)."
        )


class AttentionCore(nn.Module):
    """Base class. Subclasses implement `attend(q, k, v, mask, is_causal, dropout, scaling)`.

    q: (b, heads, s_q, d); k, v: (b, kv_heads, s_k, d) with heads % kv_heads == 0; returns
    (b, heads, s_q, d). `forward` adapts HF's attention-interface call
    `(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)` and returns
    `(context (b, s_q, heads, d), None)`, as HF's sdpa/flash functions do.
    """

    # True for a core that calls the model's own attention function with every input HF passed
    # (`model_schedule._common.HFAttentionCore`): nothing is dropped, `UNCOMPUTED` included
    runs_model_function = False

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
        dropout: float = 0.0,
        scaling: float | None = None,
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        position_bias = kwargs.pop("position_bias", None)
        if position_bias is not None:  # T5: an additive per-head bias; fold it into the mask
            causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
            if causal and attention_mask is None and query.shape[2] > 1:
                attention_mask = causal_mask(query.shape[2], key.shape[2], query.device)
            if attention_mask is not None and attention_mask.dtype == torch.bool:
                attention_mask = torch.zeros_like(attention_mask, dtype=query.dtype).masked_fill(
                    ~attention_mask, torch.finfo(query.dtype).min
                )
            attention_mask = (
                position_bias if attention_mask is None else position_bias + attention_mask
            )
            is_causal = False
        refuse_uncomputed(type(self).__name__, module, kwargs)
        if query.shape[1] % key.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: {query.shape[1]} query heads not a multiple of "
                f"{key.shape[1]} key/value heads"
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        out = self.attend(query, key, value, attention_mask, causal, dropout, scaling)
        return out.transpose(1, 2).contiguous(), None
