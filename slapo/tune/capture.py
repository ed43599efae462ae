"""Capture what one forward (and backward) of a module costs, without running it for real.

The module runs once under `FakeTensorMode` (shapes and dtypes only, no memory, no compute),
with `saved_tensors_hooks` recording every tensor autograd keeps for backward and dispatch
modes counting matmul FLOPs and the bytes the other ops move. Because it is the *real* eager
module running (HF attention, dropout, SDPA kernel choice and all), the saved set is exactly what
eager autograd would keep, which a hand-written formula or an AOT re-partition is not.

`measure_saved_bytes` is the same accounting on a real eager forward; it is the ground
truth the cost model is tested against.

What one op costs: `op_costs.py`; a compiled layer's partition: `partition_plan.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import TraceError
from .op_costs import _CostCounter, _sid, _tbytes

Inputs = tuple | dict
InputsFn = Callable[[int, int], Inputs]

@dataclass
class CaptureStats:
    """Costs of one forward (+ backward) at one concrete (batch, seq)."""

    saved_bytes: int  # saved for backward, excluding parameters and the module's inputs
    saved_input_bytes: int  # the module's inputs that autograd also saved
    input_bytes: int  # all tensor inputs (what a checkpointed module keeps)
    output_bytes: int
    param_bytes: int
    grad_bytes: int  # bytes of trainable parameters (one gradient each)
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0
    bwd_bytes: int = 0

    FIELDS = ("saved_bytes", "saved_input_bytes", "input_bytes", "output_bytes", "param_bytes",
              "grad_bytes", "fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes")


class _SavedRecorder:
    """`saved_tensors_hooks` pair that remembers every saved storage once (dedup by storage)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        self.storages[st._cdata] = st.nbytes()
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def split(self, params: Iterable[torch.Tensor], inputs: Iterable[torch.Tensor]) -> tuple[int, int]:
        """(bytes of non-param non-input storages, bytes of saved input storages)."""
        p = {_sid(t) for t in params}
        i = {_sid(t) for t in inputs} - p
        act = sum(n for k, n in self.storages.items() if k not in p and k not in i)
        inp = sum(n for k, n in self.storages.items() if k in i)
        return act, inp


def resize_inputs(example: Inputs) -> InputsFn:
    """Default input factory: every tensor's dim 0 is batch and (if it has one) dim 1 is seq.

    Values are zeros: only shapes, dtypes and `requires_grad` matter for the accounting. Pass
    your own `inputs_fn(batch, seq)` when the module takes masks or other shaped inputs.
    """
    _batch_seq(example)  # validate early

    def make(b: int, s: int) -> Inputs:
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.dim() == 0:
                return t
            shape = list(t.shape)
            shape[0] = b
            if t.dim() >= 2:
                shape[1] = s
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            return out.requires_grad_(t.requires_grad)

        return tree_map(one, example)

    return make


def _batch_seq(example: Inputs) -> tuple[int, int]:
    tensors = [t for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() < 2:
        raise TraceError(
            "", "example_inputs need a tensor of shape (batch, seq, ...) first.",
            "pass e.g. (torch.randn(2, 16, hidden),) or an inputs_fn(batch, seq).",
        )
    return int(tensors[0].shape[0]), int(tensors[0].shape[1])


def _call(module: torch.nn.Module, inputs: Inputs, params: dict[str, torch.Tensor]) -> Any:
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    return torch.func.functional_call(module, params, args, kwargs)


def _float_outputs(out: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]


def capture(module: torch.nn.Module, inputs_fn: InputsFn, batch: int, seq: int,
            dtype: torch.dtype | None = None, backward: bool = False) -> CaptureStats:
    """Run `module` once under FakeTensorMode at (batch, seq) and account for its costs.

    Works for modules on the meta device too (only shapes are used), so a 7B-parameter block can
    be captured on a laptop. `dtype` casts floating parameters and inputs (e.g. bf16 plans).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=False)
    real_in = inputs_fn(batch, seq)
    named = dict(module.named_parameters())
    bufs = dict(module.named_buffers())

    def fake_like(t: torch.Tensor, grad: bool) -> torch.Tensor:
        dt = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        dev = "cpu" if t.device.type == "meta" else t.device
        out = torch.empty(tuple(t.shape), dtype=dt, device=dev)
        return out.requires_grad_(grad)

    with mode:
        params = {n: fake_like(p, p.requires_grad) for n, p in named.items()}
        fbufs = {n: fake_like(b, False) for n, b in bufs.items()}
        fin = tree_map(lambda t: fake_like(t, t.requires_grad) if isinstance(t, torch.Tensor) else t,
                       real_in)
        in_tensors = [t for t in tree_flatten(fin)[0] if isinstance(t, torch.Tensor)]
        rec = _SavedRecorder()
        fwd = _CostCounter()
        try:
            with saved_tensors_hooks(rec.pack, rec.unpack), fwd:
                out = _call(module, fin, {**params, **fbufs})
        except Exception as e:
            raise TraceError(
                type(module).__name__,
                f"could not run the module under FakeTensorMode at batch={batch}, seq={seq}: "
                f"{type(e).__name__}: {e}",
                "check example_inputs / inputs_fn produce valid inputs for these sizes.",
            ) from e
        act, saved_in = rec.split(list(params.values()) + list(fbufs.values()), in_tensors)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        stats = CaptureStats(
            saved_bytes=act,
            saved_input_bytes=saved_in,
            input_bytes=sum({_sid(t): t.untyped_storage().nbytes() for t in in_tensors}.values()),
            output_bytes=sum({_sid(t): t.untyped_storage().nbytes() for t in outs}.values()),
            param_bytes=sum(_tbytes(t) for t in params.values()) + sum(_tbytes(t) for t in fbufs.values()),
            grad_bytes=sum(_tbytes(t) for t in params.values() if t.requires_grad),
            fwd_flops=fwd.flops,
            fwd_bytes=fwd.bytes,
        )
        if backward:
            leaves = [t for t in list(params.values()) + in_tensors if t.requires_grad]
            outs_g = _float_outputs(out)
            if outs_g and leaves:
                bwd = _CostCounter()
                with bwd:
                    torch.autograd.grad(outs_g, leaves, [torch.ones_like(o) for o in outs_g],
                                        allow_unused=True)
                stats.bwd_flops, stats.bwd_bytes = bwd.flops, bwd.bytes
    return stats


def measure_saved_bytes(module: torch.nn.Module, inputs: Inputs, checkpoint: bool = False,
                        include_inputs: bool = False) -> int:
    """Bytes a *real* eager forward saves for backward (ground truth for the cost model).

    Saved tensors are de-duplicated by storage; parameters and buffers are never counted; the
    module's own inputs only with `include_inputs`. `checkpoint=True` wraps the call in
    `torch.utils.checkpoint` with `use_reentrant=True`, which stores the inputs through
    `save_for_backward` where the hooks can see them (the non-reentrant variant keeps them in a
    closure, invisible to any hook, but holds exactly the same bytes).
    """
    from torch.utils.checkpoint import checkpoint as ckpt

    rec = _SavedRecorder()
    in_tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)]
    args, kwargs = (inputs, {}) if isinstance(inputs, tuple) else ((), inputs)
    with saved_tensors_hooks(rec.pack, rec.unpack):
        if checkpoint:
            if kwargs:
                raise ValueError("checkpoint=True needs positional inputs (a tuple), not a dict.")
            out = ckpt(module, *args, use_reentrant=True)
        else:
            out = module(*args, **kwargs)
    act, saved_in = rec.split(list(module.parameters()) + list(module.buffers()), in_tensors)
    del out
    return act + (saved_in if include_inputs else 0)
