"""Slapo: a schedule language for progressive optimization of deep-learning model training."""

from .errors import SchedulingError, SlapoError, TraceError, VerificationError

__version__ = "0.1.0"

__all__ = ["SchedulingError", "SlapoError", "TraceError", "VerificationError", "__version__"]
