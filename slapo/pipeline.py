"""Pipeline stages of a scheduled model: the public (and Slapo 2023) module path.

The stage modules are built by `slapo.runtime.partition` (one owner: the pipeline runtime
uses the same functions); this module names them where users and 2023 code import them from,
so it is an edge module (layer 5, docs/architecture.md): nothing inside the package imports it.
`generate_pipeline_partition` is 2023's name (`slapo.compat.build`).
"""

from __future__ import annotations

from .compat.build import generate_pipeline_partition
from .runtime.partition import build_stage, check_stage_coverage, cuts_of, partition, run_stages
from .runtime.stages_encoder import ENCODER_PREFIXES, MLM_HEADS, BertStage, mlm_head

__all__ = ["ENCODER_PREFIXES", "MLM_HEADS", "BertStage", "build_stage", "check_stage_coverage",
           "cuts_of", "generate_pipeline_partition", "mlm_head", "partition", "run_stages"]
