"""`Verify`: prove that a scheduled model computes what the original computed.

    with slapo.Verify(sch, example_inputs=[ids], loss_fn=lambda out: out[0].float().pow(2).mean()):
        ... primitives ...

On entry it checks that every rank of the group holds the same parameters and the same inputs
(tensor parallelism silently breaks otherwise), and deep-copies the model. On exit it runs both
models on the inputs and compares

1. every output tensor,
2. (with `loss_fn`) every parameter gradient, gathering shards across ranks (pick a loss whose
   gradient reaches every layer: the mean square of a LayerNorm'd output, e.g. a `BertModel`'s
   `last_hidden_state`, is constant at the norm's initial weights, so every gradient upstream
   of the norm is roundoff and would be compared as such; the model's own loss, or a distance
   to a fixed non-uniform target, is not),
3. every parameter after one optimizer step (SGD unless `optimizer` is given),

and that every original parameter is still present (sharded or replicated). The scheduled model
is left exactly as it was (parameters restored, gradients cleared).

Expert parallelism (a mesh with ep > 1, `model_schedule.apply` swapping the experts for
`op.moe.ExpertParallelExperts`): each rank may run its own inputs; its E/ep experts are the rows
`[ep_rank * E/ep, (ep_rank + 1) * E/ep)` of the original's [E, ...] tensors
(`op.moe.expert_shard_spec`), gathered over the ep group to compare, and their gradients are
compared with the original's summed over the ep group (each rank's experts receive every ep
rank's tokens). On entry the ep ranks must hold the same weights; the ranks of the tp and ep
groups reach one verdict (`slapo.verify.experts`). A mismatch inside an experts module names the
diverging experts by global index (docs/verify.md).

A model on the meta device (`slapo.init_empty_weights()`) is verified on materialised copies:
both are initialised like `build` would (`init_weights`, `init_seed`, on `device`), so the
scheduled copy holds exactly the slices of the reference; the model itself stays on meta. A mismatch raises
`VerificationError` naming the output or parameter and the error; below that first line, the
localisation (`slapo.verify.localise`): the first module whose forward output (or, when all
outputs agree, input gradient) diverged, its schedule path and the primitives applied to it and
its ancestors. Every rank reaches the same verdict and reports the same text (a mismatch on one
rank stops all of them, so none waits in a collective alone). A shape error inside a scheduled
module is raised as `slapo.runtime.shape_errors.ScheduledShapeError` (a `SchedulingError` and a
`RuntimeError`) naming the module and the `shard` that changed the shape.

Under tensor parallelism (with `check_rng`, the default) the scheduled model also runs once in
training mode to check where dropout draws its numbers (`slapo.verify.rng_check`): per rank in
sharded regions, shared in replicated ones. With pipeline cuts, every parameter must belong to
exactly one stage, and the stages run in sequence must compute the model's forward.

Mixed precision (`precision="bf16"` or `"fp16"`; `mixed_precision=` is the earlier keyword):
both models run forward and loss under `torch.autocast` (weights stay fp32, as in
`slapo.build(..., precision=...)`), and the
tolerances come from the model itself instead of constants: a third copy of the *original* runs
in fp32, and each tensor's measured discrepancy `d = max|original(autocast) - original(fp32)|`
is the roundoff that precision causes on this model at that tensor. The scheduled model passes
when `max|scheduled - original| <= mp_tolerance * max(d, floor)` for every output, gradient and
stepped parameter (default `mp_tolerance=4`; `floor` is the fp32 check's roundoff floor, for a
tensor that bf16 does not touch at all). A correct schedule changes the order and place of
roundings, which costs about one more `d`: measured on 2-rank TP of BERT, GPT-2 and LLaMA over
4 seeds, the worst tensor was at 2.5 d. A wrong one is far above it (BERT with the all-reduce of
its row-parallel attention output removed: >= 93 d on the outputs, >= 158 d on some gradient),
so it still fails, although bf16's roundoff is ~10^4 times fp32's.

FP8 (`precision="fp8"`, `fp8=` a `runtime.fp8.Float8Config`): the same rule, with FP8 GEMMs
(torchao, emulated on CPU) in both the scheduled model and the original, as `build` converts
them; the third copy stays fp32, so `d` is the original's own FP8 error at each tensor. The
scheduled model converts after its sharding (per-shard scales, as `build` does; the
original's are whole-tensor scales), which is about one more FP8 rounding: measured on tiny
LLaMA and GPT-2 under tp=2, tensorwise and rowwise scales, 4 seeds, the worst gradient or
stepped parameter at 2.9 d; with the row-parallel all-reduce dropped, >= 24 d. A one-element
tensor (the loss) has a floor of `FP8_SCALAR_FLOOR` relative (its own error can cancel: a
correct schedule's loss reached 9 d). The FP8 GEMMs are removed from the scheduled model after
the comparison; the localisation of a mismatch runs in fp32.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import module_patch, sharding
from ..distributed import group as _g
from ..distributed.rng import get_rng_tracker
from ..errors import SchedulingError, VerificationError
from ..init import has_meta_tensors, materialize
from ..runtime.mesh import backend_device_type, local_device
from ..runtime.precision import DTYPES, check_autocast, module_device_type, precision_arg
from ..runtime.shape_errors import shape_errors_named
from ..schedule import Schedule
from . import experts as _experts
from .localise import flatten as _flatten
from .localise import localise
from .pipeline_check import _EPS, PipelineChecks
from .rng_check import check_rng

# fp8: the least tolerance of a one-element tensor (the loss), relative to it: its own
# fp8-vs-fp32 error can cancel to near zero (measured: a correct tp=2 LLaMA's loss at 9x it),
# so mp_tolerance x this (2e-3 by default) is docs/runtime.md's fp8 loss bound
FP8_SCALAR_FLOOR = 5e-4


def _call(loss_fn: Callable, out, inputs, kwargs):
    try:
        n = len(inspect.signature(loss_fn).parameters)
    except (TypeError, ValueError):
        n = 1
    return loss_fn(out) if n == 1 else loss_fn(out, (inputs, kwargs))


class Verify(PipelineChecks):
    """Context manager checking outputs, gradients and one optimizer step (see module doc)."""

    def __init__(self, sch: Schedule, example_inputs: Sequence[Any] = (), loss_fn=None, *,
                 example_kwargs: dict | None = None, rtol: float = 1e-5, atol: float | None = None,
                 optimizer: Callable | None = None, eval_mode: bool = True, seed: int = 2023,
                 enable: bool = True, init_weights: Callable | None = None, init_seed: int = 0,
                 device: torch.device | str = "cpu", precision: str = "fp32",
                 mixed_precision: str | None = None, mp_tolerance: float = 4.0,
                 localise: bool = True, check_rng: bool = True, fp8=None):
        self.precision = precision_arg(precision, mixed_precision)  # the earlier keyword too
        self.fp8 = None  # fp8: the checked Float8Config both models' GEMMs run with
        if self.precision == "fp8":
            from ..runtime.fp8 import check_fp8

            self.fp8 = check_fp8(fp8, torch.device(device).type)
        elif fp8 is not None:
            raise SchedulingError("", f"fp8={fp8!r} given with precision={self.precision!r}.",
                                  "pass precision='fp8' with it, or drop fp8=.")
        if not (isinstance(mp_tolerance, (int, float)) and mp_tolerance > 0):
            raise SchedulingError("", f"mp_tolerance={mp_tolerance!r} must be a positive "
                                  "number.", "pass e.g. mp_tolerance=4.0.")
        self.mp_tolerance = float(mp_tolerance)
        self.sch = sch
        self.inputs = tuple(example_inputs)
        self.kwargs = dict(example_kwargs or {})
        self.loss_fn = loss_fn
        self.rtol, self.atol = rtol, atol
        self.optimizer = optimizer or (lambda ps: torch.optim.SGD(ps, lr=0.1))
        self.eval_mode, self.seed, self.enable = eval_mode, seed, enable
        self.localise, self.check_rng = localise, check_rng
        self.report: dict[str, float] = {}
        self.baseline: dict[str, float] = {}    # mixed precision: original's own discrepancy
        self.tolerance: dict[str, float] = {}   # mixed precision: the atol used per tensor
        self.reference: nn.Module | None = None
        self.init_weights, self.init_seed, self.device = init_weights, init_seed, device
        self._meta = False
        self._agree_groups: list = []
        self._failure: tuple[str, str] | None = None  # (tensor name, message) of this phase

    # ---------------------------------------------------------------------------------------
    def __enter__(self) -> Verify:
        if not self.enable:
            return self
        model = self.sch.mod
        self._meta = has_meta_tensors(model)
        if not self._meta:  # a meta model has no values to compare across ranks yet
            self._check_same_across_ranks()
        self.reference = sharding.deepcopy_model(model)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None or not self.enable:
            return False
        self.check()
        return False

    # ---------------------------------------------------------------------------------------
    def _group(self):
        return self.sch.group

    def _mesh_ep_group(self):
        """The mesh's ep group when it has ep > 1 (the ranks the experts will spread over),
        else None."""
        if self.sch.mesh is None:
            return None
        from ..runtime.mesh import MeshInfo

        try:
            info = MeshInfo.of(self.sch.mesh)
        except SchedulingError:  # a mesh not made by init_mesh: no ep dimension
            return None
        return info.group("ep") if info.ep > 1 else None

    def _check_same_across_ranks(self) -> None:
        self._check_same_over(self._group(), inputs=True)
        ep = self._mesh_ep_group()
        if ep is not None:  # ep ranks are data-parallel ranks: their inputs may differ
            self._check_same_over(ep, inputs=False)

    def _check_same_over(self, group, inputs: bool) -> None:
        if _g.world_size(group) == 1:
            return
        named = [(f"input[{i}]", x) for i, x in enumerate(self.inputs)
                 if isinstance(x, torch.Tensor)] if inputs else []
        named += [(f"input {k!r}", v) for k, v in self.kwargs.items()
                  if isinstance(v, torch.Tensor)] if inputs else []
        n_inputs = len(named)
        from ..op.moe import expert_shard

        named += [(f"parameter {n!r}", p) for n, p in self.sch.mod.named_parameters()
                  if inputs or expert_shard(p) is None]  # ep ranks' own experts differ
        # one (sum, sum|x|) fingerprint per tensor, gathered in one collective on the group's
        # device (NCCL needs CUDA tensors; gloo takes CPU ones)
        device = local_device(backend_device_type(dist.get_backend(group)))
        sums = torch.stack([torch.stack([x.detach().double().sum(),
                                         x.detach().double().abs().sum()]).to(device)
                            for _, x in named])
        gathered = [torch.empty_like(sums) for _ in range(_g.world_size(group))]
        dist.all_gather(gathered, sums, group=group)
        gathered = [g.cpu() for g in gathered]
        for i, (name, _) in enumerate(named):
            vals = torch.stack([g[i] for g in gathered])
            if not torch.allclose(vals, vals[0].expand_as(vals), rtol=1e-12, atol=0):
                what = "inputs" if i < n_inputs else "weights"
                kind = "tensor-parallel" if inputs else "expert-parallel (ep)"
                raise VerificationError(
                    f"{name} differs across the ranks of the {kind} group; every rank "
                    f"must start from the same {what} (seed the model creation identically or "
                    "broadcast the inputs).")

    def _close(self, name: str, got: torch.Tensor, ref: torch.Tensor, floor: float = 0.0,
               base: torch.Tensor | None = None) -> None:
        """Elementwise |got - ref| <= atol + rtol |ref|; by default atol = rtol * max|ref| of
        this tensor, but at least `floor` (roundoff level of the whole family of tensors, so
        mathematically-zero gradients such as a key bias's are not judged on noise).
        Under mixed precision `base` is the original's fp32 value (see `_close_mixed`).

        A mismatch is recorded (the first of the phase, see `_settle`), not raised: the
        comparison loops go on, so every rank runs the same collectives (`gather_full`)."""
        if got.shape != ref.shape:
            self._fail(name, f"{name}: shape {tuple(got.shape)} != original "
                       f"{tuple(ref.shape)}.")
            return
        got, ref = got.detach().double(), ref.detach().double()
        if self.precision != "fp32":
            self._close_mixed(name, got, ref, base, floor)
            return
        err = (got - ref).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        atol = self.atol if self.atol is not None else max(self.rtol * scale, floor, 1e-30)
        self.report[name] = err
        if not torch.allclose(got, ref, rtol=self.rtol, atol=atol):
            self._fail(name, f"{name} does not match the original: max abs error "
                       f"{err:.3e} (max |original| {scale:.3e}, rtol {self.rtol}, "
                       f"atol {atol:.3e}).")

    def _close_mixed(self, name: str, got: torch.Tensor, ref: torch.Tensor,
                     base: torch.Tensor | None, floor: float) -> None:
        """|got - ref| <= mp_tolerance * max(d, floor), d = max|ref - base| (module doc)."""
        if base is None or base.shape != ref.shape:
            self._fail(name, f"{name}: no fp32 value of the original to measure the "
                       f"{self.precision} roundoff against.")
            return
        base = base.detach().double()
        err = (got - ref).abs().max().item() if ref.numel() else 0.0
        scale = ref.abs().max().item() if ref.numel() else 0.0
        d = (ref - base).abs().max().item() if ref.numel() else 0.0
        if self.precision == "fp8" and ref.numel() == 1:  # module doc: a scalar's fp8 error
            floor = max(floor, FP8_SCALAR_FLOOR * scale)  # can cancel to near zero
        atol = self.atol if self.atol is not None else \
            self.mp_tolerance * max(d, floor, 1e-30)
        self.report[name], self.baseline[name], self.tolerance[name] = err, d, atol
        if not err <= atol:
            self._fail(name,
                       f"{name} does not match the original under {self.precision}: max "
                       f"abs error {err:.3e} > tolerance {atol:.3e} = {self.mp_tolerance:g} x "
                       f"the original's own {self.precision}-vs-fp32 error "
                       f"{max(d, floor):.3e} (max |original| {scale:.3e}).")

    def _fail(self, name: str, message: str) -> None:
        if self._failure is None:
            self._failure = (name, message)

    def _settle(self) -> tuple[str, str] | None:
        """This phase's first mismatch, agreed by every rank (the lowest failing rank's): a
        rank whose own tensors matched still stops, so no rank waits in a collective alone."""
        failure, self._failure = self._failure, None
        return _experts.agree(failure, self._agree_groups)

    def _autocast(self, model: nn.Module, enabled: bool):
        """The forward/loss context of `model`: autocast under mixed precision, else nothing."""
        if self.precision == "fp32" or not enabled:
            return contextlib.nullcontext()
        device_type = module_device_type(model, default=torch.device(self.device).type)
        check_autocast(self.precision, device_type)
        return torch.autocast(device_type, dtype=DTYPES[self.precision])

    def _run(self, model: nn.Module, amp: bool = True):
        tracker = get_rng_tracker()
        states = tracker.get_states()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            with self._autocast(model, amp):
                out = model(*self.inputs, **self.kwargs)
        tracker.set_states(states)
        return out

    def _backward(self, model: nn.Module, out, amp: bool = True) -> None:
        with self._autocast(model, amp):
            loss = _call(self.loss_fn, out, self.inputs, self.kwargs)
        loss.float().backward()  # outside autocast, in fp32 (as slapo.build does)

    def _copies(self) -> tuple[nn.Module, nn.Module]:
        """(the scheduled model to run, a fresh reference): on a meta model, materialised
        copies of each with the same per-module seeds, so the scheduled copy's shards are
        exactly the slices of the reference's full tensors (see slapo.init); the scheduled
        model itself stays on the meta device."""
        model, ref = self.sch.mod, sharding.deepcopy_model(self.reference)
        if self._meta:
            model = materialize(sharding.deepcopy_model(model), self.device,
                                init_fn=self.init_weights, seed=self.init_seed)
            ref = self._fresh_reference()
        return model, ref

    def _fresh_reference(self) -> nn.Module:
        ref = sharding.deepcopy_model(self.reference)
        if self._meta:
            ref = materialize(ref, self.device, init_fn=self.init_weights, seed=self.init_seed)
        return ref

    def check(self) -> dict[str, float]:
        """Run both models and compare; returns {name: max abs error}. Raises on mismatch:
        `VerificationError` whose first line names the tensor and the error, followed by the
        localisation (`slapo.verify.localise`: the first module that diverged and the
        primitives applied there), or `ScheduledShapeError` when the scheduled model raises a
        shape error inside a scheduled module."""
        if self.reference is None:
            raise VerificationError("Verify.check() called before entering the context.")
        model, ref = self._copies()
        # the ranks that decide together: the tp group, and the ep group whose all-to-alls
        # couple the ranks' forwards (`slapo.verify.experts.agree`)
        self._agree_groups = _experts.agree_groups(self._group(), model)
        # mixed precision: the original once more, in fp32, to measure its own roundoff
        base = sharding.deepcopy_model(ref) if self.precision != "fp32" else None
        modes = (model.training, ref.training)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        failure = None
        with self._fp8_gemms(model, ref):
            failure = self._compare_all(model, ref, base, saved, modes)
        if failure is not None:
            self._raise(failure, model)
        self._check_rng(model)
        self._check_pipeline()
        return self.report

    def _fp8_gemms(self, model: nn.Module, ref: nn.Module):
        """fp8: the scheduled model and the original (a copy) both with FP8 GEMMs, the
        scheduled one's removed after the comparison (the localisation of a mismatch and the
        RNG check run in fp32). The scheduled model converts after its sharding, so its scales
        are per shard, as `build` does; the original's are the whole tensors'."""
        if self.fp8 is None:
            return contextlib.nullcontext()
        from ..runtime.fp8 import convert, converted

        device_type = module_device_type(ref, default=torch.device(self.device).type)
        convert([ref], ref, self.fp8, device_type)
        return converted(model, self.fp8, device_type)

    def _compare_all(self, model: nn.Module, ref: nn.Module, base: nn.Module | None,
                     saved: dict, modes: tuple[bool, bool]) -> tuple[str, str] | None:
        """Outputs, then gradients and the optimizer step (with `loss_fn`): the first agreed
        mismatch, or None."""
        failure = None
        try:
            self._set_eval(model, ref, base)
            self._check_params_accounted(model, ref)
            out_ref = self._run(ref)
            with shape_errors_named(model, self.sch):
                out = self._run(model)
            out_base = self._run(base, amp=False) if base is not None else None
            failure = self._phase(self._compare_outputs, out_ref, out, out_base)
            if failure is None and self.loss_fn is not None:
                self._backward(ref, out_ref)
                self._backward(model, out)
                if base is not None:
                    self._backward(base, out_base, amp=False)
                # an ep rank's experts receive every ep rank's loss gradient
                _experts.sum_expert_grads(model, ref, base)
                failure = self._phase(self._compare_grads, model, ref, base) or \
                    self._phase(self._step_and_compare, model, ref, base)
        finally:
            self._restore(model, saved, modes[0])
            ref.train(modes[1])
        return failure

    def _set_eval(self, *models: nn.Module | None) -> None:
        if self.eval_mode:
            for m in models:
                if m is not None:
                    m.eval()

    def _phase(self, compare: Callable, *args) -> tuple[str, str] | None:
        compare(*args)
        return self._settle()

    @staticmethod
    def _restore(model: nn.Module, saved: dict, mode: bool) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(saved[n])
                p.grad = None
        model.train(mode)

    def _raise(self, failure: tuple[str, str], model: nn.Module) -> None:
        """Raise the agreed mismatch, with the localisation below its first line."""
        name, message = failure
        if not self.localise:
            raise VerificationError(message)
        ref = self._fresh_reference()
        modes = (model.training, ref.training)
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            self._set_eval(model, ref)
            backward = None if self.loss_fn is None else \
                (lambda m, out: _call(self.loss_fn, out, self.inputs, self.kwargs)
                 .float().backward())
            report = localise(self.sch, model, ref, lambda m: self._run(m, amp=False),
                              backward, self.rtol, self.atol, failed=name)
        finally:
            self._restore(model, saved, modes[0])
        raise VerificationError(f"{message}\n{report}")

    def _check_rng(self, model: nn.Module) -> None:
        """Dropout placement under tensor parallelism (`slapo.verify.rng_check`)."""
        if not self.check_rng or _g.world_size(self._group()) == 1:
            return
        saved = {n: p.detach().clone() for n, p in model.named_parameters()}
        try:
            report = check_rng(self.sch, model, self._run)
        finally:
            self._restore(model, saved, model.training)
        if report is not None:
            raise VerificationError(report)

    def _compare_outputs(self, out_ref, out, out_base) -> None:
        ref_items, items = _flatten(out_ref), dict(_flatten(out))
        base_items = dict(_flatten(out_base)) if out_base is not None else {}
        floor = _EPS * max((r.detach().abs().max().item() for _, r in ref_items
                            if r.numel() and r.is_floating_point()), default=0.0)
        skip = self._not_computed_by_design()
        for name, r in ref_items:
            if name not in items and name in skip:
                continue  # the loss, compared below, is what the fused op computes instead
            if name not in items:
                self._fail(name, f"{name} is missing from the scheduled output.")
                continue
            self._close(name, items[name], r, floor, base_items.get(name))

    def _not_computed_by_design(self) -> set[str]:
        """Outputs a schedule drops on purpose, as the root's kernel declares them
        (`dropped_outputs`): the fused linear + cross-entropy loss (`model_schedule.fused_loss`)
        never materialises the logits when labels are given."""
        kernel = module_patch.kernel(self.sch.mod)
        return {f"output.{name}" for name in getattr(kernel, "dropped_outputs", ())}

    def _compare_grads(self, model: nn.Module, ref: nn.Module, base: nn.Module | None) -> None:
        params = dict(model.named_parameters())
        base_params = dict(base.named_parameters()) if base is not None else {}
        grads = [rp.grad.abs().max().item() for rp in ref.parameters()
                 if rp.grad is not None and rp.grad.numel()]
        floor = _EPS * max(grads, default=0.0)
        for name, rp in ref.named_parameters():
            p = params[name]
            if (rp.grad is None) != (p.grad is None):
                self._fail(f"grad {name}", f"gradient of {name!r}: "
                           f"{'missing' if p.grad is None else 'unexpected'} "
                           "in the scheduled model.")
                continue
            if rp.grad is not None:
                spec = _experts.expert_parallel_spec(p)
                bp = base_params.get(name)
                self._close(f"grad {name}", sharding.gather_full(p.grad, spec), rp.grad,
                            floor, bp.grad if bp is not None else None)

    def _step_and_compare(self, model: nn.Module, ref: nn.Module,
                          base: nn.Module | None) -> None:
        for m in (ref, model, base):
            if m is not None:
                self.optimizer(list(m.parameters())).step()
        params = dict(model.named_parameters())
        base_params = dict(base.named_parameters()) if base is not None else {}
        floor = _EPS * max((rp.detach().abs().max().item() for rp in ref.parameters()
                            if rp.numel()), default=0.0)
        for name, rp in ref.named_parameters():
            p = params[name]
            self._close(f"param after step {name}",
                        sharding.gather_full(p, _experts.expert_parallel_spec(p)), rp,
                        floor, base_params.get(name))

    def _check_params_accounted(self, model: nn.Module, ref: nn.Module) -> None:
        params = dict(model.named_parameters())
        for name, rp in ref.named_parameters():
            p = params.get(name)
            if p is None:
                raise VerificationError(f"parameter {name!r} of the original model is missing "
                                        "from the scheduled model (lost by a replace?).")
            spec = _experts.expert_parallel_spec(p)  # a tp shard, or an ep rank's experts
            full = tuple(spec.orig_shape) if spec else tuple(p.shape)
            if full != tuple(rp.shape):
                raise VerificationError(f"parameter {name!r} has full shape {full}, the original "
                                        f"{tuple(rp.shape)}.")
        extra = sorted(set(params) - {n for n, _ in ref.named_parameters()})
        if extra:
            raise VerificationError(f"the scheduled model has parameters the original lacks: "
                                    f"{extra[:5]}; Verify matches parameters by name.")
