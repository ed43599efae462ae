"""Memory measurement for schedules: what a step holds, per category and per module.

* `memory_breakdown(model, inputs, loss_fn, optimizer)`: weights, gradients, optimizer state and
  saved activations of one training step, total and per module (table / JSON / PNG).
* `saved_bytes(fn, *args)`: bytes one call leaves saved for backward (for tests).
* `LiveTensorBytes`: a dispatch mode counting live tensor bytes and their peak (works on CPU).
* `memory_timeline(model, inputs, ...)`: torch.profiler's categorised timeline (CPU and CUDA).
* `meter`: the peak-memory meter of a run (`reset_peak`, `peak_bytes`), the one every app reports.
"""

from .breakdown import MemoryBreakdown, default_loss, memory_breakdown
from .live import LiveTensorBytes
from .saved import SavedTensorRecorder, saved_bytes, storage_key, storage_keys
from .timeline import memory_timeline

__all__ = [
    "LiveTensorBytes",
    "MemoryBreakdown",
    "SavedTensorRecorder",
    "default_loss",
    "memory_breakdown",
    "memory_timeline",
    "saved_bytes",
    "storage_key",
    "storage_keys",
]
