"""`compile`: compile one module (a transformer block, usually) with `torch.compile`.

Why regional compilation (torchtitan's recipe) rather than `torch.compile(model)`:
- identical blocks share one compiled graph, so compile time does not grow with depth;
- it composes with the rest of the schedule: the block's sharded weights, its `sync`
  collectives, `checkpoint` (plain or selective) and `fork_rng` run inside the compiled call,
  and pipeline stages hold compiled blocks;
- the model's structure is untouched: `nn.Module.compile` keeps the same module object, so
  parameter names, `state_dict` keys and optimizer state are those of the original model (no
  `_orig_mod.` prefix).

Copies: torch drops the compiled call when a module is copied or pickled (`__getstate__`), so
a `deepcopy` of a scheduled model (Verify's reference, say) runs its own weights uncompiled:
correct, and compiled again only if scheduled again.

Recompilation: dynamo specialises on Python values a block reads. HF layers read their
`layer_idx` only to update a KV cache, so train with `use_cache=False` (HF does the same under
gradient checkpointing); `model_schedule.apply(compile_blocks=True)` sets it on the config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..errors import SchedulingError
from ._util import refuse_in_export_capture
from .base import Primitive, register_primitive

MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def is_compiled(module: nn.Module) -> bool:
    """True when `module.compile()` (or this primitive) compiled the module's call."""
    return getattr(module, "_compiled_call_impl", None) is not None


@register_primitive
class CompilePrimitive(Primitive):
    """Compile this module's call with `torch.compile` (regional compilation; see module doc).

    `backend` ("inductor", or any registered dynamo backend such as "aot_eager"), `mode`,
    `fullgraph` and `dynamic` are `torch.compile`'s. `dynamic=False` (default) specialises on
    shapes: training with fixed batch and sequence compiles once.
    """

    name = "compile"

    @classmethod
    def validate(cls, sch, backend: str | Any = "inductor", mode: str | None = None,
                 fullgraph: bool = False, dynamic: bool | None = False):
        refuse_in_export_capture(sch, "compile", "compile the module that holds the capture.")
        if sch.parent is None and not isinstance(sch.mod, nn.Module):
            raise SchedulingError(sch.path, "compile needs an nn.Module.", "")
        if is_compiled(sch.mod):
            raise SchedulingError(sch.path, "this module is already compiled.",
                                  "remove the second compile call.")
        if mode not in MODES:
            raise SchedulingError(sch.path, f"unknown compile mode {mode!r}.",
                                  f"use one of {', '.join(map(repr, MODES))}.")
        if not (isinstance(backend, str) or callable(backend)):
            raise SchedulingError(sch.path, f"backend must be a name or a callable, got "
                                  f"{backend!r}.", "pass e.g. backend='inductor'.")
        if isinstance(backend, str) and backend not in torch._dynamo.list_backends(None):
            raise SchedulingError(sch.path, f"unknown torch.compile backend {backend!r}.",
                                  f"use one of {', '.join(torch._dynamo.list_backends(None))}.")
        _check_flags(sch, fullgraph, dynamic)
        _check_eager_backend(sch, backend)
        inner = [p for p, m in sch.mod.named_modules() if p and is_compiled(m)]
        if inner:
            raise SchedulingError(sch.path, f"submodule {sch.path}.{inner[0]} is already "
                                  "compiled; nested regions compile the inner one twice.",
                                  "compile either the block or its parts, not both.")
        outer = _compiled_ancestor(sch)
        if outer is not None:
            raise SchedulingError(sch.path, f"it is inside {outer or '<root>'}, which is already "
                                  "compiled; nested regions compile this one twice.",
                                  "compile either the block or its parts, not both.")

    @classmethod
    def apply(cls, sch, backend: str | Any = "inductor", mode: str | None = None,
              fullgraph: bool = False, dynamic: bool | None = False):
        opts = {"backend": backend, "mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
        if mode is None:
            del opts["mode"]
        sch.mod._compiled_call_impl = compiled_call(sch.mod, opts)  # as nn.Module.compile


# dynamo refuses a side effect inside a checkpointed region (it would have to replay it in the
# recomputation), and falls back to running the whole checkpoint eagerly. Slapo's wrappers
# inside checkpointed blocks have side effects that need no replay: `reduce_param_grads` swaps
# a parameter for its reducing view and back (net nothing), the TP-RNG replay flips a flag the
# compiled recomputation never reads. Seen before this switch: every checkpointed block under
# sequence parallelism (all SP families) and Qwen3's under TP ran uncompiled (0 graphs).
# torchtitan sets the same switch globally when it compiles; here it holds only while a
# compiled block runs. A torch without it keeps the eager fallback (correct, slower).
_CHECKPOINT_SIDE_EFFECTS = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def compiled_call(module: nn.Module, opts: dict[str, Any]):
    """`torch.compile(module._call_impl, **opts)`, run with `_CHECKPOINT_SIDE_EFFECTS` on (set
    and put back around each call: ~5 us, a quarter of `config.patch`'s, on every block call)."""
    compiled = torch.compile(module._call_impl, **opts)
    config = torch._dynamo.config
    if not hasattr(config, _CHECKPOINT_SIDE_EFFECTS):
        return compiled

    def call(*args, **kwargs):
        before = getattr(config, _CHECKPOINT_SIDE_EFFECTS)
        setattr(config, _CHECKPOINT_SIDE_EFFECTS, True)
        try:
            return compiled(*args, **kwargs)
        finally:
            setattr(config, _CHECKPOINT_SIDE_EFFECTS, before)

    return call


def _check_eager_backend(sch, backend) -> None:
    """torch 2.11's dynamo `eager` backend cuts the gradient at a tensor-parallel forward
    all-reduce (an autograd.Function whose forward calls a functional collective): everything
    before it gets zero gradient from that branch, silently (found running the suite on torch
    2.11, the GPU image's, on CPU: compiled TP blocks trained with wrong gradients and the same
    loss; `aot_eager` and `inductor` are exact there, 2.13's `eager` too)."""
    if backend == "eager" and sch.tp_size > 1 and \
            torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        raise SchedulingError(sch.path, f"torch {torch.__version__}'s 'eager' compile backend "
                              "drops the gradient through tensor-parallel all-reduces (it would "
                              "train silently wrong).", "use backend='aot_eager' (the same "
                              "eager kernels, through AOTAutograd) or 'inductor', or "
                              "torch >= 2.13.")


def _check_flags(sch, fullgraph, dynamic) -> None:
    """torch.compile takes any truthy `fullgraph` and asserts deep inside on a non-bool
    `dynamic`: both are checked here, where the schedule path can be named."""
    if not isinstance(fullgraph, bool):
        raise SchedulingError(sch.path, f"fullgraph must be True or False, got {fullgraph!r}.",
                              "pass fullgraph=False (default) or True.")
    if not (dynamic is None or isinstance(dynamic, bool)):
        raise SchedulingError(sch.path, f"dynamic must be None, True or False, got "
                              f"{dynamic!r}.", "pass dynamic=False (default: fixed shapes).")


def _compiled_ancestor(sch) -> str | None:
    """Path of the nearest compiled module above this node (None: none is)."""
    node = sch.parent
    while node is not None:
        if is_compiled(node.mod):
            return node.path
        node = node.parent
    return None
