"""Symbolic cost model of one block: sympy expressions in batch, seq and tp.

How the expressions are obtained: the block is captured (`slapo.tune.capture`, a real eager
forward under FakeTensorMode) at a small grid of (batch, seq) sizes; every cost is a polynomial of
degree ≤ 2 in batch and in seq (activations are b·s·h and b·heads·s² terms), so the exact rational
polynomial through a 3×3 grid (batch 2-4) is solved for and then *verified* at three more sizes — a cost that
is not such a polynomial (padding, size-dependent kernels) raises instead of extrapolating.
Tensor parallelism is captured the same way on one rank's shard of the block at tp=2
(`slapo.model_schedule.plan_block.shard_block`: the family's own runtime plan, applied on a
virtual group), giving `R + S/tp` (replicated + sharded parts) with the unsharded tp=1 capture,
verified at tp=4 when the block divides. The result lambdifies to numpy, so millions of configs evaluate in milliseconds.

Also re-exported here for one import point: model-state/pipeline memory (`.memory`) and the
roofline / alpha-beta time model (`.timing`).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..errors import SchedulingError, TraceError
from ..model_schedule.plan import TPPlan
from ..model_schedule.plan_block import shard_block
from ..runtime.batch import tensors_in
from .capture import CaptureStats, Inputs, InputsFn, _batch_seq, capture, resize_inputs
from .memory import (  # noqa: F401 - re-exported
    ModelStates,
    model_state_bytes,
    pipeline_inflight,
    stage_peak_bytes,
)
from .timing import (  # noqa: F401 - re-exported
    AlphaBeta,
    DeviceConstants,
    calibrate,
    collective_sweep,
    collective_time,
    fit_alpha_beta,
    roofline_time,
)

BATCH, SEQ, TP, CKPT = sympy.symbols("batch seq tp ckpt", positive=True, integer=True)
# Fit at batch 2..4: at batch 1 some reshapes of transposed views are free views instead of
# copies, so autograd saves a different storage (seen in SDPA's math path); batch 1 is captured
# directly instead (see saved_activation_bytes). Seq values are multiples of the example's seq.
_B_FIT, _S_FIT = (2, 3, 4), (1, 2, 3)
_CHECKS = ((5, 1), (2, 4), (5, 4))


def _fit_poly(samples: dict[tuple[int, int], int], s0: int, what: str, where: str) -> sympy.Expr:
    """Exact polynomial (deg ≤ 2 in batch and seq) through a 3×3 grid, verified at 3 more points."""
    monos = [(i, j) for i in range(3) for j in range(3)]
    pts = [(b, m * s0) for b in _B_FIT for m in _S_FIT]
    A = sympy.Matrix([[sympy.Integer(b) ** i * sympy.Integer(s) ** j for i, j in monos] for b, s in pts])
    y = sympy.Matrix([samples[p] for p in pts])
    coef = A.LUsolve(y)
    expr = sympy.expand(sum(c * BATCH**i * SEQ**j for c, (i, j) in zip(coef, monos)))
    for b, m in _CHECKS:
        got = expr.subs({BATCH: b, SEQ: m * s0})
        if got != samples[(b, m * s0)]:
            raise TraceError(
                where,
                f"{what} is not a polynomial of degree <= 2 in batch and seq (predicted {got}, "
                f"captured {samples[(b, m * s0)]} at batch={b}, seq={m * s0}).",
                "use a multiple-of-8 example seq, or evaluate this size with capture() directly.",
            )
    return expr


@dataclass
class BlockCost:
    """Symbolic costs of one block (per tp rank). Symbols: `BATCH`, `SEQ`, `TP`, `CKPT`.

    `exprs` has one entry per `CaptureStats` field (bytes and FLOPs of one forward /
    backward of one micro-batch); `saved` combines them for a checkpoint choice. Exact
    for batch ≥ 2; at batch 1 a few reshapes become views and the saved set can differ slightly.
    """

    name: str
    exprs: dict[str, sympy.Expr]
    tp_fitted: bool
    tp_verified: int = 1  # largest tp at which the R + S/tp form was checked against a capture
    _fns: dict[str, Callable] = field(default_factory=dict, repr=False)

    def saved(self, include_inputs: bool = False) -> sympy.Expr:
        """Saved-for-backward bytes; `CKPT` ∈ {0, 1} selects checkpointing.

        A checkpointed block saves only its inputs; so with `include_inputs=False` it saves 0.
        Without checkpointing it saves its activations (+ the inputs autograd saved, if asked).
        """
        e = self.exprs
        off = e["saved_bytes"] + (e["saved_input_bytes"] if include_inputs else 0)
        on = e["input_bytes"] if include_inputs else sympy.Integer(0)
        return sympy.expand(CKPT * on + (1 - CKPT) * off)

    def lambdify(self, name: str, expr: sympy.Expr | None = None) -> Callable[..., Any]:
        """numpy function `f(batch, seq, tp, ckpt)` of a field (or of `expr`)."""
        if expr is None and name in self._fns:
            return self._fns[name]
        fn = sympy.lambdify((BATCH, SEQ, TP, CKPT), expr if expr is not None else self.exprs[name], "numpy")
        if expr is None:
            self._fns[name] = fn
        return fn

    def value(self, name: str, batch: int, seq: int, tp: int = 1) -> int:
        self._check_tp(tp)
        return int(self.exprs[name].subs({BATCH: batch, SEQ: seq, TP: tp}))

    def saved_bytes(self, batch: int, seq: int, tp: int = 1, checkpoint: bool = False,
                    include_inputs: bool = False) -> int:
        self._check_tp(tp)
        expr = self.saved(include_inputs).subs({BATCH: batch, SEQ: seq, TP: tp, CKPT: int(checkpoint)})
        return int(expr)

    def _check_tp(self, tp: int) -> None:
        if tp != 1 and not self.tp_fitted:
            raise ValueError(f"{self.name}: cost was built without tp; rebuild with block_cost(..., tp=True).")


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def block_cost(module: torch.nn.Module, example_inputs: Inputs | None = None,
               inputs_fn: InputsFn | None = None, seq: int | None = None, tp: bool = False,
               backward: bool = False, dtype: torch.dtype | None = None,
               plan: TPPlan | None = None) -> BlockCost:
    """Build (and cache) the symbolic cost of `module`.

    `example_inputs` (dim 0 batch, dim 1 seq) or `inputs_fn(batch, seq)` + `seq` give the
    inputs; `tp=True` also fits the tp dependence on one rank's shard of the block
    (`shard_block`: the block's family plan, or `plan`);
    `backward=True` also captures backward FLOPs/bytes
    for the time model; `dtype` casts parameters and inputs (e.g. `torch.bfloat16`).
    """
    if inputs_fn is None:
        if example_inputs is None:
            raise ValueError("pass example_inputs or inputs_fn. Fix: e.g. example_inputs=(torch.randn(2, 16, h),).")
        inputs_fn = resize_inputs(example_inputs)
        s0 = _batch_seq(example_inputs)[1]
    else:
        if seq is None:
            raise ValueError("inputs_fn needs seq= (the base sequence length to capture at).")
        s0 = seq
    key = (tp, backward, dtype, s0, plan,
           inputs_fn if example_inputs is None else repr([(t.shape, t.dtype) for t in tensors_in(example_inputs)]))
    per_mod = _CACHE.setdefault(module, {})
    if key in per_mod:
        return per_mod[key]
    name = type(module).__name__
    sizes = [(b, m * s0) for b in _B_FIT for m in _S_FIT] + [(b, m * s0) for b, m in _CHECKS]

    def fit_all(mod: torch.nn.Module) -> dict[str, sympy.Expr]:
        caps = {sz: capture(mod, inputs_fn, sz[0], sz[1], dtype=dtype, backward=backward) for sz in sizes}
        fields = CaptureStats.FIELDS if backward else CaptureStats.FIELDS[:6]
        return {f: _fit_poly({k: getattr(v, f) for k, v in caps.items()}, s0, f, name) for f in fields}

    exprs = fit_all(module)
    if tp:
        def one(mod: torch.nn.Module) -> CaptureStats:
            return capture(mod, inputs_fn, 2, 2 * s0, dtype=dtype, backward=backward)

        combined = _tp_exprs(module, exprs, fit_all, one, plan, s0)
        try:
            m4 = shard_block(module, 4, plan=plan)
        except SchedulingError:  # a block that cannot split 4 ways is checked at tp 1 and 2 only
            m4 = None
        tp_verified = 2
        if m4 is not None:
            c4 = one(m4)
            bad = [(f, e.subs({BATCH: 2, SEQ: 2 * s0, TP: 4}), getattr(c4, f))
                   for f, e in combined.items() if e.subs({BATCH: 2, SEQ: 2 * s0, TP: 4}) != getattr(c4, f)]
            if bad:
                # Typically one head per rank: (b, s, 1, d) reshapes become free views and
                # autograd saves other storages. Exact at tp 1-2; larger tp is captured directly.
                warnings.warn(f"{name}: tp=4 capture differs from R + S/tp ({bad[0][0]}: predicted "
                              f"{bad[0][1]}, captured {bad[0][2]}); symbolic tp>2 is approximate.",
                              stacklevel=2)
            else:
                tp_verified = 4
        exprs = combined
    cost = BlockCost(name, exprs, tp, tp_verified if tp else 1)
    per_mod[key] = cost
    return cost


def _tp_exprs(module: torch.nn.Module, e1: dict[str, sympy.Expr], fit_all, one,
              plan: TPPlan | None, s0: int) -> dict[str, sympy.Expr]:
    """Each field as `R + S/tp` from the tp=1 fit `e1` and a fit of one rank's tp=2 shard.

    Why the extra base: the plan's row-parallel layers add their bias after the reduction, as
    an op of its own, so a sharded block moves a few more bytes than the unsharded one
    whatever tp is (a term that is neither replicated nor divided). When the plan applied on a
    group of one differs from the unsharded block (probed at one size), the `R + S/tp` form
    is fitted against that base and tp=1 keeps the unsharded block's exact value (a
    `Piecewise` in `TP`, which `lambdify` turns into `numpy.select`)."""
    probe = one(shard_block(module, 1, plan=plan, plan_at_tp1=True))
    at = {BATCH: 2, SEQ: 2 * s0}
    same = all(e.subs(at) == getattr(probe, f) for f, e in e1.items())
    base = e1 if same else fit_all(shard_block(module, 1, plan=plan, plan_at_tp1=True))
    e2 = fit_all(shard_block(module, 2, plan=plan))
    out = {}
    for f, b in base.items():
        sharded = 2 * (b - e2[f])  # e(tp) = R + S/tp  =>  S = 2(e1 - e2), R = e1 - S
        general = sympy.expand(b - sharded + sharded / TP)
        out[f] = general if sympy.expand(b - e1[f]) == 0 else \
            sympy.Piecewise((e1[f], sympy.Eq(TP, 1)), (general, True))
    return out


def saved_activation_bytes(module: torch.nn.Module, example_inputs: Inputs | InputsFn, *,
                           batch: int | None = None, seq: int | None = None, checkpoint: bool = False,
                           tp: int = 1, include_inputs: bool = False,
                           dtype: torch.dtype | None = None, plan: TPPlan | None = None) -> int:
    """Bytes saved for backward by one forward of `module` (per tp rank), predicted symbolically.

    Parameters are never counted; the module's own inputs only with `include_inputs`. With
    `checkpoint=True` the module keeps only its inputs (so 0 unless `include_inputs`).
    `batch`/`seq` default to the example's sizes; `tp` > 1 means one rank's shard of the
    block as the runtime splits it (the family's plan, or `plan`; see
    `slapo.model_schedule.plan_block.shard_block`). `example_inputs` may also be an
    `inputs_fn(batch, seq)`, in which case `seq` is required.
    """
    if tp < 1 or int(tp) != tp:
        raise ValueError(f"tp must be a positive integer, got {tp!r}.")
    if callable(example_inputs):
        if batch is None or seq is None:
            raise ValueError("with an inputs_fn, pass batch= and seq=.")
        cost = block_cost(module, inputs_fn=example_inputs, seq=seq, tp=tp != 1, dtype=dtype,
                          plan=plan)
    else:
        b0, s0 = _batch_seq(example_inputs)
        batch, seq = batch or b0, seq or s0
        cost = block_cost(module, example_inputs, tp=tp != 1, dtype=dtype, plan=plan)
        if batch == 1 or tp > max(cost.tp_verified, 2):
            # outside the range where the symbolic form was verified: capture this size directly
            key = ("direct", batch, seq, tp, dtype, plan,
                   repr([(t.shape, t.dtype) for t in tensors_in(example_inputs)]))
            per_mod = _CACHE.setdefault(module, {})
            if key not in per_mod:
                mod = shard_block(module, tp, plan=plan) if tp != 1 else module
                per_mod[key] = capture(mod, resize_inputs(example_inputs), batch, seq, dtype=dtype)
            st = per_mod[key]
            if checkpoint:
                return st.input_bytes if include_inputs else 0
            return st.saved_bytes + (st.saved_input_bytes if include_inputs else 0)
    return cost.saved_bytes(batch, seq, tp, checkpoint, include_inputs)
