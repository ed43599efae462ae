"""Pipeline parallelism through `torch.distributed.pipelining`: stages from the schedule's cuts.

The schedule's cuts (`cut_pipeline_stage`) give `pp * virtual_stages` stage modules. Each pp rank
keeps its own stages (placed round-robin, `[r, r+pp, ...]`, or V-shaped, `[r, 2*pp-1-r]`, for the
zero-bubble V schedules), wraps each in a `PipelineStage` over the mesh's pp group, and drives
them with one of torch's schedules (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV).

The loss is computed on the last stage by the schedule. To hand `loss_fn(outputs, batch)` the
micro-batch that belongs to each output, the schedule's `target` is the tensor of sample indices:
the schedule splits it exactly like the inputs, and the loss looks the samples up.

Gradients are averaged by us, not by torch (`scale_grads=False`): each micro-batch loss is
divided by (micro-batches x accumulation steps), so gradient accumulation over several `step`
calls stays exact (torch's rescaling would also rescale gradients accumulated before the call).

Mixed precision (`Precision`): each stage's forward runs under autocast (`wrap_forward`, applied
to the module the PipelineStage calls, so torch's metadata inference, which calls the same
forward on real tensors of the stage's device, infers the activation dtypes the micro-batches
really have: fp32 for HF decoders, whose residual stream stays fp32 under autocast), the loss
runs under autocast, and the loss handed to the schedule's backward is `loss_for_backward`
(fp32, scaled for fp16).

Errors: what fails on one rank only (preparing the first stage's inputs; a stage's forward; the
loss, e.g. a user `loss_fn` bug or a stage without a loss of its own; a stage's backward, e.g. a
custom autograd Function or a NaN-check hook raising, or out of memory) is recorded, the schedule
runs to its end, and one all-reduced flag makes every rank raise (`raise_on_every_rank`): the
rank of the first failure in pipeline order its own exception, the others a `SchedulingError`
naming that rank, its message and the stage (`(stage 1 backward)`), and no rank takes an
optimizer step. A stage whose forward
raised (or that runs after a failure on its rank) returns zeros shaped like its last good
output, connected to its inputs (`_fallback`), so its peers receive what they wait for and the
schedule ends promptly instead of at the collective timeout. Downstream stages then compute on
zeros and may fail in turn; those are secondary and reported after the first. If a stage fails
on its very first forward there is no good output yet: the zeros take the shape of its first
input, so the shapes torch infers on that first step are wrong and the model must be rebuilt
(`slapo.build`) before another step; after a later failure the pipeline can step again.

A stage whose backward raised (or that runs a backward after a failure on its rank) skips it
and hands torch zero gradients for its inputs (`_zero_input_grads`), which the schedule sends
upstream as it would the real ones, so every rank's schedule ends within the step for every
schedule (GPipe, 1F1B, the interleaved, looped and zero-bubble ones, whose split input/weight
backwards go through the same guarded call, `guard_stage_backward`). Its forwards for the
rest of the step return `_fallback` zeros, as after a forward failure. A backward failure
leaves no stale state (the next step zeroes the gradients and re-infers nothing), so the same
pipeline can step again, on the first step too.

Not so under FSDP2 over more than one data-parallel rank, nor under tensor parallelism: a
stage's replicas all-gather its parameters in every forward and backward, and a TP-sharded
stage's blocks all-reduce with their tp peers, together, and a stage that skipped the rest of
its step would leave them waiting (a backward failing on one tp rank hung the job until the
collective timeout). There a stage's error is raised at once on its rank
(`PipelineRunner._replicas_in_lockstep`) and the job stops: under torchrun the failing process
exits and the launcher stops the others; `slapo train --resume` continues from the newest
checkpoint.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from ..distributed import rng
from ..errors import SchedulingError
from ..module_patch import original_class
from .batch import Batch, batch_size, index_batch, tensors_in
from .mesh import MeshInfo
from .precision import Precision
from .token_mean import Weights
from .train_step import LossFn, compute_loss

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# The runner whose `schedule.step` is running in this thread: stage forwards report to it.
_ACTIVE: contextvars.ContextVar[PipelineRunner | None] = contextvars.ContextVar(
    "slapo_pipeline_runner", default=None)
# Error order inside one step: preparing < stage 0 forward < ... < last stage < the loss <
# last stage backward < ... < stage 0 backward (`backward_order`).
PREPARE_ORDER = -1
# Called with the stage id at the start of every guarded stage backward inside a step (the
# `SLAPO_FAULT` test hook's `pp_backward` point registers here: `register_stage_backward_hook`).
_BACKWARD_HOOKS: list[Callable[[int], None]] = []


# ------------------------------------------------------------------------------------------------
# configuration: which schedule, how many stages, which stages on this rank
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PipelinePlan:
    """The schedule class and the stage layout, identical on every rank."""

    schedule_cls: type
    name: str
    pp: int
    virtual_stages: int
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def multi(self) -> bool:
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        return issubclass(self.schedule_cls, PipelineScheduleMulti)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages rank `pp_rank` runs, in its local order."""
        if self.name in V_SCHEDULES:
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + v * self.pp for v in range(self.virtual_stages)]

    def rank_of(self, stage: int) -> int:
        return next(r for r in range(self.pp) if stage in self.stage_ids(r))


def plan_pipeline(name: str, info: MeshInfo, num_microbatches: int | None,
                  virtual_stages: int | None) -> PipelinePlan:
    """Validate the pipeline arguments against the mesh (same checks, same errors, every rank)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

    try:
        cls = get_schedule_class(name)
    except ValueError as e:
        raise SchedulingError("", f"unknown pipeline schedule {name!r}.",
                              f"{e}".split(". ", 1)[-1]) from None
    canonical = next(k for k in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS",
                                 "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV",
                                 "PipelineScheduleSingle", "PipelineScheduleMulti")
                     if k.lower() == name.lower())
    if info.mesh is None or info.pp < 2:
        raise SchedulingError("", f"pipeline={name!r} needs a mesh with pp >= 2 (got pp="
                              f"{info.pp}).", "create the schedule with "
                              "mesh=slapo.init_mesh(pp=2, ...).")
    multi = issubclass(cls, PipelineScheduleMulti)
    if virtual_stages is None:
        virtual_stages = 2 if multi else 1
    if not multi and virtual_stages != 1:
        raise SchedulingError("", f"{canonical} runs one stage per rank, but virtual_stages="
                              f"{virtual_stages}.", "use virtual_stages=1, or a multi-stage "
                              "schedule such as 'Interleaved1F1B'.")
    if canonical in V_SCHEDULES and virtual_stages != 2:
        raise SchedulingError("", f"{canonical} needs exactly 2 stages per rank (V shape), got "
                              f"virtual_stages={virtual_stages}.", "use virtual_stages=2.")
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise SchedulingError("", f"virtual_stages={virtual_stages!r} must be a positive int.")
    if num_microbatches is None:
        num_microbatches = info.pp * virtual_stages
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise SchedulingError("", f"num_microbatches={num_microbatches!r} must be a positive int.")
    if not multi and num_microbatches < info.pp:
        raise SchedulingError("", f"{canonical} with pp={info.pp} needs at least {info.pp} "
                              f"micro-batches, got {num_microbatches}.",
                              f"pass num_microbatches >= {info.pp}.")
    return PipelinePlan(cls, canonical, info.pp, virtual_stages, num_microbatches)


# schedules that split each stage backward into an input-gradient and a weight-gradient pass
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


def pipeline_cuts(sch) -> list[str]:
    """The ordered stage boundaries recorded by `cut_pipeline_stage`."""
    return list(sch.pipeline_cuts)


def check_cuts(sch, plan: PipelinePlan) -> list[str]:
    cuts = pipeline_cuts(sch)
    if len(cuts) + 1 != plan.num_stages:
        raise SchedulingError(
            sch.path, f"the schedule has {len(cuts)} pipeline cut(s), i.e. {len(cuts) + 1} "
            f"stage(s), but pipeline={plan.name!r} with pp={plan.pp} and virtual_stages="
            f"{plan.virtual_stages} needs {plan.num_stages} stages.",
            f"call cut_pipeline_stage() on exactly {plan.num_stages - 1} module(s) "
            f"(or change pp / virtual_stages).")
    return cuts


# ------------------------------------------------------------------------------------------------
# weights shared by stages on different ranks (e.g. GPT-2's tied embedding and LM head)
# ------------------------------------------------------------------------------------------------

@dataclass
class TiedWeights:
    """Parameters used by stages on several pp ranks; their gradients are summed over pp.

    Weights are named by their owner (module, parameter name), not by the parameter object,
    because delayed init and FSDP2 replace parameter objects but keep the modules."""

    entries: list[tuple[str, tuple[nn.Module, str] | None, torch.Size]] = field(
        default_factory=list)
    holders: dict[tuple[int, str], int] = field(default_factory=dict)  # owner -> pp ranks

    def sync_grads(self, info: MeshInfo) -> None:
        """Every pp rank walks the same list; ranks without the weight add zeros."""
        for _, owner, shape in self.entries:
            p = owner[0]._parameters[owner[1]] if owner is not None else None
            local = _grad_local(p) if p is not None else None
            buf = local if local is not None else torch.zeros(shape, device=_dev(info))
            dist.all_reduce(buf, group=info.group("pp"))
            if p is not None and local is None:
                p.grad = buf


def _grad_local(p: nn.Parameter) -> torch.Tensor | None:
    if p.grad is None:
        return None
    return p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad


def _dev(info: MeshInfo) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if info.device_type == "cuda" \
        else torch.device("cpu")


def find_tied(all_stages: list[nn.Module], plan: PipelinePlan, pp_rank: int) -> TiedWeights:
    """Parameters that appear in stages of more than one pp rank, found by identity before any
    parameter is replaced; every rank computes the same list from the same cheap partition."""
    owners: dict[int, list[tuple[int, str, nn.Module, str]]] = {}
    shapes: dict[int, torch.Size] = {}
    for s, stage in enumerate(all_stages):
        for mpath, mod in stage.named_modules(remove_duplicate=False):
            for pname, p in mod._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((s, f"{mpath}.{pname}", mod, pname))
                    shapes[id(p)] = p.shape
    tied = TiedWeights()
    mine = set(plan.stage_ids(pp_rank))
    for pid, own in owners.items():
        ranks = {plan.rank_of(s) for s, *_ in own}
        if len(ranks) < 2:
            continue
        for _, _, mod, pname in own:
            tied.holders[(id(mod), pname)] = len(ranks)
        local = next(((mod, pname) for s, _, mod, pname in own if s in mine), None)
        name = min(f"stage{s}.{path}" for s, path, *_ in own)
        tied.entries.append((name, local, shapes[pid]))
    tied.entries.sort(key=lambda e: e[0])
    return tied


# ------------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------------

def first_stage_args(stage: nn.Module, batch: Batch) -> tuple:
    """The first stage's positional inputs: the batch's entries in the stage forward's order.

    Positional, because torch's schedules pass keyword arguments to *every* stage on a rank,
    while positional ones go to the first stage only."""
    if not isinstance(batch, dict):
        return tuple(batch)
    if callable(getattr(stage, "first_args", None)):  # a stage that derives its inputs (T5)
        return tuple(stage.first_args(batch))
    names = list(getattr(stage, "input_names", None) or ())
    if not names:
        params = inspect.signature(stage.forward).parameters.values()
        names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    used = [n for n in names if n in batch]
    if not used and "input_ids" in batch and len(names) == 1:
        return (batch["input_ids"],)  # slapo.pipeline's convention: stage 0 takes input_ids
    if not used:
        raise SchedulingError("", f"none of the batch's keys {sorted(batch)} is an input of "
                              f"the first pipeline stage ({', '.join(names)}).",
                              "name the batch entries after the model's forward arguments.")
    last = names.index(used[-1])
    return tuple(batch.get(n) for n in names[:last + 1])


def _contiguous(inputs):
    """`inputs` with every tensor contiguous. torch 2.11's first stage checks its inputs'
    strides against the contiguous ones it expects (`PipeliningShapeError: ... stride
    mismatch`), so a batch sliced from a longer one (`tokens[:, :seq]`, as the tests' and a
    packed-text loader's batches are) failed there; torch 2.13 does not check strides."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.contiguous(), inputs)


def stage_outputs(stage: nn.Module, output: Any) -> Any:
    """What `loss_fn` sees: the last stage's output, wrapped like the model's output if the
    stage knows how (e.g. an HF stage gives an object with `.logits`)."""
    wrap = getattr(stage, "pipeline_outputs", None)
    return wrap(output) if callable(wrap) else output


def stage_default_loss(stage: nn.Module, outputs: Any, batch: Batch) -> torch.Tensor:
    fn = getattr(stage, "default_loss", None)
    if fn is None:
        raise SchedulingError("", "the last pipeline stage cannot compute the model's own loss.",
                              "pass build(..., loss_fn=fn) with fn(outputs, batch) -> scalar.")
    return fn(outputs, batch)


MASK_KEYS = ("attention_mask", "decoder_attention_mask")


def check_batch_inputs(stage: nn.Module, batch: Batch) -> None:
    """Refuse batch entries the model's forward would use but the pipeline stages do not
    take (BERT's stages take `token_type_ids`; no stage takes `position_ids`, `inputs_embeds`
    or `head_mask`): dropped silently, they would train another model than the one a single
    process runs. Entries the forward does not name (a user `loss_fn`'s own) pass. Any stage
    of the rank can answer: `first_inputs` and `mask_inputs` belong to the stage kind."""
    root = getattr(stage, "_root", (None,))[0]
    if root is None or not isinstance(batch, dict):
        return
    params = _forward_params(original_class(root))  # the model's own, not a patch wrapper's
    taken = {*getattr(stage, "first_inputs", ()), *getattr(stage, "mask_inputs", ()),
             "labels"}
    unused = sorted(k for k, v in batch.items() if k in params and k not in taken
                    and isinstance(v, torch.Tensor))
    if unused:
        raise SchedulingError("", f"the batch has {', '.join(unused)}, which "
                              f"{type(root).__name__}'s forward uses but its pipeline stages do "
                              "not take (they would be ignored).",
                              f"drop {', '.join(unused)} from the batch (the stages use the "
                              "model's defaults), or train without pipeline stages.")


@functools.cache
def _forward_params(cls: type) -> frozenset[str]:
    """The argument names of a model class's forward (once per class: this runs every step)."""
    try:
        return frozenset(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def stage_masks(stage: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    """The padding masks every stage takes as keyword arguments (torch's schedules split a
    `step` call's keyword arguments into micro-batches like the inputs and hand them to every
    stage of the rank; each rank passes the same batch's masks): a batch's masks that hide
    some token, by name. A mask of all ones is dropped (the stages then build the model's
    unpadded masks, e.g. SDPA's `is_causal` path). A stage that takes no mask (`mask_inputs`,
    e.g. a ResNet stage) refuses one that hides tokens (every rank sees the same batch, so
    every rank raises)."""
    if not isinstance(batch, dict):
        return {}
    masks = {k: batch[k] for k in MASK_KEYS if isinstance(batch.get(k), torch.Tensor)
             and not bool((batch[k] != 0).all())}
    taken = set(getattr(stage, "mask_inputs", ()))
    refused = sorted(set(masks) - taken)
    if refused:
        key = refused[0]
        raise SchedulingError("", f"the pipeline stages of {type(stage).__name__} take no "
                              f"padding {key}, and this batch's mask hides some tokens.",
                              "pack sequences without padding (or mask padded tokens in the "
                              f"labels with -100 and drop {key}).")
    return masks


def stage_loss_inputs(stage: nn.Module, batch: Batch, loss_fn: LossFn | None
                      ) -> dict[str, torch.Tensor]:
    """The batch entries every stage takes for the model's own loss (`labels` when the fused
    loss is on: `stages_decoder.FusedLossStage`); none with a user `loss_fn`, which gets the
    last stage's logits as before."""
    names = getattr(stage, "loss_inputs", ())
    if loss_fn is not None or not names or not isinstance(batch, dict):
        return {}
    return {k: batch[k] for k in names if isinstance(batch.get(k), torch.Tensor)}


class PipelineRunner:
    """One `schedule.step` per accumulation slice; the loss is the mean over micro-batches."""

    def __init__(self, schedule, plan: PipelinePlan, info: MeshInfo, stage_ids: list[int],
                 stage_modules: list[nn.Module], loss_fn: LossFn | None, tied: TiedWeights,
                 precision: Precision | None = None):
        self.schedule = schedule
        self.plan = plan
        self.info = info
        self.holds_first = 0 in stage_ids
        self.holds_last = plan.num_stages - 1 in stage_ids
        self.modules = list(stage_modules)
        self.first = stage_modules[stage_ids.index(0)] if self.holds_first else None
        self.last = stage_modules[stage_ids.index(plan.num_stages - 1)] \
            if self.holds_last else None
        self.loss_fn = loss_fn
        self.tied = tied
        self.precision = precision or Precision()
        self._batch: Batch | None = None
        self._scale = 1.0
        self._tokens: Weights | None = None
        self._losses: list[torch.Tensor] = []
        self._error: BaseException | None = None
        self._shapes: tuple | None = None  # the last call's batch shapes (`batch_shapes`)
        self._error_order = 0
        self._error_phase: str | None = None  # e.g. "stage 1 backward"
        self._templates: dict[int, Any] = {}  # stage id -> its last good output's structure
        self._by_stage = dict(zip(stage_ids, stage_modules, strict=True))
        self._split_checked: set[int] = set()  # stages whose split backward was checked
        self._zero_backward = False  # evaluating through `step` (`_evaluate_by_step`)

    def schedule_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's `loss_fn(output, target)`: target holds the micro-batch's indices.

        An exception here (a user `loss_fn` bug, no `labels`, a stage without a loss of its
        own) is recorded instead of raised: the schedule then runs to its end on every rank
        (zero gradients flow back), and `forward_backward` raises it on *every* rank. Raised
        here, it would leave only this rank's peers blocked on a receive until they die on a
        closed connection or a collective timeout."""
        if self._error is not None:
            return _zero_loss(output)
        try:
            mb = index_batch(self._batch, index)
            weight = self._scale / self.plan.num_microbatches if self._tokens is None \
                else self._tokens.weight(mb)
            mb = mb if self._tokens is None else self._tokens.guard(mb)
            with self.precision.autocast():
                outputs = stage_outputs(self.last, output)
                if self.loss_fn is None:
                    loss = stage_default_loss(self.last, outputs, mb)
                else:
                    loss = compute_loss(outputs, mb, self.loss_fn)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
            self._fail_in_schedule(e, self.plan.num_stages, "the loss")
            return _zero_loss(output)
        self._losses.append(loss.detach().double() * weight)
        grad_loss = self.precision.loss_for_backward(loss) * weight
        return grad_loss * 0.0 if self._zero_backward else grad_loss

    def _fail(self, error: BaseException, order: int, phase: str | None = None) -> None:
        """Record the first error of this step on this rank (`order`: where in the pipeline;
        `phase`: the same in words, for the message the other ranks raise)."""
        if self._error is None:
            self._error, self._error_order, self._error_phase = error, order, phase

    def _fail_in_schedule(self, error: BaseException, order: int, phase: str) -> None:
        """`_fail` for an error inside the schedule (a stage's forward or backward, the loss):
        from then on this rank's stages skip their work for the step. Under FSDP2 over more
        than one data-parallel rank, or TP, that would leave the peers waiting
        (`_replicas_in_lockstep`), so there the error is raised at once instead."""
        self._fail(error, order, phase)
        if not self._replicas_in_lockstep():
            return
        if hasattr(error, "add_note"):
            why = "With tensor parallelism a failed stage cannot keep its tp peers' " \
                  "collectives in step" if self.info.tp > 1 else "With FSDP2 over more " \
                  "than one data-parallel rank a failed stage cannot keep its replicas' " \
                  "parameter all-gathers and gradient reduce-scatters in step"
            error.add_note(f"slapo: raised in pipeline {phase} on rank {dist.get_rank()}. "
                           f"{why}, so it is raised at once: the job stops "
                           "(the other ranks fail on their next collective when this process "
                           "exits), and resumes from a checkpoint.")
        raise error

    def _replicas_in_lockstep(self) -> bool:
        """Whether this rank's stages run collectives with ranks outside the pipeline group
        inside their forward and backward: FSDP2 over more than one data-parallel rank (every
        forward and backward all-gathers parameters, the step's end reduce-scatters gradients,
        together with the stage's replicas), or tensor parallelism (every sharded block
        all-reduces or gathers with its tp peers, forward and backward).

        A stage that skips the rest of its step after a failure, as the guards do, calls
        fewer of them, and its peers would wait in theirs until the collective timeout (seen:
        dp=2 x pp=2 with FSDP2, and tp=2 x pp=2 with a backward failing on one tp rank, torch
        2.13, gloo: the whole job hung). No stand-in can replay them, so the error is raised
        where it happened: the process exits, and torchrun (or the peers' dead sockets) stops
        the rest. (A failure while preparing the step happens before any stage runs: the
        usual agreement serves it.)"""
        if self.info.tp > 1:
            return True
        if self.info.dp <= 1:
            return False
        from torch.distributed.fsdp import FSDPModule

        return any(isinstance(m, FSDPModule) for s in self.modules for m in s.modules())

    def stage_forward(self, stage_id: int, inner: Callable, args: tuple, kwargs: dict) -> Any:
        """A stage's forward inside `schedule.step`: run it; if it raises (or this rank already
        failed this step), record the error and return `_fallback` zeros instead, so the peers
        waiting on this stage's send are served and the schedule ends on every rank."""
        if self._error is None:
            try:
                out = inner(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
                self._fail_in_schedule(e, stage_id, f"stage {stage_id} forward")
            else:
                self._templates[stage_id] = _template(out)
                self._check_split_backward(stage_id, (args, kwargs), out)
                return out
        out = _fallback(self._templates.get(stage_id), args)
        self._templates.setdefault(stage_id, _template(out))
        return out

    def _check_split_backward(self, stage_id: int, inputs: Any, out: Any) -> None:
        """Once per stage, on a zero-bubble schedule: refuse the step (on every rank, before
        any optimizer step) if torch's split backward would give a weight of this stage a wrong
        gradient (`split_backward_hazards`). The first stage runs a full backward instead."""
        if (self.plan.name not in SPLIT_BACKWARD or stage_id == 0 or
                stage_id in self._split_checked or not torch.is_grad_enabled()):
            return
        if not any(t.requires_grad for t in tensors_in(inputs)):
            return  # not the stage's real input (torch's first-step shape inference)
        self._split_checked.add(stage_id)
        module = self._by_stage[stage_id]
        bad = split_backward_hazards(out, inputs, dict(module.named_parameters()))
        if bad:
            self._fail_in_schedule(SchedulingError(
                "", f"pipeline={self.plan.name!r} splits each stage's backward into input and "
                f"weight passes, and torch's weight pass would give {bad} of stage {stage_id} "
                "a wrong gradient, silently: a tensor made from them without the stage's "
                "inputs is sent on to later stages, and that path meets no input.",
                "use 1F1B, GPipe, Interleaved1F1B or LoopedBFS."), stage_id,
                f"stage {stage_id} forward")

    def stage_backward(self, stage_id: int, inner: Callable[[], Any], kind: str,
                       bwd_kwargs: dict) -> Any:
        """A stage's backward inside `schedule.step` (`kind`: torch's "full", "input" or
        "weight"): run it; if it raises (or this rank already failed this step), record the
        error and return zero input gradients instead, so the stage upstream, waiting on this
        stage's gradient send, is served and the schedule ends on every rank."""
        if self._error is None:
            try:
                for hook in list(_BACKWARD_HOOKS):
                    hook(stage_id)
                return inner()
            except Exception as e:  # noqa: BLE001 - re-raised on every rank after the step
                self._fail_in_schedule(_unwrap_stage_error(e), self.backward_order(stage_id),
                           f"stage {stage_id} backward")
        return _zero_input_grads(kind, bwd_kwargs)

    def backward_order(self, stage_id: int) -> int:
        """Backward runs after the loss, from the last stage to the first."""
        return 2 * self.plan.num_stages - stage_id

    def forward_backward(self, batch: Batch, scale: float, sync_grads: bool,
                         tokens: Weights | None = None) -> torch.Tensor:
        """The slice's loss, each micro-batch's weighted by `scale / num_microbatches` or by its
        share of the step's supervised tokens (`tokens`); returns their sum."""
        return self._run(batch, scale, tokens, self.schedule.step,
                         "running the stages and the loss", return_outputs=False)

    def evaluate(self, batch: Batch, tokens: Weights | None = None) -> torch.Tensor:
        """Forward only (the schedule's `eval`), every stage in eval mode: the mean loss over
        the micro-batches on the last stage's rank (zero elsewhere: `reduce_loss` sums over
        the pp group)."""
        if not hasattr(self.schedule, "eval"):
            raise SchedulingError("", "this torch's pipeline schedules have no forward-only "
                                  "eval().", "upgrade torch, or evaluate without a pipeline.")
        modes = [(m, m.training) for m in self.modules]
        for m, _ in modes:
            m.eval()
        try:
            if self.plan.name in V_SCHEDULES:
                return self._evaluate_by_step(batch, tokens)
            return self._run(batch, 1.0, tokens, self.schedule.eval, "evaluating")
        finally:
            for m, training in modes:
                m.train(training)

    def _evaluate_by_step(self, batch: Batch, tokens: Weights | None) -> torch.Tensor:
        """`evaluate` for the V-shaped schedules, whose forward-only `eval()` fails in torch
        (2.13: a stage without backward is asked for its input gradient, after a peer's
        receive timed out; `slapo train` then died at its first val loss): the training
        schedule's `step` instead, the loss's backward weighted by zero and every gradient
        restored afterwards. Same losses, about 3x an eval's compute (a few batches per
        evaluation), no optimizer step, no change to any `.grad`."""
        params = [p for m in self.modules for p in m.parameters()]
        saved = [p.grad for p in params]
        self._zero_backward = True
        try:
            with torch.enable_grad():
                return self._run(batch, 1.0, tokens, self.schedule.step, "evaluating",
                                 return_outputs=False)
        finally:
            self._zero_backward = False
            for p, g in zip(params, saved, strict=True):
                p.grad = g

    def _run(self, batch: Batch, scale: float, tokens: Weights | None, run: Callable,
             where: str, **run_kwargs: Any) -> torch.Tensor:
        self._batch, self._scale, self._tokens, self._losses = batch, scale, tokens, []
        self._error, self._error_phase = None, None
        args, target, masks = (), None, {}
        try:  # what can fail before the step fails on its rank only: agree first
            masks = _contiguous({**stage_masks(self.modules[0], batch),
                                 **stage_loss_inputs(self.modules[0], batch, self.loss_fn)})
            check_batch_inputs(self.modules[0], batch)
            args = _contiguous(first_stage_args(self.first, batch)) if self.holds_first else ()
            target = torch.arange(batch_size(batch)) if self.holds_last else None
        except Exception as e:  # noqa: BLE001
            self._fail(e, PREPARE_ORDER)
        raise_on_every_rank(self._error, self.info, "preparing the pipeline step")
        shapes = batch_shapes(batch)
        if self._shapes is not None and shapes != self._shapes:
            forget_inferred_shapes(self.schedule)
        self._shapes = shapes
        token = _ACTIVE.set(self)
        try:
            run(*args, target=target, **run_kwargs, **masks)
        finally:
            _ACTIVE.reset(token)
        self._batch = None
        raise_on_every_rank(self._error, self.info, where, order=self._error_order,
                            phase=self._error_phase)
        if not self.holds_last:
            return torch.zeros(())
        # torch's first step also calls the loss once on uninitialised tensors to infer
        # gradient shapes; the real micro-batches are the last `num_microbatches` calls
        real = self._losses[-self.plan.num_microbatches:]
        return torch.stack(real).sum().cpu()

    def finish_grads(self) -> None:
        self.tied.sync_grads(self.info)


def _zero_loss(output: Any) -> torch.Tensor:
    """A zero loss connected to the stage's output, so the schedule's backward still runs (and
    sends zero gradients upstream) after a failed loss."""
    tensors = [t for t in (output if isinstance(output, (tuple, list)) else (output,))
               if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    if not tensors:
        return torch.zeros((), requires_grad=True)
    return sum(t.sum() for t in tensors) * 0.0


def _error_group(info: MeshInfo):
    """Every rank that runs this train_step: the whole job when the mesh spans it (a failure
    on one data-parallel replica must stop the others before their gradient all-reduce),
    else the pipeline group."""
    if info.mesh is not None and info.mesh.size() == dist.get_world_size():
        return dist.group.WORLD
    return info.group("pp")


def raise_on_every_rank(error: BaseException | None, info: MeshInfo, where: str,
                        order: int = 0, phase: str | None = None) -> None:
    """One all-reduced flag: if any rank failed, every rank raises. The first failure in
    pipeline order (`order`, then rank) is the cause: its rank raises its own exception (with
    a note naming the `phase`, e.g. "stage 1 backward"), every other rank a `SchedulingError`
    naming that rank, its message and the phase (then any later failures, e.g. a downstream
    stage that choked on the zeros it was sent)."""
    group = _error_group(info)
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=_dev(info))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if int(flag.item()) == 0:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}" + \
        (f" ({phase})" if phase else "")
    msgs: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(msgs, (order, dist.get_rank(), mine), group=group)
    failed = sorted((o, r, m) for o, r, m in msgs if m is not None)
    first_rank = failed[0][1]
    if error is not None and first_rank == dist.get_rank():
        if phase and hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(f"slapo: raised in pipeline {phase} on rank {first_rank}; every "
                           "rank stopped this step (no optimizer step was taken).")
        raise error
    detail = "; ".join(f"rank {r}: {m}" for _, r, m in failed)
    raise SchedulingError("", f"the pipeline train_step failed on rank {first_rank} while "
                          f"{where}: {detail}", "fix the error reported by that rank; every "
                          "rank stopped this step (no optimizer step was taken).")


def batch_shapes(batch: Batch) -> tuple:
    """The shape and dtype of every tensor in `batch`, in order: what a stage's inferred send
    and receive buffers depend on (every rank of the pipeline is handed the same batch)."""
    return tuple((tuple(t.shape), t.dtype) for t in pytree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))


def forget_inferred_shapes(schedule) -> None:
    """Make the next step infer its stages' shapes again. torch infers a stage's micro-batch
    shapes at the first step and keeps them (2.13 re-infers only on a train/eval switch): a
    later training step with another sequence length or batch size failed ("Expected input
    batch_size (32) to match target batch_size (16)"; torch 2.11's first stage: "shape
    mismatch: expected [2, 16] actual [4, 16]"), and on torch 2.11 `eval_step` on the whole
    batch after training in `grad_accum` slices too, so `slapo train --pp-stages 2 --grad-accum
    2` died at its first val loss on the GPU image's torch. Every rank of the pipeline sees
    the same batch shapes, so every rank clears at the same step: the flags torch sets after
    inferring, and torch < 2.13's stage metadata (which it never overwrites)."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])
    for st in stages:
        if hasattr(st, "_shape_inference"):  # torch < 2.13
            st.inputs_meta = None
            st._outputs_meta = None
    for flag in ("_stage_forward_initialized", "_stage_backward_initialized",
                 "_stages_forward_initialized", "_stages_backward_initialized"):
        if hasattr(schedule, flag):
            setattr(schedule, flag, False)


def make_stages(modules: list[nn.Module], stage_ids: list[int], plan: PipelinePlan,
                info: MeshInfo, device: torch.device) -> list:
    """torch `PipelineStage`s over this rank's stage modules, each forward and backward guarded
    (`guard_stage_forward`, `guard_stage_backward`) so that an exception in either reaches
    every rank promptly."""
    from torch.distributed.pipelining import PipelineStage

    for m, s in zip(modules, stage_ids, strict=True):
        guard_stage_forward(m, s)
    stages = [PipelineStage(m, s, plan.num_stages, device, group=info.group("pp"))
              for m, s in zip(modules, stage_ids, strict=True)]
    for stage, s in zip(stages, stage_ids, strict=True):
        keep_state_through_shape_inference(stage)
        guard_stage_backward(stage, s)
    return stages


def keep_state_through_shape_inference(stage) -> None:
    """torch infers a stage's output shapes on the first step by running its forward once
    (later stages on uninitialised inputs), in training mode: BatchNorm's running statistics
    would take that garbage in (seen: 7e32 after one step). Restore every buffer after it,
    and every random stream: torch 2.11's inference runs the forward on real zeros, so its
    dropouts drew numbers the next step's masks then missed, and a run resumed from a
    checkpoint (which infers again at its first step) trained on other masks than the
    uninterrupted run (tests/test_train_families.py, on torch 2.11).
    The method is `_forward_metadata_inference` in torch 2.13, `_shape_inference` earlier."""
    for name in ("_forward_metadata_inference", "_shape_inference"):
        inner = getattr(stage, name, None)
        if inner is None:
            continue

        @functools.wraps(inner)
        def run(*args, _inner=inner, **kwargs):
            saved = [(b, b.detach().clone()) for b in stage.submod.buffers()]
            try:
                with rng.states_kept():
                    return _inner(*args, **kwargs)
            finally:
                for b, value in saved:  # via .data: the inference's own backward pass (shapes
                    b.data.copy_(value)  # only) must not see a version bump of saved inputs

        setattr(stage, name, run)


def guard_stage_forward(module: nn.Module, stage_id: int) -> None:
    """Route `module.forward` through the running `PipelineRunner.stage_forward` (outside a
    pipeline step, e.g. a user's own eval call, it runs unguarded), and mark the module with
    `slapo_pipeline_stage = stage_id` (the `SLAPO_FAULT` test hook's `pp` point looks for it)."""
    if getattr(module, "slapo_pipeline_stage", None) is not None:
        return
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        runner = _ACTIVE.get()
        if runner is None:
            return inner(*args, **kwargs)
        return runner.stage_forward(stage_id, inner, args, kwargs)

    module.forward = forward
    module.slapo_pipeline_stage = stage_id


def guard_stage_backward(stage, stage_id: int) -> None:
    """Route the `PipelineStage`'s backward through the running
    `PipelineRunner.stage_backward` (outside a pipeline step it runs unguarded).

    The hook point is `backward_maybe_with_nosync(backward_type, bwd_kwargs, ...)`: the one
    method every torch schedule's backward goes through (full backward, and the input and
    weight halves of the zero-bubble schedules); tested on torch 2.13. (Under FSDP2 over more
    than one data-parallel rank the error is raised at once instead: see
    `PipelineRunner._fail_in_schedule`.) A torch without the method keeps the unguarded
    backward (then a backward error reaches the other ranks only at the collective timeout,
    as before). torch 2.13's first step also runs each stage's backward
    once on real tensors to infer the gradient shapes (`_compute_input_grads`): guarded too
    (`guard_metadata_backward`)."""
    guard_metadata_backward(stage, stage_id)
    inner = getattr(stage, "backward_maybe_with_nosync", None)
    if inner is None or getattr(stage, "slapo_backward_guarded", False):
        return

    @functools.wraps(inner)
    def backward(backward_type, bwd_kwargs, *args, **kwargs):
        runner = _ACTIVE.get()
        call = functools.partial(inner, backward_type, bwd_kwargs, *args, **kwargs)
        if runner is None:
            return call()
        return runner.stage_backward(stage_id, call, backward_type, bwd_kwargs)

    stage.backward_maybe_with_nosync = backward
    stage.slapo_backward_guarded = True


def guard_metadata_backward(stage, stage_id: int) -> None:
    """torch 2.13 infers a stage's input-gradient shapes on the first step by a real backward
    (`_compute_input_grads(outputs, inputs, grad_outputs)`, which returns one gradient or None
    per input). If it raises, record the error and return Nones: torch then derives each
    gradient's shape from its input's (as it does for any input without a gradient) and still
    sends the shapes upstream, so the stage before it does not wait for them."""
    inner = getattr(stage, "_compute_input_grads", None)
    if inner is None:
        return

    @functools.wraps(inner)
    def compute(outputs, all_fwd_inputs, *args, **kwargs):
        runner = _ACTIVE.get()
        call = functools.partial(inner, outputs, all_fwd_inputs, *args, **kwargs)
        if runner is None:
            return call()
        return runner.stage_backward(stage_id, call, "metadata", {"inputs": all_fwd_inputs})

    stage._compute_input_grads = compute


def register_stage_backward_hook(hook: Callable[[int], None]) -> Callable[[], None]:
    """Call `hook(stage_id)` at the start of every guarded stage backward inside a pipeline
    step; what it raises is handled like an error of that backward. Returns a function that
    removes the hook. (The `SLAPO_FAULT` test hook's `pp_backward` point uses it.)"""
    _BACKWARD_HOOKS.append(hook)

    def remove() -> None:
        if hook in _BACKWARD_HOOKS:
            _BACKWARD_HOOKS.remove(hook)

    return remove


def _unwrap_stage_error(error: BaseException) -> BaseException:
    """torch wraps an exception in a stage's full backward in a `RuntimeError("Failed to run
    stage backward: ...")` that lists the stage's tensors; the user's own exception (e.g. the
    ValueError their autograd Function raised) is its cause, and is what every rank reports."""
    while isinstance(error, RuntimeError) and error.__cause__ is not None and \
            "Failed to run stage backward" in str(error):
        error = error.__cause__
    return error


def _zero_input_grads(kind: str, bwd_kwargs: dict) -> tuple:
    """What `backward_maybe_with_nosync` returns, as if every input gradient were zero:
    (input grads, param groups) for "full" and "input"; nothing for "weight" (whose result
    torch ignores); for "metadata" (`guard_metadata_backward`), None per input. Zeros (dense, contiguous: gloo sends only those) for each input tensor that
    requires grad, None for the others, as torch's own `stage_backward` gives."""
    if kind == "weight":
        return (), None
    if kind == "metadata":  # `_compute_input_grads`: None per input, shapes derived by torch
        return tuple(None for _ in bwd_kwargs["inputs"])
    grads = tuple(torch.zeros_like(v, memory_format=torch.contiguous_format)
                  if isinstance(v, torch.Tensor) and v.requires_grad else None
                  for v in bwd_kwargs.get("input_values", ()))
    return grads, None


# ------------------------------------------------------------------------------------------------
# a failed stage's stand-in output
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Slot:
    """Shape and dtype of one output tensor (enough to send a stand-in)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _template(out: Any) -> Any:
    """The structure of a stage output: tensors as `_Slot`s, tuples/lists kept, others as is."""
    if isinstance(out, torch.Tensor):
        return _Slot(tuple(out.shape), out.dtype)
    if isinstance(out, (tuple, list)):
        return type(out)(_template(o) for o in out)
    return out


def _fallback(template: Any, args: tuple) -> Any:
    """Zeros with the template's structure (or, with none yet, shaped like the first tensor
    input, in the default float dtype), on the inputs' device, requiring grad when grad is on
    and connected to every float input that requires grad, so the backward runs and sends zero
    gradients upstream."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    if template is None:
        shape = tuple(tensors[0].shape) if tensors else ()
        template = _Slot(shape, torch.get_default_dtype())
    grad = torch.is_grad_enabled()
    links = [a for a in tensors if a.is_floating_point() and a.requires_grad and grad]
    zero = torch.zeros((), device=device, requires_grad=grad and not links)
    # where(False, x, 0) is 0 even when x holds inf or NaN; `mul(0)` makes the gradient sent
    # upstream a dense (contiguous) zero tensor, as gloo's send requires
    anchor = torch.where(torch.zeros((), dtype=torch.bool, device=device),
                         sum(a.mul(0.0).sum() for a in links), zero) if links else zero
    return _zeros_like(template, device, anchor if grad else None)


def _zeros_like(template: Any, device: torch.device, anchor: torch.Tensor | None) -> Any:
    if isinstance(template, _Slot):
        z = torch.zeros(template.shape, dtype=template.dtype, device=device)
        if anchor is not None and template.dtype.is_floating_point:
            z = z + anchor.to(template.dtype)
        return z
    if isinstance(template, (tuple, list)):
        return type(template)(_zeros_like(t, device, anchor) for t in template)
    return template


def make_schedule(stages: list, plan: PipelinePlan, loss: Callable):
    """The torch schedule over this rank's stages; gradient scaling is left to our loss."""
    arg = stages if plan.multi else stages[0]
    try:
        return plan.schedule_cls(arg, n_microbatches=plan.num_microbatches, loss_fn=loss,
                                 scale_grads=False)
    except ValueError as e:
        raise SchedulingError("", f"pipeline={plan.name!r} rejected num_microbatches="
                              f"{plan.num_microbatches} with pp={plan.pp}: {e}",
                              "choose a number of micro-batches the schedule accepts "
                              "(e.g. a multiple of pp).") from None
