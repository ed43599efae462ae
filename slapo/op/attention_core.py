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


class AttentionCore(nn.Module):
    """Base class. Subclasses implement `attend(q, k, v, mask, is_causal, dropout, scaling)`.

    q: (b, heads, s_q, d); k, v: (b, kv_heads, s_k, d) with heads % kv_heads == 0; returns
    (b, heads, s_q, d). `forward` adapts HF's attention-interface call
    `(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)` and returns
    `(context (b, s_q, heads, d), None)`, as HF's sdpa/flash functions do.
    """

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
        for name in ("softcap", "s_aux"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{type(self).__name__}: HF passed `{name}`, which this core does not "
                    "implement; keep the model's own attention implementation for this layer."
                )
        if query.shape[1] % key.shape[1]:
            raise ValueError(
                f"{type(self).__name__}: {query.shape[1]} query heads not a multiple of "
                f"{key.shape[1]} key/value heads"
            )
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        causal = bool(causal) and attention_mask is None and query.shape[2] > 1
        out = self.attend(query, key, value, attention_mask, causal, dropout, scaling)
        return out.transpose(1, 2).contiguous(), None
