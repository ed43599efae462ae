"""`decompose`: split a Linear into a bias-free matmul plus a separate bias add."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from .. import module_patch, sharding
from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive


class BiasFreeKernel(module_patch.Kernel):
    """Linear/Conv1D without its bias: the traced parent graph adds the bias as its own node."""

    name = "bias_free"

    def __init__(self, conv1d: bool):
        self.conv1d = conv1d

    def __call__(self, mod, x):
        return sharding.local_gemm(mod, x)


def _graph_owner(sch) -> tuple[fx.GraphModule, str] | None:
    """The nearest traced ancestor whose graph calls this module, and the call's target."""
    node, rel = sch.parent, sch.name
    while node is not None:
        mod = node.mod
        if isinstance(mod, fx.GraphModule):
            if any(n.op == "call_module" and n.target == rel for n in mod.graph.nodes):
                return mod, rel
            return None
        rel = f"{node.name}.{rel}"
        node = node.parent
    return None


@register_primitive
class DecomposePrimitive(Primitive):
    """Run this nn.Linear (or HF Conv1D) as `matmul` then `+ bias`, so the bias add becomes a
    separate op that a traced graph can fuse with what follows (bias + GELU). Parameters and
    names are unchanged; it composes with `shard`/`sync` in either order.

    When the parent is traced (the layer is a `call_module` leaf of a graph), the bias add is
    inserted into the parent graph as `get_attr(<layer>.bias)` + `add`, where `find`/`fuse`
    can see it; the layer itself then runs bias-free."""

    name = "decompose"

    @classmethod
    def validate(cls, sch):
        refuse_in_export_capture(sch, "decompose", "decompose before tracing, or trace with tracer='fx'.")
        mod = sch.mod
        cls_ = module_patch.original_class(mod)
        is_linear = issubclass(cls_, nn.Linear)
        if not (is_linear or sharding._is_hf_conv1d(mod)):
            raise SchedulingError(sch.path, f"decompose applies to nn.Linear or Conv1D, not "
                                  f"{cls_.__name__}.", "call it on a Linear submodule.")
        if getattr(mod, "bias", None) is None:
            raise SchedulingError(sch.path, "this layer has no bias, so there is nothing to "
                                  "decompose.", "skip decompose for bias-free layers.")
        if module_patch.kernel(mod) is not None:
            raise SchedulingError(sch.path, "this layer already runs matmul and bias separately "
                                  "(decomposed, or a row-parallel sync was applied).",
                                  "remove the decompose call.")

    @classmethod
    def apply(cls, sch):
        mod = sch.mod
        is_linear = issubclass(module_patch.original_class(mod), nn.Linear)
        owner = _graph_owner(sch)
        if owner is not None:
            _decompose_in_graph(mod, *owner, conv1d=not is_linear)
            sch.metadata["decomposed_in_graph"] = True
            return
        module_patch.set_kernel(mod, sharding.LinearKernel() if is_linear
                                else sharding.Conv1DKernel())


def _decompose_in_graph(mod: nn.Module, gm: fx.GraphModule, target: str, conv1d: bool) -> None:
    module_patch.set_kernel(mod, BiasFreeKernel(conv1d))
    for node in [n for n in gm.graph.nodes if n.op == "call_module" and n.target == target]:
        with gm.graph.inserting_after(node):
            bias = gm.graph.get_attr(f"{target}.bias")
        with gm.graph.inserting_after(bias):
            add = gm.graph.call_function(torch.add, (node, bias))
        node.replace_all_uses_with(add, delete_user_cb=lambda u, a=add: u is not a)
    gm.graph.lint()
    gm.recompile()
