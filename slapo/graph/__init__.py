"""Static-graph facilities for "trace by need": tracing one submodule, finding subgraphs,
and moving matched ops into named submodules (fuse, subgraph replace/checkpoint)."""

from .subgraph import Subgraph
from .tracer import (
                     AttentionCall,
                     SlapoTracer,
                     TraceGuardError,
                     capture_inputs,
                     default_leaf,
                     trace_module,
)

__all__ = ["AttentionCall", "SlapoTracer", "Subgraph", "TraceGuardError", "capture_inputs",
           "default_leaf", "trace_module"]
