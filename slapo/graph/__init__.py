"""Static-graph facilities for "trace by need": tracing one submodule, finding subgraphs,
and moving matched ops into named submodules (fuse, subgraph replace/checkpoint)."""

from .export_capture import export_module, is_exported
from .hf_attention import AttentionCall
from .subgraph import Subgraph
from .trace_common import TraceGuardError
from .trace_inputs import capture_inputs
from .tracer import SlapoTracer, default_leaf, trace_module

__all__ = ["AttentionCall", "SlapoTracer", "Subgraph", "TraceGuardError", "capture_inputs",
           "default_leaf", "export_module", "is_exported", "trace_module"]
