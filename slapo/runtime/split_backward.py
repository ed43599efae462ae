"""Where the zero-bubble schedules' split backward would train wrong: refused before placing
(`check_split_backward`) or on the first step from the autograd graph (`split_backward_hazards`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from ..errors import SchedulingError
from .batch import tensors_in
from .pipeline_plan import PipelinePlan

SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@functools.cache
def split_backward_is_exact() -> bool:
    """Whether this torch's split backward (`stage_backward_input` then
    `stage_backward_weight`, what the zero-bubble schedules run) gives a weight used at two
    places on one path its true gradient. torch before 2.13 counts such a gradient twice
    (pytorch issue 180952: `x @ w @ w`), silently; asked of torch itself on that very case
    (2 x 2 tensors on CPU, once per process) rather than read from its version."""
    from torch.distributed.pipelining import _backward

    w = torch.tensor([[0.4, -0.2], [0.7, 0.3]])
    x = torch.tensor([[1.1, -0.7]])
    want_w = nn.Parameter(w.clone())
    want_x = x.clone().requires_grad_()
    dx, dw = torch.autograd.grad((want_x @ want_w @ want_w).sum(), [want_x, want_w])
    got_w = nn.Parameter(w.clone())
    got_x = x.clone().requires_grad_()
    out = (got_x @ got_w @ got_w).sum()
    try:
        _, groups = _backward.stage_backward_input([out], None, [got_x], iter([got_w]))
        _backward.stage_backward_weight(iter([got_w]), groups)
    except Exception:  # noqa: BLE001 - an API change: do not trust it
        return False
    return got_w.grad is not None and torch.allclose(got_w.grad, dw) and \
        got_x.grad is not None and torch.allclose(got_x.grad, dx)


def check_split_backward(stages: list[nn.Module], plan: PipelinePlan) -> None:
    """Refuse a zero-bubble schedule where its split backward would be wrong or fail: on a
    torch whose weight pass double-counts a weight used twice on one path
    (`split_backward_is_exact`), and for stages that declare `split_backward = False`.

    torch's split backward groups a stage's weights by where their gradient paths meet the
    paths from the stage's inputs. A weight that no stage input reaches breaks that: T5's
    decoder position bias, made on a later stage from its first block's
    `relative_attention_bias` (positions only). Measured on torch 2.13 with ZBVZeroBubble:
    that weight's gradient off by 62% (relative), silently, when the block is alone in its
    stage; "backward through the graph a second time" when the stage adds the bias in two
    blocks. Every other weight matched one process to 1e-6. Refused here, before anything is
    placed. Any other stage with such a weight (a family's stage code that sends on a tensor
    made from weights alone) is found on the first step instead, from the autograd graph
    (`split_backward_hazards`, `PipelineRunner.stage_forward`), and that step raises on every
    rank before any optimizer step."""
    if plan.name not in SPLIT_BACKWARD:
        return
    if not split_backward_is_exact():
        raise SchedulingError("", f"pipeline={plan.name!r} splits each stage's backward into "
                              f"input and weight passes, and this torch ({torch.__version__}) "
                              "counts the gradient of a weight used twice on one path twice "
                              "there (pytorch issue 180952, fixed in torch 2.13): it would train "
                              "silently wrong.", "use 1F1B, GPipe, Interleaved1F1B or "
                              "LoopedBFS, or torch >= 2.13.")
    bad = [i for i, s in enumerate(stages) if getattr(s, "split_backward", True) is False]
    if bad:
        raise SchedulingError("", f"pipeline={plan.name!r} splits each stage's backward into "
                              f"input and weight passes, which torch cannot do for stage(s) "
                              f"{bad} of {type(stages[0]._root[0]).__name__}: a weight that "
                              "no stage input reaches (T5's decoder position bias) gets a wrong "
                              "gradient or none.", "use 1F1B, GPipe, Interleaved1F1B or "
                              "LoopedBFS.")


def split_backward_hazards(outputs: Any, inputs: Any,
                           weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of `weights` whose gradient torch's split backward would get wrong, read off
    the autograd graph of one stage forward (`outputs` from `inputs`).

    torch's input pass (`stage_backward_input`) keeps, for each weight, the gradient reaching
    the first nodes on its way to the outputs that the stage's inputs also reach; the weight
    pass restarts from those. A path from an output to a weight that meets no node reached from
    the inputs is dropped: a tensor made from weights alone and sent on, as T5's decoder
    position bias is (measured: 62% off, silently). Found here as the weights reachable from an
    output through nodes no input reaches."""
    leaves = [t for t in tensors_in(inputs) if t.requires_grad]
    roots = [t.grad_fn for t in tensors_in(outputs) if t.grad_fn is not None]
    if not leaves or not roots:
        return []
    leaf_ids = {id(t) for t in leaves}
    input_fns = {t.grad_fn for t in leaves if t.grad_fn is not None}

    def is_input(node) -> bool:
        var = getattr(node, "variable", None)
        return node in input_fns or (var is not None and id(var) in leaf_ids)

    order, seen, stack = [], set(), [(r, False) for r in roots]
    while stack:  # post-order: a node after every node it leads to
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((n, False) for n, _ in node.next_functions if n is not None and n not in seen)
    reaches: dict = {}
    for node in order:
        reaches[node] = is_input(node) or any(reaches.get(n, False)
                                              for n, _ in node.next_functions if n is not None)
    cut_off, frontier = set(), [r for r in roots if not reaches[r]]
    while frontier:
        node = frontier.pop()
        if node in cut_off:
            continue
        cut_off.add(node)
        frontier.extend(n for n, _ in node.next_functions if n is not None)
    by_id = {id(w): name for name, w in weights.items()}
    return sorted(by_id[id(v)] for node in cut_off
                  if (v := getattr(node, "variable", None)) is not None and id(v) in by_id)
