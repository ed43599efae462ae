"""`Verify`: prove that a scheduled model computes what the original computed, and when it
does not, say where.

- `core`: the `Verify` context manager (outputs, gradients, one optimizer step; TP shards
  gathered; delayed init; mixed precision), the RNG placement check and the pipeline-stage check;
- `localise`: on a mismatch, the first module whose output (or input gradient) diverged, with
  the primitives applied to it and its ancestors;
- `rng_check`: dropout draws per-rank masks inside sharded regions and shared masks outside;
- `experts`: which experts of an MoE layer diverge, and the expert-parallel layout (E/ep rows
  of each [E, ...] tensor per rank) Verify compares against.

Shape errors inside scheduled modules are named by `slapo.runtime.shape_errors`, which `Verify`
uses while it runs the scheduled model. See docs/verify.md.
"""

from .core import Verify

__all__ = ["Verify"]
