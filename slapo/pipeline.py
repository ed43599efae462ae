"""Pipeline stages of a scheduled model: the public (and Slapo 2023) module path.

The stage modules are built by `slapo.runtime.partition` (one owner: the pipeline runtime
uses the same functions); this module names them where users and 2023 code import them from,
so it is an edge module (layer 5, docs/architecture.md): nothing inside the package imports it.
`generate_pipeline_partition` is 2023's name (`slapo.compat.build`); for a traced model of no
family `partition` knows it cuts the graph, as 2023 did (`slapo.compat.pipeline.graph_stages`).
`analyze_tie_weights(model, is_pipeline_partitioned)` is 2023's report of shared parameters
(`slapo.compat.pipeline`).
"""

from __future__ import annotations

# 2023's `import slapo` loaded `slapo.framework_dialect` (its pipeline and build imported it), so
# 2023 code reaches `slapo.framework_dialect.deepspeed...` after `import slapo` alone.
from . import framework_dialect  # noqa: F401
from .compat.build import generate_pipeline_partition
from .compat.pipeline import analyze_tie_weights
from .runtime.partition import build_stage, check_stage_coverage, cuts_of, partition, run_stages
from .runtime.stages_encoder import ENCODER_PREFIXES, MLM_HEADS, BertStage, mlm_head

__all__ = ["ENCODER_PREFIXES", "MLM_HEADS", "BertStage", "analyze_tie_weights", "build_stage",
           "check_stage_coverage", "cuts_of", "generate_pipeline_partition", "mlm_head",
           "partition", "run_stages"]
