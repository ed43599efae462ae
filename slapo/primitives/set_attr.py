"""`set_attr`: change a plain attribute of a module, recorded in the schedule."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import SchedulingError
from .base import Primitive, register_primitive


@register_primitive
class SetAttrPrimitive(Primitive):
    """Set a plain (non-tensor, non-module) attribute, e.g. GPT-2 attention's `split_size` after
    its fused q|k|v projection is sharded. Recording it keeps the schedule the one place where
    the model's execution is changed."""

    name = "set_attr"

    @classmethod
    def validate(cls, sch, name: str, value):
        mod = sch.mod
        if not isinstance(name, str) or name not in mod.__dict__:
            raise SchedulingError(sch.path, f"{type(mod).__name__} has no plain attribute "
                                  f"{name!r}.", "set an attribute the module already has.")
        if isinstance(mod.__dict__[name], (torch.Tensor, nn.Module)) or \
                isinstance(value, (torch.Tensor, nn.Module)):
            raise SchedulingError(sch.path, f"{name!r} is a tensor or module.",
                                  "use shard/replace for tensors and modules.")

    @classmethod
    def apply(cls, sch, name: str, value):
        setattr(sch.mod, name, value)
