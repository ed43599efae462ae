"""2023's module path `slapo.op.cross_entropy`: `ParallelCrossEntropy(group)`, the
vocabulary-parallel cross-entropy (`slapo.op.compat2023`; new code calls
`slapo.op.vocab_parallel_cross_entropy`)."""

from .compat2023 import ParallelCrossEntropy

__all__ = ["ParallelCrossEntropy"]
