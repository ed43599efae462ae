"""Memory measurement for schedules: what a step holds, per category and per module.

* `memory_breakdown(model, inputs, loss_fn, optimizer)`: weights, gradients, optimizer state and
  saved activations of one training step, total and per module (table / JSON / PNG).
* `saved_bytes(fn, *args)`: bytes one call leaves saved for backward (for tests).
* `LiveTensorBytes`: a dispatch mode counting live tensor bytes and their peak (works on CPU).
"""

from .breakdown import MemoryBreakdown, default_loss, memory_breakdown
from .live import LiveTensorBytes
from .saved import SavedTensorRecorder, saved_bytes, storage_key, storage_keys

__all__ = [
    "LiveTensorBytes",
    "MemoryBreakdown",
    "SavedTensorRecorder",
    "default_loss",
    "memory_breakdown",
    "saved_bytes",
    "storage_key",
    "storage_keys",
]
