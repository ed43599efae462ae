"""2023's `slapo.framework_dialect`: the registry of framework-specific classes
(`register_framework_dialect(target, cls_type)`, `get_dialect_cls(cls_type, target)`).

In 2023 `slapo.build(target="deepspeed")` looked up a "runtime_engine" (the DeepSpeed engine
initialiser) and a "pipeline_stage" (DeepSpeed's pipeline-stage wrapper) here, and the
benchmark scripts a "log_parser". Today `build(target="deepspeed")` holds its DeepSpeed
integration itself (`slapo.runtime.deepspeed`), and pipelines run on torch's pipelining, so
nothing is pre-registered: a 2023 program that registers its own dialect classes and reads
them back works as before; asking for one nobody registered is an error naming the
replacement (never a None the caller would call later).

`deepspeed.pipeline.analyze_tie_ranks(tie_weights, topology)`: 2023's helper computing the rank
groups of tied weights from a DeepSpeed topology (`slapo.compat.pipeline`), reachable by that
attribute path (2023's `slapo.framework_dialect.deepspeed.pipeline` module is not importable as
a module: the rest of 2023's DeepSpeed dialect is `build(target="deepspeed")` today)."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from ..compat import pipeline as _pipeline
from ..errors import SchedulingError

_DIALECTS: dict[tuple[str, str], Any] = {}

REPLACEMENTS = {
    "runtime_engine": "slapo.build(sch, target='deepspeed', config=...) returns the engine",
    "pipeline_stage": "slapo.build(sch, pipeline=...) runs torch's pipeline schedules",
    "log_parser": "slapo train writes metrics.json (docs/train.md, 'Outputs')",
}


def register_framework_dialect(target: str, cls_type: str) -> Callable[[Any], Any]:
    """Class (or function) decorator: register it as the `cls_type` of framework `target`."""
    def register(obj: Any) -> Any:
        _DIALECTS[(target, cls_type)] = obj
        return obj
    return register


def get_dialect_cls(cls_type: str, target: str, allow_none: bool = False) -> Any:
    """The `cls_type` registered for `target`; None when `allow_none` and nothing is."""
    key = (target, cls_type)
    if key in _DIALECTS:
        return _DIALECTS[key]
    if allow_none:
        return None
    fix = REPLACEMENTS.get(cls_type, "register it with @register_framework_dialect(target, "
                           "cls_type)")
    raise SchedulingError("", f"no {cls_type!r} dialect is registered for target {target!r} "
                          "(Slapo no longer keeps framework dialects in a registry).", fix + ".")


# 2023's `slapo.framework_dialect.deepspeed.pipeline.analyze_tie_ranks`
deepspeed = SimpleNamespace(pipeline=SimpleNamespace(analyze_tie_ranks=_pipeline.analyze_tie_ranks))

__all__ = ["deepspeed", "get_dialect_cls", "register_framework_dialect"]
