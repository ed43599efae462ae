"""`predict(config)` for the GPU space: peak memory and step time of a scheduled HF model,
from one fake training step (`GPUCostModel`, `simulate_step`; the CPU space's predictor is
`predict_cpu.GPT2CostModel`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import predict_offload as _off
from .model_spaces import schedule_knobs
from .op_costs import StepCounter as _StepCounter
from .partition_plan import PartitionPlan
from .space import Config
from .timing import DeviceConstants, roofline_time

_ADAMW_STATE = 8  # bytes per parameter: fp32 exp_avg + exp_avg_sq (fp32 weights and grads: 8 more)
_FUSED_ADAMW_TRAFFIC = 28  # read p, g, m, v and write p, m, v (fp32), one fused kernel


@dataclass
class StepCost:
    """What one fake training step of a config costs (before any device constant)."""

    peak_bytes: float  # forward + backward peak, incl. weights and grads, excl. AdamW state
    params: int
    mm_flops: float  # matmul and attention FLOPs: forward, recomputation, backward
    mem_bytes: float  # bytes moved by every other op, a compiled layer's fused kernels as such
    kernels: int = 0  # kernels launched: eager ops, and a compiled layer's fused + extern kernels
    fp8_flops: float = 0.0  # the part of mm_flops in FP8 GEMMs (precision "fp8")
    fp8_gemms: int = 0  # modules whose GEMM is FP8 (`runtime.fp8.convert`)
    offload: tuple = ()  # offloaded layers' copies (`predict_offload.OffloadEvent`), in order

    def memory(self) -> float:
        """Peak allocated bytes of a steady step: AdamW's fp32 moments exist from step 2 on; the
        optimizer step itself holds weights + grads + moments (16 B/param)."""
        return max(self.peak_bytes + _ADAMW_STATE * self.params, 16.0 * self.params)


class GPUCostModel:
    """`predict(config)` for the GPU space: peak memory and step time of a training step.

    **Memory** is simulated, not estimated: the real model (built under `FakeTensorMode`: no
    weights are allocated, a 1.1B model costs nothing) gets the config's schedule
    (`model_schedule.apply`) and runs one forward under the config's autocast and one backward,
    while torch's `MemTracker` follows every tensor's lifetime. Eager, SAC, full checkpointing,
    fused loss, kernels and autocast's cached bf16 weights are therefore what the product runs.
    A compiled layer (`compile_blocks`) is not emulated by a formula: the first layer is
    compiled once per checkpoint mode with inductor's own AOTAutograd front half
    (`partition_plan.record_partition`: its decompositions, joint-graph passes and min-cut
    partitioner, no code generation) on the fake tensors of the step, at full shape, and every
    compiled layer then runs as a stand-in that holds exactly the bytes that partition keeps
    for backward and allocates its backward graph's peak (`_standin_forward`). AdamW's state
    is added analytically (`StepCost.memory`).

    **Time** is a roofline per op class over the same step: matmul/attention FLOPs (forward,
    recomputation, backward) at `device.peak_flops`, the bytes every other op moves at
    `device.mem_bandwidth` (a compiled layer's from its partitioned graphs, one fused kernel
    per elementwise/reduction region: `partition_plan.graph_costs`), one `device.kernel_launch_s` per
    launched kernel (eager ops one each; a compiled layer its fused and matmul kernels), and
    the fused AdamW step; times `1 / efficiency`. `efficiency` is the one constant fitted to a
    measurement (`calibrate`, on one configuration per model family).

    **FP8** (`mixed_precision="fp8"`): the fake step installs `build`'s FP8 GEMMs (`fp8`, default
    `Float8Config()`) on torchao's GPU path (`_scaled_mm`), so MemTracker counts what torchao
    saves, the counter its casts; `_scaled_mm` FLOPs run at `device.fp8_peak_flops` (docs/tune.md).

    **Offload** (`offload_ratio`): `predict_offload` runs the primitive's hooks with simulated
    copies (memory) and adds the time compute waits for them at `device.host_bandwidth`.
    """

    def __init__(self, spec: Any, device: DeviceConstants | None = None,
                 efficiency: float = 1.0, fp8: Any = None):
        self.spec = spec
        self.device = device or H100
        self.efficiency = efficiency
        self.fp8 = fp8  # a runtime.fp8.Float8Config for "fp8" configs (None: the default)
        self._cache: dict[str, StepCost] = {}

    def step_cost(self, config: Config, schedule: bool = True) -> StepCost:
        from .space import config_key

        key = config_key({**config, "__schedule": schedule})
        if key not in self._cache:
            self._cache[key] = simulate_step(self.spec, config, schedule, self.fp8)
        return self._cache[key]

    def roofline_s(self, cost: StepCost) -> float:
        """Matmul FLOPs (FP8 GEMMs' at the FP8 peak) + bytes of the other ops + one launch per
        kernel + the AdamW step."""
        opt = _FUSED_ADAMW_TRAFFIC * cost.params / self.device.mem_bandwidth
        launches = cost.kernels * self.device.kernel_launch_s
        return float(roofline_time(cost.mm_flops - cost.fp8_flops, cost.mem_bytes, self.device,
                                   fp8_flops=cost.fp8_flops)) + launches + opt

    def calibrate(self, config: Config, step_time_s: float, schedule: bool = True) -> float:
        """Set `efficiency` so that `config` is predicted at the measured step time."""
        self.efficiency = self.roofline_s(self.step_cost(config, schedule)) / step_time_s
        return self.efficiency

    def predict(self, config: Config, schedule: bool = True) -> dict[str, float]:
        """Step time: the roofline over `efficiency`, plus the time compute waits for
        activation-offload copies (`predict_offload.offload_wait_s`; 0 without offload)."""
        cost = self.step_cost(config, schedule)
        wait = _off.offload_wait_s(cost.offload, self.device, self.efficiency)
        step = self.roofline_s(cost) / self.efficiency + wait
        tokens = int(config["batch_size"]) * self.spec.seq
        return {"throughput": tokens / step, "step_time_s": step, "memory": cost.memory(),
                "mm_flops": cost.mm_flops, "mem_bytes": cost.mem_bytes,
                "kernels": float(cost.kernels), "fp8_flops": cost.fp8_flops,
                "fp8_gemms": float(cost.fp8_gemms), "offload_wait_s": wait,
                "offload_bytes": float(_off.offloaded_bytes(cost.offload))}

    __call__ = predict


# An H100 SXM as the benchmark measured it: an 8192^3 bf16 matmul at ~780 TFLOP/s
# (benchmarks/results/gpu_train_h100.jsonl, `matmul_tflops`), HBM3 at ~3 TB/s of 3.35 peak.
# One kernel launch costs 5 us: the middle of the 4-6 us an eager PyTorch op takes on an H100
# host from Python through the dispatcher to cudaLaunchKernel (CUDA's own launch latency is
# 2-4 us of it). A device property, not fitted to any measured row (docs/tune.md).
# FP8: NVIDIA's H100 SXM datasheet gives dense FP8 at 2x dense BF16 (1979 vs 989 TFLOP/s); the
# measured bf16 matmul times that ratio. Assumed, not measured here (the GPU check is owed).
# Host link: PCIe Gen5 x16 carries 63 GB/s per direction raw (32 GT/s x 16 lanes x 128/130);
# NVIDIA's nvbandwidth on H100 hosts measured 52.8 GB/s device-to-host (NVIDIA/nvbandwidth#24;
# host-to-device was 35 GB/s there, a host-dependent shortfall). 50 GB/s, assumed: not measured.
H100 = DeviceConstants("H100-SXM-80GB (measured matmul)", peak_flops=780e12,
                       mem_bandwidth=3.0e12, memory_bytes=80 * 2**30, kernel_launch_s=5e-6,
                       fp8_peak_flops=2 * 780e12, host_bandwidth=50e9)


_ATTN_DROPOUT = ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout")


def _fake_model(spec: Any) -> Any:
    import torch
    import transformers

    cfg = getattr(transformers, spec.config_class)(**spec.kwargs)
    cfg.use_cache = False
    for key in _ATTN_DROPOUT:  # CUDA's flash/efficient SDPA keep no dropout mask, but on CPU
        if getattr(cfg, key, 0):  # dropout sends SDPA to its math path (s^2 saved tensors)
            setattr(cfg, key, 0.0)
    with torch.device("cpu"):
        model = getattr(transformers, spec.model_class)(cfg)
    return model.train()


def _fake_batch(model: Any, batch: int, seq: int) -> dict:
    """Random ids; a masked LM labels 15% of positions (as benchmarks/gpu_train.py), written
    without boolean indexing so that fake tensors need no data."""
    import torch

    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    labels = ids
    if model.config.model_type in ("bert", "roberta"):
        labels = torch.where(torch.rand(batch, seq) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def _autocast(config: Config, cache: bool = True) -> Any:
    import contextlib

    import torch

    from ..runtime.precision import DTYPES, check_precision

    prec = check_precision(config.get("mixed_precision"))
    if prec == "fp32":
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=DTYPES[prec], cache_enabled=cache)


def fake_mode() -> Any:
    """FakeTensorMode, and HF told that the batch is not packed. HF looks for packed
    sequences in `position_ids` (a data-dependent check); on fake tensors it cannot, keeps
    the packing mask and so materialises a (batch, 1, seq, seq) attention mask that the real
    step (mask None, `is_causal=True`) never builds. The benchmark's batches are not packed."""
    import contextlib
    from unittest import mock

    from torch._subclasses.fake_tensor import FakeTensorMode

    stack = contextlib.ExitStack()
    try:
        from transformers import masking_utils
    except ImportError:  # an older transformers: no packing detection to tell
        masking_utils = None
    if hasattr(masking_utils, "find_packed_sequence_indices"):
        stack.enter_context(mock.patch.object(masking_utils, "find_packed_sequence_indices",
                                              lambda *a, **k: None))
    stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
    return stack


# CUDA autocast's fp32 ops (aten/src/ATen/autocast_mode.cpp: the "fp32" and
# "fp32_set_opt_dtype" lists) that CPU autocast leaves in the input's dtype. The benchmark runs
# autocast on CUDA; the fake step runs on CPU, so these run in fp32 here as they do there (HF
# GPT-2's tanh-GELU calls pow: on CUDA its chain and what autograd saves of it are fp32).
_CUDA_FP32_OPS = ("pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "exp", "log", "log1p",
                  "expm1", "rsqrt", "reciprocal", "softplus", "tan", "sinh", "cosh", "acos",
                  "asin", "erfinv", "layer_norm", "group_norm", "logsumexp")
_CUDA_FP32_OPT_DTYPE = ("softmax.int", "log_softmax.int", "sum", "sum.dim_IntList", "cumsum")


def cuda_autocast_lists(config: Config) -> Any:
    """While active, CPU autocast casts the inputs of CUDA's fp32 ops to fp32 (a kernel on the
    AutocastCPU dispatch key, as CUDA's autocast does on its key; removed on exit). Process-
    wide while active: the simulation is the only CPU autocast user then."""
    import contextlib

    import torch

    from ..runtime.precision import check_precision

    if check_precision(config.get("mixed_precision")) == "fp32":
        return contextlib.nullcontext()
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - scoped, destroyed on exit
    for name in _CUDA_FP32_OPS + _CUDA_FP32_OPT_DTYPE:
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", "AutocastCPU"):
            continue  # CPU autocast has a policy for it already
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        lib.impl(name, _fp32_kernel(op, name in _CUDA_FP32_OPT_DTYPE), "AutocastCPU")
    stack = contextlib.ExitStack()
    stack.callback(lib._destroy)
    return stack


def _fp32_kernel(op: Any, opt_dtype: bool) -> Callable:
    import torch
    from torch.utils._pytree import tree_map

    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    low = (torch.bfloat16, torch.float16)

    def widen(t: Any) -> Any:
        return t.float() if isinstance(t, torch.Tensor) and t.dtype in low else t

    def run(*args: Any, **kwargs: Any) -> Any:
        explicit = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype)
                                                          for a in args)
        with torch._C._ExcludeDispatchKeyGuard(keys):
            if not (opt_dtype and explicit):  # an explicit dtype wins, as on CUDA
                args, kwargs = tree_map(widen, (args, kwargs))
            return op(*args, **kwargs)

    return run


# benchmarks/gpu_train.make_batch labels 15% of a masked LM's positions (BERT pre-training)
MLM_LABELLED = 0.15


def _labelled_rows(spec: Any, config: Config) -> Any:
    """The fused masked-LM loss computes only the labelled rows, a data-dependent count that
    fake tensors cannot give: inside this context it takes `MLM_LABELLED` of the positions (the
    fraction the benchmark's batches label; `fused_loss.assume_labelled`)."""
    import contextlib

    if not (config.get("fused_loss") and spec.model_type in ("bert", "roberta")):
        return contextlib.nullcontext()
    from ..model_schedule.fused_loss import assume_labelled

    return assume_labelled(MLM_LABELLED)


def simulate_step(spec: Any, config: Config, schedule: bool = True,
                  fp8: Any = None) -> StepCost:
    """One fake forward + backward of `spec` under `config` (see `GPUCostModel`).

    `schedule=False` runs the HF model as loaded (the benchmark's HF baselines). `fp8`: the
    `Float8Config` of an "fp8" config (None: the default; refused without torchao).
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from ..runtime.precision import check_fp8_config, check_precision

    knobs = schedule_knobs(config)
    compiled = bool(knobs.pop("compile_blocks", False)) and schedule
    counter = _StepCounter()
    sim = _off.OffloadSim(counter)  # offloaded layers' copies (predict_offload)
    prec = check_precision(config.get("mixed_precision"))  # fp8: torchao imports here, not
    fp8 = check_fp8_config(prec, fp8 if prec == "fp8" else None, "cpu")  # under fake tensors
    with cuda_autocast_lists(config), fake_mode():
        model = _fake_model(spec)
        data = _fake_batch(model, int(config["batch_size"]), spec.seq)
        fp8_gemms = _schedule(model, knobs, compiled, config, data, counter, fp8, schedule,
                              sim)
        tracker = MemTracker()
        tracker.track_external(model)
        # (a dispatch mode active while a layer is recorded would make dynamo skip it)
        with _labelled_rows(spec, config), tracker, counter, set_checkpoint_early_stop(False), \
                sim.installed(model):
            with _autocast(config):
                loss = model(**data).loss
            loss.float().backward()
        peak = tracker.get_tracker_snapshot("peak")
        total = sum(v.get("Total", 0) for v in peak.values())
        params = sum(p.numel() for p in model.parameters())
    return StepCost(float(total), params, float(counter.flops), float(counter.bytes),
                    int(counter.kernels), float(counter.fp8_flops), len(fp8_gemms),
                    tuple(sim.events))


def _schedule(model: Any, knobs: dict, compiled: bool, config: Config, data: dict,
              counter: _StepCounter, fp8: Any, schedule: bool = True,
              sim: _off.OffloadSim | None = None) -> list[str]:
    """Apply the config's schedule (if `schedule`), then `fp8`'s GEMMs as `build` does (on
    torchao's GPU path, not the emulation). Compiled layers become stand-ins of their recorded
    partition (`_install_standins`), each with its checkpoint mode (none, full, selective),
    and the layers after the checkpointed ones are offloaded as `apply` offloads them."""
    from .. import model_schedule
    from ..model_schedule._common import offload_layers
    from ..model_schedule._registry import detect, layers_of
    from ..runtime.fp8 import convert

    ratio, policy = float(knobs.get("ckpt_ratio", 0.0)), knobs.get("ckpt_policy", "full")
    offload = float(knobs.get("offload_ratio", 0.0))
    if compiled:  # the checkpoint wrapper goes into the recorded (compiled) call instead,
        knobs = {**knobs, "ckpt_ratio": 0.0, "offload_ratio": 0.0}  # offload after recording
    sch = model_schedule.apply(model, **knobs) if schedule else None
    done = convert([model], model, fp8, "cuda") if fp8 is not None else []
    if not compiled:
        return done
    layers = [node.mod for node in layers_of(sch, detect(model))]
    n = int(ratio * len(layers) + 0.5)  # as model_schedule.apply rounds
    modes = [(policy if i < n else "none") for i in range(len(layers))]
    _install_standins(model, layers, modes, config, data, counter, sim)
    offload_layers(layers_of(sch, detect(model)), offload, after=n)
    return done


def _install_standins(model: Any, layers: list, modes: list[str], config: Config, data: dict,
                      counter: _StepCounter, sim: _off.OffloadSim | None = None) -> None:
    """Record the partition of the first layer once per checkpoint mode (`record_partition`:
    torch.compile with inductor's partitioner, at the step's full shapes, on fake tensors) and
    make every compiled layer a stand-in that holds exactly what that partition keeps."""
    args, kwargs = _layer_call(model, layers[0], config, data)
    plans = {}
    for mode in dict.fromkeys(modes):
        with _autocast(config):
            plans[mode] = _off.record_with_saved(_layer_fn(layers[0], mode), args, kwargs)
    for layer, mode in zip(layers, modes):
        layer.forward = functools.partial(_standin_forward, layer, layer.forward, *plans[mode],
                                          counter, config, sim)


def _layer_fn(layer: Any, mode: str) -> Callable:
    """The call `compile_blocks` compiles: the layer, inside its checkpoint wrapper if any
    (the product's own `CheckpointWrapper`, so a selective policy is the product's)."""
    from ..primitives.checkpoint import CheckpointWrapper

    if mode == "none":
        return layer
    wrap = CheckpointWrapper(policy=None if mode == "full" else mode)
    return lambda *a, **k: wrap(layer, layer.forward, a, k)


class _Stop(Exception):
    pass


def _layer_call(model: Any, layer: Any, config: Config, data: dict,
                autocast: Any = None) -> tuple[tuple, dict]:
    """The arguments the step passes to `layer` (one forward, stopped at the layer), under
    `autocast` (default: the config's CPU autocast, as the fake step runs)."""
    import torch

    got: dict = {}

    def grab(_mod: Any, args: tuple, kwargs: dict) -> None:
        got["call"] = (args, kwargs)
        raise _Stop

    hook = layer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with _autocast(config) if autocast is None else autocast:
            model(**data)
    except _Stop:
        pass
    finally:
        hook.remove()
    args, kwargs = got["call"]
    lift = lambda t: t.detach().requires_grad_(t.requires_grad) \
        if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(lift(a) for a in args), {k: lift(v) for k, v in kwargs.items()}


def _standin_forward(layer: Any, forward: Callable, plan: PartitionPlan, saved: list,
                     counter: _StepCounter, config: Config, sim: _off.OffloadSim | None,
                     *args: Any, **kwargs: Any) -> Any:
    """A compiled layer in the fake step: its outputs come from the eager forward (without
    autograd), and autograd holds what the recorded partition keeps (`plan.saved_bytes`, one
    buffer) until backward, which allocates the backward graph's own peak and returns
    gradients of every input and parameter; the saved buffer is released as the backward's
    peak (saved tensors until their last reader + its own buffers) is allocated. Its costs are
    the partition's, not the eager ops'. Offloaded (`sim`): the saved tensors the primitive
    would copy out leave the buffer at the end of forward and come back at the start of
    backward (`predict_offload.pack_saved`), held through the backward graph's peak."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_unflatten

    from ..primitives.offload import offload_wrapper

    params = [p for p in layer.parameters() if p.requires_grad]
    flat, spec = tree_flatten((args, kwargs))
    grad_in = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    counter.add_plan(plan, "fwd")
    shapes: dict = {}
    offloaded = offload_wrapper(layer) if sim is not None else None

    class StandIn(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *tensors: Any) -> Any:
            a, k = tree_unflatten(flat, spec)
            with counter.paused(), _autocast(config, cache=False):
                out = forward(*a, **k)
            leaves, ospec = tree_flatten(out)
            shapes["out"] = (leaves, ospec)
            ctx.packed, freed = _off.pack_saved(sim, offloaded, saved) if offloaded else ([], 0)
            with counter.paused():
                ctx.keep = torch.empty(plan.saved_bytes - freed, dtype=torch.uint8)
            counter.bytes += plan.saved_bytes  # (the counter has always counted this buffer)
            return tuple(t for t in leaves if isinstance(t, torch.Tensor))

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            back = [sim.unpack(p) for p in ctx.packed]  # offloaded: copied back, held
            held = sum(p.host.nbytes for p in ctx.packed)
            ctx.keep = None  # bwd_peak counts the saved tensors while the graph still reads them
            counter.add_plan(plan, "bwd")
            with counter.paused():
                ins = [torch.empty_like(flat[i]) for i in grad_in]
                ps = [torch.empty_like(p) for p in params]
                made = sum(t.numel() * t.element_size() for t in ins + ps)
                transient = torch.empty(max(plan.bwd_peak - made - held, 0), dtype=torch.uint8)
                del transient, back
            ctx.packed = None
            return (*ins, *ps)

    outs = StandIn.apply(*[flat[i] for i in grad_in], *params)
    leaves, ospec = shapes["out"]
    it = iter(outs)
    return tree_unflatten([next(it) if isinstance(t, torch.Tensor) else t for t in leaves], ospec)
