"""How sharding a parameter changes a module: layouts, attribute coherence, kernels, gathering.

We keep *local shards with explicit autograd collectives* (Megatron style) rather than DTensor
parameters: no per-op dispatch cost, and HF modules that reshape with `-1` keep working. Every
sharded tensor carries a `ShardSpec` (original shape, axis, blocks, group), so it can be gathered
(`gather_full`), consolidated into the original state dict, or viewed as a DTensor later.

A module type has a `ShardRule` that knows, for its parameter layout:
- the *output layout* after sharding a parameter along an axis: ("partition", dim) when each rank
  computes a slice of the output, ("partial", None) when each rank computes a partial sum;
- how to keep attributes such as `out_features` coherent;
- whether a kernel is needed (a vocab-parallel embedding must mask foreign token ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import module_patch
from .distributed import collectives

PARTITION = "partition"
PARTIAL = "partial"


@dataclass(frozen=True)
class ShardSpec:
    """What `shard` did to one tensor; stored on it as `tensor._slapo_shard`."""

    orig_shape: tuple[int, ...]
    axis: int
    world_size: int
    rank: int
    blocks: int = 1
    group: object = field(default=None, compare=False, repr=False)

    def __deepcopy__(self, memo):
        return self


def shard_spec(t: torch.Tensor) -> ShardSpec | None:
    return getattr(t, "_slapo_shard", None)


# an expert-parallel parameter's `op.moe.ExpertShard` (which experts it holds), kept here with
# the other per-tensor records so every copy of a parameter keeps it
EXPERT_SHARD_ATTR = "_slapo_expert_shard"
_TENSOR_ATTRS = ("_slapo_shard", "_slapo_tags", "_slapo_init", EXPERT_SHARD_ATTR)


def deepcopy_model(model: nn.Module) -> nn.Module:
    """`copy.deepcopy` that keeps Slapo's per-tensor records (shard specs, annotations).

    torch's `Parameter.__deepcopy__` drops attributes set on the parameter object, so a plain
    deepcopy of a sharded model would forget which tensors are shards."""
    import copy

    new = copy.deepcopy(model)
    pairs = zip([*model.named_parameters(remove_duplicate=False),
                 *model.named_buffers(remove_duplicate=False)],
                [*new.named_parameters(remove_duplicate=False),
                 *new.named_buffers(remove_duplicate=False)])
    for (_, src), (_, dst) in pairs:
        copy_records(src, dst)
    return new


def copy_records(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Give `dst` the per-tensor records of `src` (shard spec, annotations) it lacks.

    For every place torch replaces a parameter object: `copy.deepcopy`, and FSDP2's
    `fully_shard` (whose DTensor parameters are TP shards too, which checkpoints and
    consolidation must know)."""
    for attr in _TENSOR_ATTRS:
        if hasattr(src, attr) and not hasattr(dst, attr):
            setattr(dst, attr, getattr(src, attr))
    for key, value in (getattr(src, "_slapo_tags", None) or {}).items():
        setattr(dst, key, value)


def local_slice(t: torch.Tensor, axis: int, world_size: int, rank: int, blocks: int = 1):
    """This rank's slice: with `blocks` > 1 the axis holds `blocks` equal parts (e.g. fused q|k|v),
    each sharded separately, and the local pieces are concatenated in block order."""
    if blocks == 1:
        return t.chunk(world_size, dim=axis)[rank]
    pieces = [b.chunk(world_size, dim=axis)[rank] for b in t.chunk(blocks, dim=axis)]
    return torch.cat(pieces, dim=axis)


def assemble(pieces: list[torch.Tensor], axis: int, blocks: int = 1) -> torch.Tensor:
    """Inverse of `local_slice` given every rank's piece in rank order."""
    if blocks == 1:
        return torch.cat(pieces, dim=axis)
    split = [p.chunk(blocks, dim=axis) for p in pieces]
    return torch.cat([split[r][b] for b in range(blocks) for r in range(len(pieces))], dim=axis)


def gather_full(t: torch.Tensor, spec: ShardSpec | None = None) -> torch.Tensor:
    """The full (unsharded) value of a possibly sharded tensor; a collective on its group.

    `spec` defaults to the tensor's own; pass a parameter's spec to gather its gradient."""
    spec = spec if spec is not None else shard_spec(t)
    if spec is None or spec.world_size == 1:
        return t.detach()
    import torch.distributed as dist

    pieces = [torch.empty_like(t) for _ in range(spec.world_size)]
    dist.all_gather(pieces, t.detach().contiguous(), group=spec.group)
    return assemble(pieces, spec.axis, spec.blocks)


# ---------------------------------------------------------------------------------------------
# Kernels installed by shard/sync/decompose
# ---------------------------------------------------------------------------------------------


def local_gemm(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The bias-free GEMM of a Linear (`x W^T`) or HF Conv1D (`x W`) on the weight this rank
    holds: the one place the kernels below (and LoRA's row kernel) multiply by a weight.

    A module may carry its own GEMM in `module_meta(mod)["gemm"]`, a callable `(mod, x)`: FP8
    training puts torchao's float8 matmul there (`runtime/fp8.py`). Why a seam and not a module
    swap: a kernel installed by `sync` (the row-parallel reduce before the bias) replaces the
    module's forward, so a swapped-in FP8 module class would be bypassed on exactly the sharded
    layers, and a new module object would lose the hooks, kernel and schedule node of the old."""
    gemm = module_patch.module_meta(mod).get("gemm")
    if gemm is not None:
        return gemm(mod, x)
    return torch.matmul(x, mod.weight) if _is_hf_conv1d(mod) else F.linear(x, mod.weight)


class _BiasAfterReduceKernel(module_patch.Kernel):
    """Shared tail of the Linear/Conv1D kernels: optional collective on the bias-free partial
    output, then the bias, added once.

    - `reduce=True`: all-reduce (row parallel, output replicated);
    - `scatter_dim=d`: reduce-scatter along `d` (row parallel under sequence parallelism, output
      sharded along the sequence). Each rank then adds the replicated bias to its own tokens only,
      so the bias gradient it computes is partial: the bias is fed through `reduce_backward`
      (identity forward, all-reduce backward) so its gradient is summed over the group. Adding the
      bias *before* the reduce-scatter would add it world-size times.
    """

    def __init__(self, reduce_group=None, reduce: bool = False, scatter_dim: int | None = None):
        if reduce and scatter_dim is not None:
            raise ValueError("a kernel either all-reduces or reduce-scatters, not both")
        self.reduce, self.group, self.scatter_dim = reduce, reduce_group, scatter_dim

    @property
    def reduces_bias_grad(self) -> bool:
        """Whether this kernel sums the bias gradient over the group (see the class doc)."""
        return self.scatter_dim is not None

    def _finish(self, mod: nn.Module, y: torch.Tensor) -> torch.Tensor:
        if self.reduce:
            y = collectives.reduce_forward(y, self.group)
        elif self.scatter_dim is not None:
            y = collectives.reduce_scatter(y, self.scatter_dim, self.group)
        if mod.bias is not None:
            bias = collectives.reduce_backward(mod.bias, self.group) if self.reduces_bias_grad \
                else mod.bias
            y = y + bias
        # A Linear subclass whose forward goes on after the bias (an activation or dropout:
        # slapo.op.compat2023's LinearWithAct/LinearWithDropout) says so with `post_bias`;
        # this kernel replaces its forward, so it must run that tail too.
        post = getattr(mod, "post_bias", None)
        return post(y) if post is not None else y


class LinearKernel(_BiasAfterReduceKernel):
    """y = x W^T, [all-reduce | reduce-scatter], + b — the bias is added once, after any
    reduction."""

    name = "linear"

    def __call__(self, mod, x):
        return self._finish(mod, local_gemm(mod, x))


class Conv1DKernel(_BiasAfterReduceKernel):
    """HF Conv1D (weight laid out (in, out)) with the bias added after any reduction."""

    name = "conv1d"

    def __call__(self, mod, x):
        return self._finish(mod, local_gemm(mod, x))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient multiplied by `scale` (broadcast) in backward."""

    @staticmethod
    def forward(ctx, y, scale):
        ctx.save_for_backward(scale)
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.saved_tensors[0], None


def scale_grad_by_id_freq(y: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`nn.Embedding(scale_grad_by_freq=True)` for a vocabulary shard: each lookup's gradient
    divided by how often its *global* id occurs in `ids` (what the unsharded embedding
    counts). Why not the flag itself: the shard's local indices send every foreign id to row
    0, so torch would count those towards row 0. Every rank of the group sees the same ids,
    so these counts are the global ones without a collective."""
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    return _ScaleGrad.apply(y, (1.0 / counts.to(y.dtype))[inverse].unsqueeze(-1))


class VocabParallelEmbeddingKernel(module_patch.Kernel):
    """Embedding whose rows (vocabulary) are sharded: foreign ids give zero rows, then an
    (optional) all-reduce sums the partial lookups into the full embedding. The module's
    `scale_grad_by_freq` counts global ids (`scale_grad_by_id_freq`)."""

    name = "vocab_parallel_embedding"

    def __init__(self, start: int, group=None, reduce: bool = False):
        self.start, self.group, self.reduce = start, group, reduce

    def __call__(self, mod, ids):
        n = mod.weight.shape[0]
        foreign = (ids < self.start) | (ids >= self.start + n)
        local = (ids - self.start).masked_fill(foreign, 0)
        pad = mod.padding_idx
        pad = pad - self.start if pad is not None and self.start <= pad < self.start + n else None
        y = F.embedding(local, mod.weight, pad)
        if mod.scale_grad_by_freq:
            y = scale_grad_by_id_freq(y, ids)
        y = y.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.reduce:
            y = collectives.reduce_forward(y, self.group)
        return y


# ---------------------------------------------------------------------------------------------
# Per-type rules
# ---------------------------------------------------------------------------------------------


class ShardRule:
    """Default: no attribute updates, output layout unknown."""

    def output_layout(self, mod: nn.Module, name: str, axis: int):
        return None

    def validate(self, mod: nn.Module, name: str, axis: int) -> str | None:
        """Return a problem description if this shard cannot work on this module type."""
        return None

    def postproc(self, mod: nn.Module, name: str, axis: int, spec: ShardSpec) -> None:
        pass

    def reduce_kernel(self, mod: nn.Module, group, op: str = "all_reduce",
                      axis: int | None = None):
        """Kernel that reduces a partial-sum output *before* the bias is added (None: a hook
        after the module is correct). `op` is "all_reduce" or "reduce_scatter" (along `axis`,
        sequence parallelism)."""
        return None


class LinearRule(ShardRule):
    def output_layout(self, mod, name, axis):
        if name != "weight":
            return None
        return (PARTITION, -1) if axis == 0 else (PARTIAL, None)

    def postproc(self, mod, name, axis, spec):
        if name == "weight":
            mod.out_features, mod.in_features = mod.weight.shape

    def reduce_kernel(self, mod, group, op="all_reduce", axis=None):
        return _bias_after_reduce(LinearKernel, mod, group, op, axis)


class Conv1DRule(ShardRule):
    """HF GPT-2 Conv1D: weight (in, out), so axis 1 is column parallel and axis 0 row parallel."""

    def output_layout(self, mod, name, axis):
        if name != "weight":
            return None
        return (PARTITION, -1) if axis == 1 else (PARTIAL, None)

    def postproc(self, mod, name, axis, spec):
        if name == "weight":
            mod.nx, mod.nf = mod.weight.shape

    def reduce_kernel(self, mod, group, op="all_reduce", axis=None):
        return _bias_after_reduce(Conv1DKernel, mod, group, op, axis)


def _bias_after_reduce(kernel_cls: type, mod: nn.Module, group, op: str, axis: int | None):
    """A bias-after-reduction kernel for a row-parallel layer; None without a bias (a hook after
    the module is then exact)."""
    if mod.bias is None:
        return None
    if op == "reduce_scatter":
        return kernel_cls(group, scatter_dim=axis)
    return kernel_cls(group, reduce=True)


class EmbeddingRule(ShardRule):
    def output_layout(self, mod, name, axis):
        return (PARTIAL, None) if axis == 0 else (PARTITION, -1)

    def validate(self, mod, name, axis):
        if axis == 0 and mod.max_norm is not None:
            return "a vocabulary-sharded embedding cannot use max_norm (it renormalises rows)."
        return None

    def postproc(self, mod, name, axis, spec):
        mod.num_embeddings, mod.embedding_dim = mod.weight.shape
        if axis == 0:
            start = spec.rank * mod.num_embeddings
            module_patch.set_kernel(mod, VocabParallelEmbeddingKernel(start, spec.group))

    def reduce_kernel(self, mod, group, op="all_reduce", axis=None):
        k = module_patch.kernel(mod)
        if op == "all_reduce" and isinstance(k, VocabParallelEmbeddingKernel):
            return VocabParallelEmbeddingKernel(k.start, group, reduce=True)
        return None


def _is_hf_conv1d(mod: nn.Module) -> bool:
    cls = module_patch.original_class(mod)
    return cls.__name__ == "Conv1D" and hasattr(mod, "nf") and hasattr(mod, "nx")


def rule_for(mod: nn.Module) -> ShardRule:
    cls = module_patch.original_class(mod)
    if issubclass(cls, nn.Linear):
        return LinearRule()
    if issubclass(cls, nn.Embedding):
        return EmbeddingRule()
    if _is_hf_conv1d(mod):
        return Conv1DRule()
    return ShardRule()


def has_known_layout(mod: nn.Module) -> bool:
    return type(rule_for(mod)) is not ShardRule


# ------------------------------------------------------------------------------------------------
# Slapo 2023's names of the collectives (its `slapo/sharding/sync_ops.py`, re-exported by
# `slapo.sharding`): the autograd collectives of `slapo.distributed.collectives` under their 2023
# names and signatures. `group=None` is the world, as in 2023. 2023's all-reduce ran in place on
# its input; these return a new tensor. `from slapo.sharding import sync_ops` gets them as attributes.
# ------------------------------------------------------------------------------------------------
def reduce_backward_grad(inp: torch.Tensor, group=None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (`collectives.reduce_backward`)."""
    return collectives.reduce_backward(inp, group)


def reduce_forward_output(inp: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce forward, identity backward (`collectives.reduce_forward`)."""
    return collectives.reduce_forward(inp, group)


def all_gather_forward_output(inp: torch.Tensor, dim: int, group=None,
                              tensor_parallel_output_grad: bool = True) -> torch.Tensor:
    """All-gather along `dim`; backward reduce-scatters (`tensor_parallel_output_grad=True`, the
    gathered tensor feeds sharded ops) or keeps this rank's slice (`collectives.all_gather`
    with `partial_grad=tensor_parallel_output_grad`)."""
    return collectives.all_gather(inp, dim, group, partial_grad=tensor_parallel_output_grad)


def reduce_scatter_forward_output(inp: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Reduce-scatter along `dim`; backward all-gathers (`collectives.reduce_scatter`)."""
    return collectives.reduce_scatter(inp, dim, group)


def scatter_forward_output(inp: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Keep this rank's chunk along `dim`; backward all-gathers (`collectives.scatter`)."""
    return collectives.scatter(inp, dim, group)


class sync_ops:  # noqa: N801 - 2023's module name
    """2023's `slapo.sharding.sync_ops` (`from slapo.sharding import sync_ops`): its five
    collectives, the functions above."""

    reduce_backward_grad = staticmethod(reduce_backward_grad)
    reduce_forward_output = staticmethod(reduce_forward_output)
    all_gather_forward_output = staticmethod(all_gather_forward_output)
    reduce_scatter_forward_output = staticmethod(reduce_scatter_forward_output)
    scatter_forward_output = staticmethod(scatter_forward_output)
