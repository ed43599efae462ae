"""Megatron sequence parallelism (Korthikanti et al. 2022) for the ready schedules.

Plain tensor parallelism leaves every activation *outside* the column/row-parallel regions (norms,
dropout, residual adds) replicated: each rank stores the same [B, S, H] tensors. Sequence
parallelism shards those along the sequence (dim 1), so each rank stores [B, S/tp, H]:

    scatter(S) ─▶ norm ─▶ all_gather(S) ─▶ column ─▶ ... ─▶ row ─▶ reduce_scatter(S) ─▶ + residual
                  (S/tp)   (backward:                          (bias added once,       (S/tp)
                            reduce-scatter)                     after the scatter)

- the family's `TPPlan` applied with `sequence_parallel=True` puts the all-gather on each region's
  input and a reduce-scatter (instead of an all-reduce) on each row-parallel output;
- `split_and_gather` splits the hidden states along the sequence *after* every position-dependent
  part (GPT-2's `wpe`, LLaMA's rotary tables and the causal mask are computed on the full
  sequence before the split point, and every attention module sees gathered q/k/v), and gathers
  the final norm's output for the (vocabulary-parallel) head;
- `replicated_on_shards` sums the gradients of the norms' replicated parameters over the group
  (`reduce_param_grads`: each rank only saw its tokens) and runs the dropouts that act on
  sequence-sharded activations in the per-rank RNG stream (`fork_rng`: ranks hold different
  tokens, so their masks must differ).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..distributed import collectives
from ..distributed import group as _g
from ..errors import SchedulingError
from ..primitives._util import map_first_input
from ..schedule import Schedule
from . import _common
from ._common import SEQ_DIM


@dataclass(frozen=True)
class SequencePlan:
    """Where a family's hidden states leave and re-enter the sequence-sharded layout.

    - `split`: path suffix of the module whose (first) input is split along the sequence;
    - `gather`: path suffix of the module whose output is all-gathered (the final norm);
    - `norms`: paths of replicated-parameter modules on sharded activations;
    - `dropouts`: paths of dropout modules that act on sharded activations;
    - `gather_feeds_head`: the gathered output goes straight into the LM head (GPT-2, LLaMA), so
      a vocabulary-parallel head's partial input gradient can be reduce-scattered by the gather;
      False when replicated modules with parameters sit in between (BERT's MLM transform), which
      need the head's own input-gradient all-reduce to see the full gradient;
    - `validate(sch)`: optional check of the model's variant, run before any mutation (raises
      a `SchedulingError` for a layout the plan does not cover, e.g. OPT's `project_out`).
    """

    split: str
    gather: str
    norms: tuple[str, ...]
    dropouts: tuple[str, ...] = ()
    gather_feeds_head: bool = True
    validate: Callable[[Schedule], None] | None = None

    # `norms`/`dropouts` entries are relative to each layer ("." is the layer itself: its
    # functional dropouts), or, starting with "/", a path suffix of one model-level module
    # (e.g. "/transformer.ln_f").


def check_supported(sch: Schedule, family, pp_stages: int, available: list[str]) -> None:
    """Raise before any mutation when sequence parallelism cannot be applied (`available`: the
    families with a plan)."""
    if family.sequence_plan is None:
        raise SchedulingError(sch.path, f"sequence_parallel is not implemented for the "
                              f"{family.name} family.", "leave sequence_parallel=False (it is "
                              f"available for: {', '.join(available)}).")
    if pp_stages > 1:
        raise SchedulingError(sch.path, "sequence_parallel with pp_stages > 1 is not supported "
                              "(stage boundaries would carry sequence shards).",
                              "use one of sequence_parallel or pipeline stages.")
    if family.sequence_plan.validate is not None:
        family.sequence_plan.validate(sch)


def split_sequence_hook(group) -> Callable:
    """A forward pre-hook keeping this rank's slice of the first input along the sequence
    (backward all-gathers), with a clear error when the length does not divide."""

    def split_sequence(module, args, kwargs):
        def split(x):
            ws = _g.world_size(group)
            if x.shape[SEQ_DIM] % ws:
                raise RuntimeError(f"sequence parallelism needs the sequence length "
                                   f"({x.shape[SEQ_DIM]}) to be divisible by the tensor-parallel "
                                   f"degree ({ws}); pad the batch to a multiple of {ws}.")
            return collectives.scatter(x, SEQ_DIM, group)

        return map_first_input(args, kwargs, split)

    return split_sequence


def _node(sch: Schedule, suffix: str, family: str) -> Schedule:
    return sch[_common.require_path(sch, suffix, family)]


def split_and_gather(sch: Schedule, family, vocab_parallel: bool) -> None:
    """Split the hidden states along the sequence at `plan.split`, gather them after
    `plan.gather`; shard the embedding and head over the vocabulary when asked.

    With a vocabulary-parallel head each rank's gradient of the gathered hidden states is partial
    (it covers its vocabulary slice), so the gather's backward reduce-scatters it and the head
    needs no input-gradient all-reduce of its own; with a replicated head (or replicated modules
    before it, `plan.gather_feeds_head=False`) every rank has the full gradient, and the backward
    keeps this rank's slice."""
    plan = family.sequence_plan
    head_sharded = False
    if vocab_parallel and _common.vocab_parallel(sch, head_input_grad=not plan.gather_feeds_head) \
            and plan.gather_feeds_head:
        get_out = getattr(sch.mod, "get_output_embeddings", None)
        head = get_out() if callable(get_out) else None
        head_sharded = head is not None
    _node(sch, plan.split, family.name).sync(mode="fwd_pre",
                                             sync_op_or_fn=split_sequence_hook(sch.group))
    _node(sch, plan.gather, family.name).sync(mode="fwd_post", sync_op_or_fn="all_gather",
                                              axis=SEQ_DIM,
                                              tensor_parallel_output_grad=head_sharded)


def replicated_on_shards(sch: Schedule, family, layers: list[Schedule]) -> None:
    """Sum the norms' parameter gradients over the group and fork the RNG of the dropouts that
    see sequence shards. Run after `fuse`/`tempo`, which may replace those modules."""
    plan = family.sequence_plan
    for node in _targets(sch, family, layers, plan.norms):
        node.reduce_param_grads()
    for node in _targets(sch, family, layers, plan.dropouts):
        node.fork_rng(draws="dropout")


def _targets(sch: Schedule, family, layers: list[Schedule], paths: tuple[str, ...]):
    """The nodes named by a plan's paths (per layer, or "/suffix" for one model-level module)."""
    out = []
    for rel in paths:
        if rel.startswith("/"):
            out.append(_node(sch, rel[1:], family.name))
        else:
            out += [layer if rel == "." else layer[rel] for layer in layers]
    return out
