"""Slapo 2023 op classes (`slapo.op.FlashAttention`, `FusedMLP`, ...) as adapters onto today's
ops, with the 2023 constructor arguments, parameter names and forward signatures, so a 2023
schedule's `replace(...)` and `shard("fc_in.weight", ...)` calls keep working.

Kernels: 2023's CUDA-only kernel choices (`attn_op_name` "cuda", "triton", "cutlass", "auto",
"native_xformers", "native_flash_attn": flash-attn 1.x / xFormers builds pinned to 2022-23
commits) all run `SDPAttention` (PyTorch SDPA, flash-attn 2 when installed, on CPU and GPU);
TorchScript requests (`use_torchscript=True`) run the same epilogue under `torch.compile`, with a
one-time notice, falling back to eager where compilation is not possible.

Fixed 2023 bugs (docs/migrating.md):
- attention masks are always applied (flash-attn kernels ignored padding masks);
- attention dropout is off in eval mode (2023 applied `attn_pdrop` in eval too);
- causality is an explicit `causal=` argument of `FlashAttention`; when omitted it follows
  `output_proj` as 2023 did, with a notice (2023 silently made every module with an output
  projection causal, which turned the ALBERT encoder causal);
- a KV cache (`layer_past`) is concatenated along the sequence, not the head axis;
- `FusedMLP` applies its `orig_act` (2023 always used tanh-GeLU), and `LinearWithAct("gelu")`
  is the exact erf GeLU of HF's "gelu" ("gelu_new" is the tanh one; 2023 used tanh for both);
- `ParallelCrossEntropy` ignores label -100 (Megatron's kernel counted it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..notices import notice_once
from .attention import SDPAttention
from .attention_core import causal_mask
from .fused import _MaybeCompiled, bias_gelu
from .vocab_parallel import vocab_parallel_cross_entropy

ATTN_OP_NAMES = ("auto", "cuda", "triton", "cutlass", "native_xformers", "native_flash_attn")
_FLASH_NAMES = ("auto", "cuda", "triton")
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_fast": "tanh", "gelu_pytorch_tanh": "tanh"}
_OTHER_ACTS = {"relu": F.relu, "silu": F.silu, "swish": F.silu}


def _torchscript_notice(owner: str) -> None:
    notice_once(f"torchscript.{owner}", f"{owner}(use_torchscript=True): TorchScript is "
                "deprecated in PyTorch; the fused epilogue runs under torch.compile instead "
                "(eagerly where it cannot compile).")


# ----------------------------------------------------------------------------------- attention
class FlashAttentionOp(nn.Module):
    """2023 attention kernel module: `forward(query, key, value, attention_mask, p)` with
    q/k/v of shape (batch, seq, heads, head_dim) and an additive (or bool) mask broadcastable
    to (batch, heads, seq_q, seq_k); returns (batch, seq_q, heads, head_dim). Runs SDPA."""

    def __init__(self, attn_op_name: str = "auto", apply_causal_mask: bool = False,
                 scale: float | None = None):
        super().__init__()
        if attn_op_name not in ATTN_OP_NAMES:
            raise ValueError(f"FlashAttentionOp: unknown attn_op_name {attn_op_name!r}; use "
                             f"one of {ATTN_OP_NAMES}.")
        self.attn_op_name, self.apply_causal_mask, self.scale = (attn_op_name,
                                                                 apply_causal_mask, scale)
        self.core = SDPAttention(use_flash=None if attn_op_name in _FLASH_NAMES else False)

    def forward(self, query_layer: torch.Tensor, key_layer: torch.Tensor,
                value_layer: torch.Tensor, attention_mask: torch.Tensor | None = None,
                p: float = 0.0) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (query_layer, key_layer, value_layer))
        causal, mask = self.apply_causal_mask, attention_mask
        if causal and mask is not None:  # SDPA takes a mask or is_causal: fold causal in
            keep = causal_mask(q.shape[-2], k.shape[-2], q.device)
            mask = _with_causal(mask, keep, q.dtype)
            causal = False
        self.core.train(self.training)
        out = self.core.attend(q, k, v, mask, causal, p, self.scale)
        return out.transpose(1, 2).to(query_layer.dtype)


def _with_causal(mask: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask & keep
    return torch.where(keep, mask.to(dtype), torch.finfo(dtype).min)


class FlashAttention(nn.Module):
    """2023 HF-style self-attention (GPT-2 forward signature) over `FlashAttentionOp`.

    Parameters: `qkv` (fused, rows laid out head by head as [head][head_dim][q|k|v], so sharding
    rows by TP rank splits whole heads) or `query`/`key`/`value`; `out_proj` when
    `output_proj`. Reshapes use -1 heads, so they stay valid after sharding. Returns
    `(context, present)` with `present = (key, value)` when `use_cache`, else None.
    """

    def __init__(self, hidden_size: int, num_attention_heads: int, attn_pdrop: float = 0.0,
                 resid_pdrop: float = 0.0, attn_op_name: str = "auto", bias: bool = True,
                 output_proj: bool = True, fused_qkv: bool = False, causal: bool | None = None):
        super().__init__()
        if hidden_size % num_attention_heads:
            raise ValueError(f"FlashAttention: hidden_size {hidden_size} is not a multiple of "
                             f"num_attention_heads {num_attention_heads}.")
        if causal is None:
            causal = output_proj
            notice_once("FlashAttention.causal", "FlashAttention: causal masking follows "
                        f"output_proj (={output_proj}) as in Slapo 2023; pass causal=True/False "
                        "to say it explicitly.")
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.head_dim = hidden_size // num_attention_heads
        self.fused_qkv, self.attn_pdrop = fused_qkv, attn_pdrop
        if fused_qkv:
            self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=bias)
        else:
            self.query = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.key = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.value = nn.Linear(hidden_size, hidden_size, bias=bias)
        if output_proj:
            self.out_proj = nn.Linear(hidden_size, hidden_size, bias=bias)
            self.resid_dropout = nn.Dropout(resid_pdrop)
        self.attn_op = FlashAttentionOp(attn_op_name, causal)

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.fused_qkv:
            qkv = self.qkv(x).view(*x.shape[:-1], -1, self.head_dim, 3)
            return tuple(t.squeeze(-1) for t in qkv.split(1, dim=-1))
        return tuple(lin(x).view(*x.shape[:-1], -1, self.head_dim)
                     for lin in (self.query, self.key, self.value))

    def forward(self, hidden_states: torch.Tensor, layer_past=None, attention_mask=None,
                head_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                use_cache: bool = False, output_attentions: bool = False):
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise NotImplementedError("FlashAttention does not support cross-attention.")
        if head_mask is not None or output_attentions:
            raise NotImplementedError("FlashAttention does not support head_mask or "
                                      "output_attentions.")
        q, k, v = self._qkv(hidden_states)
        if layer_past is not None:
            k, v = torch.cat((layer_past[0], k), dim=1), torch.cat((layer_past[1], v), dim=1)
        ctx = self.attn_op(q, k, v, attention_mask, self.attn_pdrop)
        ctx = ctx.reshape(*ctx.shape[:-2], -1)
        if hasattr(self, "out_proj"):
            ctx = self.resid_dropout(self.out_proj(ctx))
        return ctx, ((k, v) if use_cache else None)


class FusedQKV(nn.Module):
    """One Linear for q, k and v (`fused_linear`, rows [head][head_dim][q|k|v]); forward
    returns [q, k, v], each (batch, seq, heads / world_size, head_dim) after TP sharding."""

    def __init__(self, hidden_size: int, num_heads: int, world_size: int = 1):
        super().__init__()
        self.hidden_size, self.num_heads, self.world_size = hidden_size, num_heads, world_size
        self.head_size = hidden_size // num_heads
        self.fused_linear = nn.Linear(hidden_size, 3 * num_heads * self.head_size)

    def forward(self, hidden_states: torch.Tensor) -> list[torch.Tensor]:
        qkv = self.fused_linear(hidden_states)
        qkv = qkv.view(*qkv.shape[:-1], -1, self.head_size, 3)
        return [t.squeeze(-1).contiguous() for t in qkv.split(1, dim=-1)]


# ---------------------------------------------------------------------------------- linear ops
class LinearWithSeparateBias(nn.Linear):
    """`nn.Linear` computed as a bias-free matmul, then `+ bias` (what `decompose` does to a
    Linear in place; this is the 2023 class for schedules that construct it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return y + self.bias if self.bias is not None else y


class LinearWithSyncFunc(nn.Linear):
    """`nn.Linear` whose matmul output goes through `sync_fn` (e.g. an all-reduce) *before*
    the bias is added, so a row-parallel layer adds its bias once (today's row-parallel
    `sync("fwd_post", "all_reduce")` does this by itself)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, sync_fn: Callable | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.sync_fn = sync_fn
        self.traceable = False  # a leaf for 2023 traces (its sync_fn is opaque)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.sync_fn(y) if self.sync_fn is not None else y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return y + self.bias if self.bias is not None else y


class LinearWithAct(LinearWithSyncFunc):
    """Linear, then `act_fn(y + bias)` as one fused epilogue (`slapo.op.bias_gelu` for GeLUs).
    `act_fn`: "gelu" (exact), "gelu_new" / "gelu_fast" / "gelu_pytorch_tanh" (tanh), "relu",
    "silu". `use_torchscript=True` compiles the epilogue with torch.compile."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 act_fn: str = "gelu", device=None, dtype=None, sync_fn: Callable | None = None,
                 use_torchscript: bool = False):
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        if not bias:
            raise ValueError("LinearWithAct requires bias=True (use nn.Linear otherwise).")
        if act_fn not in _GELU and act_fn not in _OTHER_ACTS:
            raise ValueError(f"LinearWithAct: unsupported act_fn {act_fn!r}; use one of "
                             f"{sorted([*_GELU, *_OTHER_ACTS])}.")
        if use_torchscript:
            _torchscript_notice("LinearWithAct")
        self.act_fn = act_fn
        self._epilogue = _MaybeCompiled(self._act, use_torchscript, "LinearWithAct")

    def _act(self, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.act_fn in _GELU:
            return bias_gelu(y, bias, _GELU[self.act_fn])
        return _OTHER_ACTS[self.act_fn](y + bias if bias is not None else y)

    def post_bias(self, z: torch.Tensor) -> torch.Tensor:
        """The tail after `+ bias` (run by a row-parallel sync kernel that replaces forward)."""
        return self._act(z, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._epilogue(self._matmul(x), self.bias)


def _bias_dropout(y: torch.Tensor, bias: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    return F.dropout(y + bias, p=p, training=training)


class LinearWithDropout(LinearWithSyncFunc):
    """Linear, then `dropout(y + bias, p)` as one fused epilogue (dropout only in training).
    `use_torchscript=True` compiles the epilogue with torch.compile."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, p: float = 0.5,
                 inplace: bool = False, device=None, dtype=None, use_torchscript: bool = False,
                 sync_fn: Callable | None = None):
        super().__init__(in_features, out_features, bias, device, dtype, sync_fn)
        if not bias:
            raise ValueError("LinearWithDropout requires bias=True (use nn.Linear otherwise).")
        if use_torchscript:
            _torchscript_notice("LinearWithDropout")
        self.p, self.inplace = p, inplace
        self._epilogue = _MaybeCompiled(_bias_dropout, use_torchscript, "LinearWithDropout")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._epilogue(self._matmul(x), self.bias, self.p, self.training)

    def post_bias(self, z: torch.Tensor) -> torch.Tensor:
        """The tail after `+ bias` (run by a row-parallel sync kernel that replaces forward)."""
        return F.dropout(z, p=self.p, training=self.training)


class FusedMLP(nn.Module):
    """`fc_in` (LinearWithAct with `orig_act`) then `fc_out` (LinearWithDropout, `resid_pdrop`):
    the 2023 GPT MLP. Shard `fc_in` on axis 0 and `fc_out` on axis 1 for TP."""

    def __init__(self, hidden_size: int, intermediate_size: int, orig_act: str = "gelu",
                 resid_pdrop: float = 0.0, use_torchscript: bool = False):
        super().__init__()
        self.fc_in = LinearWithAct(hidden_size, intermediate_size, act_fn=orig_act,
                                   use_torchscript=use_torchscript)
        self.fc_out = LinearWithDropout(intermediate_size, hidden_size, p=resid_pdrop,
                                        use_torchscript=use_torchscript)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.fc_in(hidden_states))


# ------------------------------------------------------------------------------- loss, debugging
class ParallelCrossEntropy(nn.Module):
    """Vocabulary-parallel cross-entropy: `forward(logits, labels)` with this rank's logit
    columns (..., V / tp) and the global labels; returns the per-token loss (labels' shape), the
    same on every rank (slapo.op.vocab_parallel_cross_entropy, reduction "none")."""

    def __init__(self, group=None, ignore_index: int = -100):
        super().__init__()
        self.group, self.ignore_index = group, ignore_index

    def forward(self, outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(outputs, labels, self.group, self.ignore_index,
                                            reduction="none")


class Print(nn.Module):
    """Debugging op: prints its inputs' shapes (or values with `values=True`) and returns its
    first input unchanged, as 2023's `Print.forward(x, *args)` did (the other inputs are only
    shown). Stays a leaf in traced graphs, so it can be inserted with `replace` after a node to
    watch it."""

    traceable = False
    _slapo_leaf = True

    def __init__(self, msg: str = "", values: bool = False):
        super().__init__()
        self.msg, self.values = msg, values

    def forward(self, *args):
        shown = [a if self.values or not isinstance(a, torch.Tensor) else
                 f"Tensor{tuple(a.shape)}:{a.dtype}" for a in args]
        print(self.msg, *shown)
        return args[0]


__all__ = ["ATTN_OP_NAMES", "FlashAttention", "FlashAttentionOp", "FusedMLP", "FusedQKV",
           "LinearWithAct", "LinearWithDropout", "LinearWithSeparateBias",
           "LinearWithSyncFunc", "ParallelCrossEntropy", "Print"]
