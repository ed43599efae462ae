"""`decompose`: split a Linear into a bias-free matmul plus a separate bias add."""

from __future__ import annotations

import torch.nn as nn

from .. import module_patch, sharding
from ..errors import SchedulingError
from .base import Primitive, register_primitive


@register_primitive
class DecomposePrimitive(Primitive):
    """Run this nn.Linear (or HF Conv1D) as `matmul` then `+ bias`, so the bias add becomes a
    separate op that a traced graph can fuse with what follows (bias + GELU). Parameters and
    names are unchanged; it composes with `shard`/`sync` in either order."""

    name = "decompose"

    @classmethod
    def validate(cls, sch):
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
        module_patch.set_kernel(mod, sharding.LinearKernel() if is_linear
                                else sharding.Conv1DKernel())
