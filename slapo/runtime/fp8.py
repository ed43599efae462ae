"""FP8 training (`precision="fp8"`): torchao's float8 matmul in the GEMMs that gain, bf16 elsewhere.

What `precision="fp8"` does, on top of what "bf16" does (autocast to bf16, fp32 master weights
and optimizer state, FSDP2 all-gathers in bf16): every selected Linear / HF Conv1D multiplies
through torchao's float8 matmul (`torchao.float8`, the library torchtitan uses). Its input,
weight and output gradient are cast to FP8 with *dynamic* scales (computed from the tensor at
each call: tensorwise, one scale per tensor, by default; rowwise on request) and the three
GEMMs of forward and backward run in FP8; the weights themselves stay fp32.

Why a GEMM seam and not torchao's module swap (`convert_to_float8_training`): Slapo's tensor
parallelism keeps the module objects (`shard` slices the weight in place, `sync` installs a
kernel that reduces before the bias, hooks and schedule nodes point at the module). A new
`Float8Linear` object would drop all of that, and its forward would be bypassed by the
row-parallel kernel anyway. So the FP8 matmul goes where every Linear-like GEMM of Slapo is
made, `sharding.local_gemm` (`module_meta(mod)["gemm"]`), and a module without a kernel gets the
bias-after-GEMM kernel with no reduction. The same module, parameters, names and state dict.

**TP**: `build` converts after the schedule was sharded, so the GEMM sees this rank's shard and
its scales are computed per shard (a column shard's weight, a row shard's input and weight),
then the row-parallel kernel all-reduces the FP8 GEMM's bf16 output. **FSDP2**: the weights are
all-gathered in bf16 (`MixedPrecisionPolicy`) and cast to FP8 per GEMM (torchao's FP8
all-gather is not used). **Pipelines**: each rank converts its own stages.

**Where it runs**: on CUDA devices with FP8 tensor cores (compute capability 8.9 and up: Ada,
Hopper, Blackwell); a CUDA device without them is refused (the emulation would be far slower
than bf16, never what one wants on a GPU). On CPU torchao's *emulation* (`emulate=True`: the
same casts and scales, the GEMM in fp32 on the FP8 values), so every test runs without a GPU and
gives the numbers a GPU gives up to the GEMM's accumulation order.

**Which GEMMs** (`Float8Config`): a Linear or HF Conv1D whose weight (this rank's shard) has both
dimensions multiples of 16 (what FP8 tensor cores take) and at least `min_dim`; never the output
embedding (the LM head: logits feed the loss, where FP8's 3-bit mantissa costs the most) and never
a module whose weight is tied to another's; names in `skip` are left out too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from .. import module_patch, sharding
from ..errors import SchedulingError
from ..primitives.decompose import BiasFreeKernel

RECIPES = ("tensorwise", "rowwise")
INSTALL = "pip install slapo[fp8]  (torchao)"


class _QuietGpuLibraries(logging.Filter):
    """Drop torchao's import-time "Failed to load .../_C_*.so" warnings: its CUDA kernel
    libraries cannot load on a CPU-only torch, which the float8 path does not need. transformers
    imports torchao whenever it is installed, so without this every process printed them."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Failed to load") and "/torchao/_C" in message)


class _QuietTorchaoEnums(logging.Filter):
    """Drop torch 2.13's deprecation warning for torchao's own `register_constant` calls on its
    enums (`KernelPreference`, `ScaleCalculationMode`), printed on import: a torchao matter, not
    the user's, and it broke every run's clean output (torchrun prefixes it with `[rankN]:`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not ("is an Enum subclass" in str(record.msg) and args
                    and getattr(args[0], "__module__", "").startswith("torchao"))


logging.getLogger("torchao").addFilter(_QuietGpuLibraries())
logging.getLogger("torch.utils._pytree").addFilter(_QuietTorchaoEnums())


@dataclass(frozen=True)
class Float8Config:
    """Which GEMMs `precision="fp8"` converts, and how they are scaled.

    - `recipe`: "tensorwise" (one dynamic scale per tensor: the fastest) or "rowwise" (one
      scale per row: more accurate with outliers, a little slower on a GPU).
    - `min_dim`: a GEMM with a weight dimension (of this rank's shard) below this stays bf16:
      the casts cost more than the FP8 GEMM saves (torchao's H100 tables show the gain from
      about 1024 up; 64 keeps the default usable on small models and tests).
    - `skip`: module paths (or path suffixes, `"lm_head"`, `"mlp.down_proj"`) to leave in bf16.
    - `skip_output_embedding`: leave the model's output embedding (`get_output_embeddings()`)
      in bf16 (default True). Tied weights are always left out.
    """

    recipe: str = "tensorwise"
    min_dim: int = 64
    skip: tuple[str, ...] = ()
    skip_output_embedding: bool = True

    def check(self) -> None:
        """Refuse a config that would silently convert something else than asked."""
        if self.recipe not in RECIPES:
            raise SchedulingError("", f"fp8 recipe {self.recipe!r} is not supported.",
                                  f"use one of {', '.join(RECIPES)}.")
        if not isinstance(self.min_dim, int) or isinstance(self.min_dim, bool) \
                or self.min_dim < 16:
            raise SchedulingError("", f"fp8 min_dim={self.min_dim!r} must be an int >= 16 "
                                  "(FP8 GEMMs take dimensions that are multiples of 16).",
                                  "pass e.g. Float8Config(min_dim=64).")
        if isinstance(self.skip, str) or not all(isinstance(s, str) for s in self.skip):
            raise SchedulingError("", f"fp8 skip={self.skip!r} must be a tuple of module paths.",
                                  "pass e.g. skip=('lm_head', 'mlp.down_proj').")


def check_fp8(config: object, device_type: str) -> Float8Config:
    """The checks of `precision="fp8"` before anything changes: the config, torchao imports,
    the device has FP8 (or is the CPU, emulated). Returns the config (default if None)."""
    config = Float8Config() if config is None else config
    if not isinstance(config, Float8Config):
        raise SchedulingError("", f"fp8={config!r} is not a Float8Config.",
                              "pass slapo.runtime.fp8.Float8Config(...), or nothing.")
    config.check()
    _torchao()
    _check_device(device_type)
    return config


def _torchao():
    """torchao's float8 pieces, imported on first use (an optional dependency)."""
    try:
        from torchao.float8 import float8_linear
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    except ImportError as e:
        raise SchedulingError("", f"precision='fp8' needs torchao, which does not import "
                              f"here ({e}).", f"{INSTALL}, or use precision='bf16'.") from None
    return float8_linear.matmul_with_hp_or_float8_args, Float8LinearConfig, LinearMMConfig, \
        ScaledMMConfig


def _check_device(device_type: str) -> None:
    if device_type == "cpu":
        return  # emulated
    if device_type != "cuda":
        raise SchedulingError("", f"precision='fp8' on a {device_type!r} device: FP8 runs on "
                              "CUDA (compute capability 8.9+) or emulated on the CPU.",
                              "use a cuda or cpu device, or precision='bf16'.")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise SchedulingError("", f"precision='fp8': this GPU (compute capability "
                              f"{major}.{minor}) has no FP8 tensor cores (8.9+: Ada, Hopper, "
                              "Blackwell).", "use precision='bf16' on this GPU.")


class Float8Gemm:
    """The bias-free GEMM of one Linear / Conv1D in FP8 (`sharding.local_gemm`'s override).

    Under autocast the input is first cast to autocast's dtype (what `F.linear` would compute
    in), so the FP8 GEMM's output has the dtype the bf16 run would have."""

    def __init__(self, recipe: str, emulate: bool):
        matmul, config_cls, mm_config_cls, scaled_cls = _torchao()
        self.recipe, self.emulate = recipe, emulate
        self.config = dataclasses.replace(config_cls.from_recipe_name(recipe), emulate=emulate)
        scaled = [scaled_cls(emulate, g.use_fast_accum, False, self.config.pad_inner_dim)
                  for g in (self.config.gemm_config_output, self.config.gemm_config_grad_input,
                            self.config.gemm_config_grad_weight)]
        self.mm_config = mm_config_cls(*scaled)
        self._matmul = matmul

    def __call__(self, mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        w_t = mod.weight if sharding._is_hf_conv1d(mod) else mod.weight.t()  # (in, out)
        return self._matmul.apply(x, w_t, self.mm_config, self.config)

    def __repr__(self) -> str:
        return f"Float8Gemm({self.recipe!r}{', emulated' if self.emulate else ''})"

    def __deepcopy__(self, memo):  # stateless: configs only
        return self


def convert(modules: list[nn.Module], root: nn.Module, config: Float8Config,
            device_type: str) -> list[str]:
    """Give every selected Linear / Conv1D under `modules` the FP8 GEMM; return their paths
    (relative to their module in `modules`). `root` is the whole model (its output embedding
    and tied weights are found there, also when `modules` are pipeline stages)."""
    gemm = Float8Gemm(config.recipe, emulate=device_type == "cpu")
    left_out = _left_out(root, config)
    done = []
    for top in modules:
        for path, mod in top.named_modules():
            if id(mod) in left_out or not _selected(mod, path, config):
                continue
            if module_patch.kernel(mod) is None:  # the GEMM, then the bias once
                kernel = sharding.Conv1DKernel() if sharding._is_hf_conv1d(mod) \
                    else sharding.LinearKernel()
                module_patch.set_kernel(mod, kernel)
            module_patch.module_meta(mod, create=True)["gemm"] = gemm
            done.append(path)
    return done


@contextlib.contextmanager
def converted(model: nn.Module, config: Float8Config, device_type: str) -> Iterator[list[str]]:
    """`convert` for the duration of the block, then every touched module as it was (its
    kernel and its `gemm` entry): `Verify(precision="fp8")` runs the user's scheduled model
    with FP8 GEMMs without leaving them on it."""
    before = {id(m): (m, module_patch.kernel(m), module_patch.module_meta(m).get("gemm", _NONE))
              for m in model.modules()}
    try:
        yield convert([model], model, config, device_type)
    finally:
        for m, kernel, gemm in before.values():
            meta = module_patch.module_meta(m)
            if gemm is _NONE:
                meta.pop("gemm", None)
            else:
                meta["gemm"] = gemm
            if module_patch.kernel(m) is not kernel:
                module_patch.set_kernel(m, kernel)


_NONE = object()  # "no entry" (a `gemm` entry may hold None)


def _gemm_module(mod: nn.Module) -> bool:
    """A plain Linear or HF Conv1D whose forward is (or is a kernel over) `local_gemm`."""
    cls = module_patch.original_class(mod)
    if not (cls is nn.Linear or sharding._is_hf_conv1d(mod)):
        return False
    k = module_patch.kernel(mod)
    return k is None or isinstance(k, (sharding.Conv1DKernel, sharding.LinearKernel,
                                       BiasFreeKernel))


def _selected(mod: nn.Module, path: str, config: Float8Config) -> bool:
    if not _gemm_module(mod) or mod.weight.dim() != 2:
        return False
    # a PEFT adapter layer holds the projection as `base_layer`: `skip` names it as before
    names = {path, path.removesuffix(".base_layer")}
    if any(n == s or n.endswith("." + s) for n in names for s in config.skip):
        return False
    return all(d % 16 == 0 and d >= config.min_dim for d in mod.weight.shape)


def _left_out(root: nn.Module, config: Float8Config) -> set[int]:
    """Modules never converted: the output embedding, and every owner of a tied weight."""
    out: set[int] = set()
    if config.skip_output_embedding and hasattr(root, "get_output_embeddings"):
        head = root.get_output_embeddings()
        if isinstance(head, nn.Module):
            out.add(id(head))
            base = getattr(head, "base_layer", None)  # a PEFT adapter on the head: its GEMM
            if isinstance(base, nn.Module):
                out.add(id(base))
    owners: dict[int, list[nn.Module]] = {}
    for mod in root.modules():
        for p in mod.parameters(recurse=False):
            owners.setdefault(id(p), []).append(mod)
    for mods in owners.values():
        if len(mods) > 1:
            out.update(id(m) for m in mods)
    return out


def fp8_gemm(mod: nn.Module) -> Float8Gemm | None:
    """The FP8 GEMM `convert` gave `mod`, or None."""
    gemm = module_patch.module_meta(mod).get("gemm")
    return gemm if isinstance(gemm, Float8Gemm) else None


__all__ = ["RECIPES", "Float8Config", "Float8Gemm", "check_fp8", "convert", "converted",
           "fp8_gemm"]
