"""What the ops of one traced call cost: matmul FLOPs (torch's flop registry plus CPU flash
attention; those of FP8 GEMMs also apart), bytes moved by the other ops, and kernel launches
(`_CostCounter`, a dispatch mode)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_MM_FLOPS: dict[str, Callable[..., int]] = {}


def _sdpa_cpu_flops(fwd: bool) -> Callable[..., int]:
    def count(args: tuple, out: Any) -> int:
        q, k = args[0], args[1]
        b, h, sq, d = q.shape
        sk = k.shape[-2]
        per = 2 * b * h * sq * sk * d  # one (sq x d) @ (d x sk) product
        return (2 if fwd else 5) * per  # QK^T, PV; backward: recompute QK^T + dV, dP, dQ, dK

    return count


_MM_FLOPS["aten._scaled_dot_product_flash_attention_for_cpu.default"] = _sdpa_cpu_flops(True)
_MM_FLOPS["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"] = _sdpa_cpu_flops(False)


_NO_KERNEL = {getattr(torch.ops.aten, n) for n in (
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "lift_fresh", "_local_scalar_dense", "set_", "_unsafe_view", "alias", "_has_compatible_shallow_copy_type")
    if hasattr(torch.ops.aten, n)}


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz") if hasattr(torch, n))


def is_fp8(t: Any) -> bool:
    """An FP8 tensor: its dtype, or (a wrapper subclass such as torchao's
    Float8TrainingTensor, whose dtype is the high-precision one) its inner data's."""
    if not isinstance(t, torch.Tensor):
        return False
    if t.dtype in FP8_DTYPES:
        return True
    return is_traceable_wrapper_subclass(t) and any(
        is_fp8(getattr(t, name)) for name in t.__tensor_flatten__()[0])


class _CostCounter(TorchDispatchMode):
    """Matmul FLOPs (torch's flop registry + CPU flash attention) and bytes moved by other ops.

    Bytes moved = bytes read + written by every non-matmul op whose outputs are new storage
    (views and in-place ops move nothing new). This is the memory-bound half of a roofline.
    `fp8_flops`: the part of `flops` whose operands are FP8 (`torch._scaled_mm`). An op on a
    tensor subclass (torchao's Float8TrainingTensor) is not counted itself: the counter
    returns NotImplemented, the subclass runs it as plain ops (`_scaled_mm`, the layout copies
    of the FP8 data, the scale reciprocals), and those are counted as they launch.
    """

    def __init__(self) -> None:
        super().__init__()
        from torch.utils.flop_counter import flop_registry

        self.registry = flop_registry
        self.flops = 0
        self.fp8_flops = 0
        self.bytes = 0
        self.kernels = 0  # ops that launch a kernel: everything but views and allocations

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass(t) for t in tree_flatten((args, kwargs))[0]):
            return NotImplemented  # the subclass's own ops are counted
        out = func(*args, **kwargs)
        name = str(func)
        if launches_kernel(func, out):
            self.kernels += 1
        if func.overloadpacket in self.registry:
            flops = int(self.registry[func.overloadpacket](*args, **kwargs, out_val=out))
            self.flops += flops
            if any(is_fp8(a) for a in args[:2]):
                self.fp8_flops += flops
        elif name in _MM_FLOPS:
            self.flops += int(_MM_FLOPS[name](args, out))
        else:
            ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
            outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
            in_st = {_sid(a) for a in ins}
            if outs and all(_sid(o) not in in_st for o in outs):
                self.bytes += sum(_tbytes(t) for t in ins) + sum(_tbytes(t) for t in outs)
        return out


def launches_kernel(func: Any, out: Any) -> bool:
    """Whether a dispatched op launches a device kernel: not a view, not an allocation, and it
    returns a tensor. Metadata queries return none: under fake tensors every `tensor.device`
    read dispatches `prim.device`, which once made 9 of every 11 "kernels" of a llama-1b step
    (tests/test_tune_gpu.py)."""
    if func.is_view or func.overloadpacket in _NO_KERNEL:
        return False
    return any(isinstance(o, torch.Tensor) for o in tree_flatten(out)[0])


def _sid(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def is_matmul(func: Any) -> bool:
    """Matmul and attention kernels: their own kernels (not fused by inductor), their time in
    the FLOP term; the same op list as the checkpoint primitive's selective policy."""
    from ..primitives.checkpoint import _SAVE_OPS

    return func in _SAVE_OPS


class StepCounter(_CostCounter):
    """FLOPs, bytes and kernels of a step. Compiled layers (stand-ins) pause it and add their
    recorded partition's costs instead (`add_plan`)."""

    def __init__(self) -> None:
        super().__init__()
        self._paused = 0

    def add_plan(self, plan: Any, part: str = "both") -> None:
        """Add a recorded partition's (`partition_plan.PartitionPlan`) costs: its forward
        graph's ("fwd"), its backward graph's ("bwd") or both, at the point of the step
        where they run (offload events read the counter as a clock)."""
        if part in ("fwd", "both"):
            self.flops += plan.fwd_flops
            self.fp8_flops += plan.fwd_fp8_flops
            self.bytes += plan.fwd_bytes
            self.kernels += plan.fwd_kernels
        if part in ("bwd", "both"):
            self.flops += plan.bwd_flops
            self.fp8_flops += plan.bwd_fp8_flops
            self.bytes += plan.bwd_bytes
            self.kernels += plan.bwd_kernels

    def paused(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def off() -> Any:
            self._paused += 1
            try:
                yield
            finally:
                self._paused -= 1

        return off()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._paused:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
