"""`annotate`: attach a tag to a parameter or buffer that survives sharding."""

from __future__ import annotations

from ..errors import SchedulingError
from ._util import direct_tensor
from .base import Primitive, register_primitive


@register_primitive
class AnnotatePrimitive(Primitive):
    """Set `tensor.<key> = value` on parameter/buffer `name` and remember it, so the tag is
    carried over when `shard` or `build` re-create the tensor (e.g. `replicated_param=True`)."""

    name = "annotate"

    @classmethod
    def validate(cls, sch, name: str, key: str, value=None):
        direct_tensor(sch, name)
        if not isinstance(key, str) or not key.isidentifier() or key.startswith("_slapo"):
            raise SchedulingError(sch.path, f"invalid annotation key {key!r}.",
                                  "use a Python identifier not starting with '_slapo'.")

    @classmethod
    def apply(cls, sch, name: str, key: str, value=None):
        _, t = direct_tensor(sch, name)
        tags = dict(getattr(t, "_slapo_tags", {}) or {})
        tags[key] = value
        t._slapo_tags = tags
        setattr(t, key, value)
