"""Record what a module's init function writes into its (full-size, memory-less) tensors.

Why: to initialise a shard without ever holding the whole tensor, we run the model's own init
(`_init_weights`, `reset_parameters`, a user `init_fn`) on `StandIn`s of the original shape
(memory-less, backed by meta tensors, costing nothing), and write down every in-place op it
applies to each of them, with the scalars it resolved (a kaiming bound, a std from the config). `replay` then applies those ops to
the local shard only. Ops are seen at the aten level, below `torch.nn.init` and
`transformers.initialization`, so any init that reduces to them is covered:

- random fills (`normal_`, `uniform_`, `bernoulli_`, ...: ops tagged `nondeterministic_seeded`)
  with scalar arguments: `kaiming_*`, `xavier_*` and torch 2.11's inverse-CDF `trunc_normal_`
  become these plus pointwise ops;
- `zero_`, `fill_`, `copy_` from a real (non-meta) tensor, `masked_fill_`, and any in-place
  pointwise op (`mul_`, `clamp_`, `erfinv_`, ...) whose other tensor arguments are real;
- `index_fill_` and writes through strided views (`weight[padding_idx].zero_()`, slices).

A write the replay cannot reproduce exactly (values computed from another tensor of the init, as
in `orthogonal_`; an `out=` op; a view that is not a box of the tensor; an init that reads values
in Python, as torch 2.13's rejection-sampling `trunc_normal_` does, or replaces the tensor) marks
that tensor *failed* with the reason; `materialize` then initialises it the old way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree

aten = torch.ops.aten

# Deterministic in-place ops without the `pointwise` tag that act element by element.
_ELEMENTWISE = {aten.zero_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.copy_.default,
                aten.masked_fill_.Scalar, aten.masked_fill_.Tensor}
_INDEX_FILL = {aten.index_fill_.int_Scalar, aten.index_fill_.int_Tensor}


def _inplace(func) -> bool:
    """Whether `func` writes its first argument in place (`mul_`, `normal_`, `copy_`). torch
    2.13 tags these ops `inplace`; torch 2.11 (the GPU image's) has no such tag, so there the
    schema says it: an op named `..._` whose first (positional) argument is written,
    `Tensor(a!) self`. On torch 2.13 the two agree on every aten op except a few untagged
    overloads the schema rule also counts: list ops (`add_.t`, `mul_.t`), `copy_.Tensor/int/
    float` (TorchScript's, not what `Tensor.copy_` dispatches to) and the `hacked_twin`s of
    `index_put_` (tests/test_init_sharded.py checks the agreement)."""
    tag = getattr(torch.Tag, "inplace", None)
    if tag is not None:
        return tag in func.tags
    schema = func._schema
    first = schema.arguments[0] if schema.arguments else None
    return bool(first is not None and not first.kwarg_only and first.alias_info is not None
                and first.alias_info.is_write and schema.name.endswith("_"))


@dataclass(frozen=True)
class Box:
    """A strided view of a contiguous tensor, as index ranges of the tensor's dimensions.

    `dims[k]` says where view dimension k runs: (base dim, start, step, count), base dim None for
    a size-1 dimension the view added; `fixed[d]` is the index of base dimension d where the view
    does not run along it (a `select`). This is the form `replay` can cut into shard coordinates.
    """

    dims: tuple[tuple[int | None, int, int, int], ...]
    fixed: tuple[tuple[int, int], ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for _, _, _, n in self.dims)


def whole(shape: tuple[int, ...]) -> Box:
    """The box of the whole tensor."""
    return Box(tuple((d, 0, 1, n) for d, n in enumerate(shape)), ())


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def _covers_all(view: torch.Tensor, shape: tuple[int, ...]) -> bool:
    """Whether `view` holds every element of the base exactly once (`w.view(-1)`)."""
    if view.numel() != math.prod(shape) or view.storage_offset() != 0:
        return False
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(view.shape, view.stride()) if s > 1):
        if stride != expected:
            return False
        expected *= size
    return True


def box_of(view: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
    """The `Box` of `view` inside a contiguous base of `shape`, None if it is not one.

    Each view dimension of size > 1 must step along one base dimension; the storage offset,
    written in the base's mixed radix, gives every start and every fixed index."""
    strides = _contiguous_strides(shape)
    start, rest = [], view.storage_offset()
    for n, st in zip(shape, strides):
        start.append(min(rest // st, max(n - 1, 0)))
        rest -= start[-1] * st
    if rest:
        return None
    dims, used = [], set()
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            dims.append((None, 0, 1, 1))
            continue
        d = next((d for d in range(len(shape)) if d not in used and stride > 0
                  and stride % strides[d] == 0
                  and start[d] + stride // strides[d] * (size - 1) < shape[d]), None)
        if d is None:
            return None
        used.add(d)
        dims.append((d, start[d], stride // strides[d], size))
    return Box(tuple(dims), tuple((d, start[d]) for d in range(len(shape)) if d not in used))


@dataclass
class Op:
    """One recorded write: `func(target_view, *args, **kwargs)`, `kind` one of "random",
    "elementwise", "index_fill"; `box` is the written view (the whole tensor for an order-free
    op through a reshaped view)."""

    func: Callable
    kind: str
    box: Box
    args: tuple
    kwargs: dict


@dataclass
class Recording:
    """Per tensor name: the ops written into it, or why it cannot be replayed."""

    ops: dict[str, list[Op]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    def fail(self, name: str, reason: str) -> None:
        self.failed.setdefault(name, reason)
        self.ops.pop(name, None)


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class StandIn(torch.Tensor):
    """A full-size tensor without memory that reports a real device.

    Why not a plain meta tensor: torch's `trunc_normal_`, `orthogonal_`, `sparse_` and `dirac_`
    return early on meta tensors, so their writes would never be seen. A stand-in runs every op
    on an inner meta tensor (`inner`), hands the writes to its `Recorder` and does not execute
    them; results that are tensors come back as stand-ins, so views stay recognisable."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor, device: torch.device, recorder: Recorder):
        out = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=device, requires_grad=False)
        out.inner, out.recorder = inner, recorder
        return out

    def __repr__(self) -> str:
        return f"StandIn({tuple(self.shape)}, {self.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        recorder = next(t.recorder for t in pytree.tree_leaves((args, kwargs))
                        if isinstance(t, StandIn))
        return recorder.dispatch(func, tuple(args), kwargs or {})


class Recorder:
    """Makes the stand-ins of a model's tensors and records, per tracked stand-in, the ops
    that write into it (`run`, once per module init)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.names: dict[int, str] = {}
        self.rec = Recording()
        self.closed = True  # writes are recorded only inside `run`

    def stand_in(self, name: str | None, shape: tuple[int, ...], dtype) -> StandIn:
        """A stand-in of `shape`; writes into it are recorded under `name` (None: ignored)."""
        inner = torch.empty(shape, dtype=dtype, device="meta")
        if name is not None and inner.numel():
            self.shapes[name] = tuple(shape)
            self.names[_storage_key(inner)] = name
            self.rec.ops[name] = []
        return StandIn(inner, self.device, self)

    def run(self, init: Callable[[], None], names: list[str] | None = None) -> Recording:
        """Run `init()`, adding what it writes to what earlier runs wrote (a later run's ops
        come after: a parent's init lands on top of its children's). An init that raises on
        stand-ins (e.g. it reads values in Python) fails the tracked tensors it could have
        written: `names`, or every one."""
        self.closed = False
        try:
            init()
        except Exception as e:  # noqa: BLE001 - any failure means: initialise the old way
            for name in self.shapes if names is None else names:
                if name in self.shapes:
                    self.rec.fail(name, f"the init raised on stand-in tensors "
                                        f"({type(e).__name__}: {e})")
        finally:
            self.closed = True
        return self.rec

    def dispatch(self, func, args: tuple, kwargs: dict):
        written = list(self._written(func, args, kwargs))
        if not self.closed:
            for name, target in written:
                if name is not None and name not in self.rec.failed:
                    self._record(name, target, func, args, kwargs)
        if written and torch.Tag.inplace_view in func.tags:  # t_, squeeze_, as_strided_
            raise RuntimeError(f"{func} changes a tensor's shape in place, which a stand-in "
                               "cannot follow")
        if written and _inplace(func) and args and args[0] is written[0][1]:
            return args[0]  # a write into a stand-in: recorded, nothing to compute
        out = func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))
        return pytree.tree_map(self._wrap, out)

    def _wrap(self, x):
        return StandIn(x, self.device, self) if isinstance(x, torch.Tensor) and x.is_meta else x

    def _written(self, func, args, kwargs):
        """(name or None, stand-in) for every stand-in the op writes (schema `Tensor(a!)`)."""
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in _tensors(value):
                if isinstance(t, StandIn):
                    yield self.names.get(_storage_key(t.inner)), t

    def _record(self, name: str, target: StandIn, func, args, kwargs) -> None:
        op, problem = replayable(func, target, target.inner, self.shapes[name], args, kwargs)
        if problem is not None:
            self.rec.fail(name, problem)
        else:
            self.rec.ops[name].append(op)


def replayable(func, target, view: torch.Tensor, shape: tuple[int, ...], args,
               kwargs) -> tuple[Op | None, str | None]:
    """The write `func(target, ...)` as a replayable `Op` on a tensor of full `shape` (`view`:
    the written tensor as a meta tensor, for its position), or why it cannot be replayed.
    Shared by the materialise recorder and the constructor recorder (`construct.py`)."""
    problem = _why_not(func, target, args, kwargs)
    box = box_of(view, shape)
    if problem is None and box is None:
        problem = _whole_view_problem(func, view, shape, args, kwargs)
        box = whole(shape)
    if problem is not None:
        return None, problem
    kw = {k: v for k, v in kwargs.items() if k != "generator"}
    return Op(func, _kind(func), box, tuple(args[1:]), kw), None


def _to_meta(x):
    """Reads run on meta: a stand-in's inner tensor, a real tensor's meta twin."""
    if isinstance(x, StandIn):
        return x.inner
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _whole_view_problem(func, target: torch.Tensor, shape, args, kwargs) -> str | None:
    """A view that is no box may still hold the whole tensor in another order (`w.view(-1)`):
    fine for an op that treats every element alike, not for one that reads positions."""
    if not _covers_all(target, shape):
        return (f"{func} writes through a view ({tuple(target.shape)}, stride "
                f"{target.stride()}) that is not a box of the tensor")
    if _kind(func) == "index_fill" or any(t.dim() > 0 for t in _other_tensors(args, kwargs)):
        return f"{func} reads positions through a reshaped view of the tensor"
    return None


def _other_tensors(args, kwargs) -> list[torch.Tensor]:
    return [t for v in [*args[1:], *kwargs.values()] for t in _tensors(v)]


def _kind(func) -> str | None:
    if func in _INDEX_FILL:
        return "index_fill"
    tags = func.tags
    if _inplace(func) and torch.Tag.nondeterministic_seeded in tags:
        return "random"
    if func in _ELEMENTWISE or (_inplace(func) and torch.Tag.pointwise in tags):
        return "elementwise"
    return None


def _why_not(func, target: torch.Tensor, args, kwargs) -> str | None:
    """Why this write cannot be replayed on a shard (None: it can)."""
    kind = _kind(func)
    if kind is None:
        return f"{func} is not an op the shard replay knows"
    if not args or args[0] is not target:
        return f"{func} writes the tensor through an output argument"
    others = _other_tensors(args, kwargs)
    if any(isinstance(t, StandIn) or t.device.type == "meta" for t in others):
        return f"{func} computes its values from another tensor of the init"
    if kind == "random" and others:
        return f"{func} takes tensor arguments"
    if kind == "elementwise":
        for t in others:
            try:
                if torch.broadcast_shapes(t.shape, target.shape) != target.shape:
                    return f"{func} broadcasts the tensor itself"
            except RuntimeError:
                return f"{func} has an argument that does not broadcast to the tensor"
    return None
