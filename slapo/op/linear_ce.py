"""Chunked linear + cross-entropy: the LM-head loss without materialising the (N, V) logits.

Why: for a language model the logits are the largest activation of the step (N tokens x V vocab,
kept in fp32 for the softmax; fp64 inputs stay fp64): 8k tokens x 128k vocab is 4 GiB, plus the same again for their
gradient. This Function walks over `chunk_size` rows at a time, keeps only the per-row
log-sum-exp, and recomputes each chunk's logits in backward to form the gradient on the fly.
Saved for backward: the hidden states (usually saved by the LM head anyway), one fp32 log-sum-exp
and the label per row; nothing proportional to V. Transient memory: one chunk of logits
(chunk_size x V) and its softmax.

Exact: the same math as `F.cross_entropy(hidden @ weight.T + bias, labels)` with fp32 logits;
results match to rounding (summation order). Costs one extra logits GEMM in backward (recompute).
Devices: any. Label smoothing and z-loss are not implemented.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    logits = F.linear(h, weight, bias)
    return logits.to(_compute_dtype(logits.dtype))


class ChunkedLinearCrossEntropyFunction(torch.autograd.Function):
    """Per-row loss lse(h W^T + b) - (h W^T + b)[label]; 0 for ignored rows."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, chunk_size):
        n = hidden.shape[0]
        ct = _compute_dtype(hidden.dtype)
        lse = torch.empty(n, dtype=ct, device=hidden.device)
        target = torch.empty(n, dtype=ct, device=hidden.device)
        valid = labels != ignore_index
        safe = labels.masked_fill(~valid, 0)
        for i in range(0, n, chunk_size):
            logits = _chunk_logits(hidden[i : i + chunk_size], weight, bias)
            lse[i : i + chunk_size] = torch.logsumexp(logits, dim=-1)
            target[i : i + chunk_size] = logits.gather(1, safe[i : i + chunk_size, None])[:, 0]
            del logits
        # not in place: torch 2.11's dynamo loses the gradient through an autograd.Function
        # that mutates its own output (tests/test_op_fused.py, docs/runtime.md)
        loss = (lse - target).masked_fill(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.chunk_size = chunk_size
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        ct = lse.dtype
        scale = grad_loss.to(ct).masked_fill(~valid, 0.0)
        dh = torch.empty_like(hidden) if need_h else None
        dw = torch.zeros(weight.shape, dtype=ct, device=weight.device) if need_w else None
        db = torch.zeros(weight.shape[0], dtype=ct, device=weight.device) if need_b else None
        for i in range(0, hidden.shape[0], ctx.chunk_size):
            part = slice(i, i + ctx.chunk_size)
            h = hidden[part]
            # d loss / d logits = softmax - onehot(label), times the incoming per-row gradient.
            g = _chunk_logits(h, weight, bias).sub_(lse[part, None]).exp_()
            g.scatter_add_(1, safe[part, None], -torch.ones_like(lse[part, None]))
            g.mul_(scale[part, None])
            if need_h:
                dh[part] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if need_w:
                dw.addmm_(g.t(), h.to(ct))
            if need_b:
                db.add_(g.sum(0))
            del g
        dw = dw.to(weight.dtype) if need_w else None
        db = db.to(bias.dtype) if need_b else None
        return dh, dw, db, None, None, None


# ------------------------------------------------------------------------------------------------
# Gradient-in-forward variant: the fast path for a scalar loss (mean or sum), as Liger-Kernel's
# fused linear cross-entropy does it. The loss is a scalar, so the gradient of every row is known
# up to one scalar factor (the incoming gradient) during the forward: each chunk's logits are
# computed once, turned into their loss *and* their logits-gradient right away, and contracted
# into dhidden / dweight. Backward only scales. Three GEMMs over the vocabulary instead of the
# recompute variant's four, and no logits survive the forward.
# ------------------------------------------------------------------------------------------------

_CHUNK_ELEMENTS = 1 << 27  # rows x vocab per chunk: 128M logits (256 MiB in bf16)


def auto_chunk_rows(vocab: int) -> int:
    """Rows per chunk: a power of two with about `_CHUNK_ELEMENTS` logits (few large GEMMs, a
    bounded transient)."""
    rows = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    return max(64, 1 << (rows.bit_length() - 1))


def _ce_chunk(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor, vocab: int):
    """Per-row loss and d(loss)/d(logits) for one chunk; rows scaled by `weight` (0 = ignored).
    Columns from `vocab` on are padding (see `_VOCAB_ALIGN`): -inf logits, zero gradient.

    Pure elementwise + row reductions over fp32 upcasts: on CUDA it is compiled into two fused
    kernels that read the logits once (see `_chunk_fn`)."""
    x = logits.to(_compute_dtype(logits.dtype))
    cols = torch.arange(x.shape[1], device=x.device)[None, :]
    if x.shape[1] != vocab:
        x = x.masked_fill(cols >= vocab, float("-inf"))
    lse = torch.logsumexp(x, dim=-1)
    picked = x.gather(1, target[:, None])[:, 0]
    loss = (lse - picked) * weight
    onehot = cols == target[:, None]
    grad = (torch.exp(x - lse[:, None]) - onehot.to(x.dtype)) * weight[:, None]
    return loss, grad.to(logits.dtype)


# The vocabulary is padded to a multiple of this inside the op: GEMMs whose vocabulary dimension
# is not a multiple of 8 elements (GPT-2's 50257) run on cuBLAS's slow unaligned kernels (what
# inductor's shape padding does for a compiled LM head).
_VOCAB_ALIGN = 128


def _vocab_padding(vocab: int, device: torch.device) -> int:
    """Padding rows for the head weight (CUDA only: CPU GEMMs do not care)."""
    return -vocab % _VOCAB_ALIGN if device.type == "cuda" else 0


_COMPILED: dict[str, object] = {}


def _chunk_fn(device: torch.device):
    """`_ce_chunk`, compiled on CUDA (once per process), eager elsewhere (exact reference)."""
    if device.type != "cuda":
        return _ce_chunk
    fn = _COMPILED.get("cuda")
    if fn is None:
        fn = _COMPILED["cuda"] = torch.compile(_ce_chunk, dynamic=False)
    return fn


def _compute_dtype_for(hidden: torch.Tensor) -> torch.dtype:
    """The GEMM dtype: the autocast dtype when autocast is on for this device (so the loss runs
    in bf16 exactly as `lm_head` would), else the hidden states' own dtype."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and hidden.dtype in (torch.float32, torch.float16,
                                                           torch.bfloat16):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """sum_rows(w_r * CE(h_r W^T + b, y_r)) with gradients computed in forward (see above)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, row_weight, chunk_size, dtype):
        dev = hidden.device
        n = hidden.shape[0]
        need_h, need_w, need_b = (ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                  bias is not None and ctx.needs_input_grad[2])
        vocab = weight.shape[0]
        pad = _vocab_padding(vocab, dev)
        with torch.autocast(dev.type, enabled=False):
            w = F.pad(weight.to(dtype), (0, 0, 0, pad))
            b = F.pad(bias.to(dtype), (0, pad)) if bias is not None else None
            h_all = hidden.to(dtype)
            loss = torch.zeros((), dtype=row_weight.dtype, device=dev)
            dh = torch.empty_like(hidden) if need_h else None
            acc = row_weight.dtype  # fp32 (fp64 for fp64 inputs)
            dw = torch.zeros(w.shape, dtype=acc, device=dev) if need_w else None
            db = torch.zeros(w.shape[0], dtype=acc, device=dev) if need_b else None
            chunk = _chunk_fn(dev)
            for i in range(0, n, chunk_size):
                h = h_all[i : i + chunk_size]
                logits = F.linear(h, w, b)
                rows, g = chunk(logits, labels[i : i + chunk_size],
                                row_weight[i : i + chunk_size], vocab)
                del logits
                loss = loss + rows.sum()  # not in place (as above)
                if need_h:
                    dh[i : i + chunk_size] = (g @ w).to(hidden.dtype)
                if need_w:
                    dw += (g.t() @ h).to(acc)
                if need_b:
                    db += g.to(acc).sum(0)
                del g
        ctx.save_for_backward(dh, dw[:vocab].to(weight.dtype) if need_w else None,
                              db[:vocab].to(bias.dtype) if need_b else None)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        dh, dw, db = ctx.saved_tensors

        def scale(t):
            return None if t is None else t * grad_loss.to(t.dtype)

        return scale(dh), scale(dw), scale(db), None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    num_items: int | torch.Tensor | None = None,
    skip_ignored: bool = False,
) -> torch.Tensor:
    """`cross_entropy(hidden @ weight.T + bias, labels)` as a scalar, without the logits.

    The fast path for training (see the gradient-in-forward note above): `reduction` "mean"
    (over non-ignored rows, or over `num_items` when given, as HF's `num_items_in_batch`) or
    "sum". Under autocast the GEMMs run in the autocast dtype and the softmax in fp32; weight
    and bias gradients are accumulated in fp32. `skip_ignored=True` first gathers the rows that
    have a label (one host sync): masked-LM heads where 85% of rows are ignored compute 15% of
    the logits. Exact to rounding against `F.cross_entropy(F.linear(...).float(), labels)`.
    """
    _check_args(hidden, weight, labels, reduction, chunk_size, ("mean", "sum"))
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = labels.reshape(-1)
    valid = flat_l != ignore_index
    if skip_ignored:
        idx = valid.nonzero()[:, 0]
        flat_h, flat_l, valid = flat_h.index_select(0, idx), flat_l[idx], valid[idx]
    if reduction == "sum":
        denom = torch.ones((), device=hidden.device)
    elif num_items is not None:
        denom = torch.as_tensor(num_items, device=hidden.device, dtype=torch.float32)
    else:
        denom = valid.sum().clamp_min(1).float()
    row_weight = valid.to(_compute_dtype(hidden.dtype)) / denom
    target = flat_l.masked_fill(~valid, 0)
    rows = chunk_size or auto_chunk_rows(weight.shape[0])
    return FusedLinearCrossEntropyFunction.apply(
        flat_h, weight, bias, target, row_weight, rows, _compute_dtype_for(hidden))


def _check_args(hidden, weight, labels, reduction, chunk_size, reductions) -> None:
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"linear_cross_entropy: hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} "
            "must agree on all but the last dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"linear_cross_entropy: weight must be (V, {hidden.shape[-1]}), got {tuple(weight.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if reduction not in reductions:
        raise ValueError(f"linear_cross_entropy: unknown reduction {reduction!r} "
                         f"(use one of {reductions})")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int = 1024,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, labels) in row chunks (see module docstring).

    hidden: (..., h), labels: (...), weight: (V, h). `reduction`: "mean" (over non-ignored
    rows, like `F.cross_entropy`), "sum" or "none" (per-row losses, 0 where ignored).
    """
    _check_args(hidden, weight, labels, reduction, chunk_size, ("mean", "sum", "none"))
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_l = labels.reshape(-1)
    loss = ChunkedLinearCrossEntropyFunction.apply(
        flat_h, weight, bias, flat_l, ignore_index, chunk_size
    )
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (flat_l != ignore_index).sum().clamp_min(1)


class ChunkedLinearCrossEntropy(nn.Module):
    """Module form: `forward(hidden, labels)` with the LM head's weight (and bias) shared.

    Use `ChunkedLinearCrossEntropy(lm_head)` to compute the loss of `lm_head(hidden)` without the
    logits, e.g. in a causal-LM training loop (shift labels yourself).
    """

    def __init__(self, head: nn.Linear, ignore_index: int = -100, chunk_size: int = 1024):
        super().__init__()
        self.head = head
        self.ignore_index = ignore_index
        self.chunk_size = chunk_size

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
        return linear_cross_entropy(
            hidden,
            self.head.weight,
            labels,
            self.head.bias,
            self.ignore_index,
            reduction,
            self.chunk_size,
        )
