"""2023 `slapo.utils` module paths: `report` (memory/profiling/FLOPs helpers) and `common`
(hook inspection and transfer). Thin wrappers over torch and slapo.profile."""

from . import common, report

__all__ = ["common", "report"]
