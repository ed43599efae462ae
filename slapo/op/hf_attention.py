"""Swap the attention *core* of one HF attention module (BERT, RoBERTa, GPT-2, LLaMA, ...).

How HF 5.x routes attention: each attention module computes q, k, v itself and then calls
`ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)`.
We register one extra entry, "slapo_core", that forwards the call to `module.attn_core` (an
`AttentionCore` child module). `use_attention_core(m, core)` returns a twin of `m`: same class,
same parameter and child objects, but its own shallow copy of `config` whose
`_attn_implementation` is "slapo_core", plus the core as a child. Nothing else in the model changes
(other layers keep their implementation; state-dict keys are unchanged since cores have no
parameters), so the twin can be installed with a schedule's `.replace()`.

The mask the core receives is built by the *model* for its own implementation: an additive float
mask for "eager", a bool mask or None (plus `is_causal`) for "sdpa". Cores accept both, and the
mask's kind tells `SDPAttention` which of HF's definitions of a fully masked row to reproduce
(eager: uniform attention; SDPA: zeros), so a swapped core trains left padding as the model did.
"""

from __future__ import annotations

import ast
import copy
import inspect
import sys
import textwrap
from typing import Any

from torch import nn

from ..errors import SchedulingError
from .attention_core import UNCOMPUTED, AttentionCore

SLAPO_ATTN = "slapo_core"
_registered = False


def _slapo_attention(module: nn.Module, query, key, value, attention_mask, **kwargs: Any):
    core = getattr(module, "attn_core", None)
    if not isinstance(core, AttentionCore):
        raise SchedulingError(
            type(module).__name__,
            f"config._attn_implementation is {SLAPO_ATTN!r} but the module has no `attn_core`.",
            "create the module with slapo.op.use_attention_core(module, core).",
        )
    return core(module, query, key, value, attention_mask, **kwargs)


def register_slapo_attention() -> None:
    """Add the "slapo_core" entry to HF's global attention registry (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(SLAPO_ATTN, _slapo_attention)
    _registered = True


def is_hf_attention(module: nn.Module) -> bool:
    """True for HF modules that dispatch through the attention-interface registry."""
    cfg = getattr(module, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation"):
        return False
    src = sys.modules.get(type(module).__module__)
    return (
        src is not None
        and hasattr(src, "ALL_ATTENTION_FUNCTIONS")
        and "Attention" in type(module).__name__
    )


_CALL_INPUTS: dict[type, list[tuple[str, str, str | None]]] = {}


def _call_inputs(cls: type) -> list[tuple[str, str, str | None]]:
    """(name, source, `self` attribute or None) of each `UNCOMPUTED` keyword that `cls.forward`
    passes to a call (its attention function's), read once per class from its source."""
    if cls not in _CALL_INPUTS:
        found = []
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls.forward)))
        except (OSError, TypeError, SyntaxError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if not isinstance(node, ast.Call):
                continue
            for kw in node.keywords:
                if kw.arg in UNCOMPUTED:
                    v = kw.value
                    attr = v.attr if isinstance(v, ast.Attribute) and isinstance(
                        v.value, ast.Name) and v.value.id == "self" else None
                    found.append((kw.arg, ast.unparse(v), attr))
        _CALL_INPUTS[cls] = found
    return _CALL_INPUTS[cls]


def uncomputed_inputs(module: nn.Module) -> list[str]:
    """What HF attention `module` passes its attention function that no Slapo core computes
    (`attention_core.UNCOMPUTED`), as `name=<source>`: a logit soft-cap, attention sinks, a
    sparse indexer's selection. Read from the class's source so a schedule refuses before
    anything changes rather than at the first forward (the core's own check). An input given as
    `self.<attr>` that is None on this module (MiMo-V2's full-attention layers have no sinks, a
    Gemma 2 configured without soft-capping) is not listed: the core computes that attention."""
    from ..module_patch import original_class

    return [f"{name}={src}" for name, src, attr in _call_inputs(original_class(module))
            if attr is None or getattr(module, attr, None) is not None]


def use_attention_core(module: nn.Module, core: AttentionCore, path: str = "") -> nn.Module:
    """Return a twin of HF attention `module` whose attention core is `core` (see module doc).

    The original module is not modified. Raises SchedulingError for modules that do not route
    through HF's attention registry, or that use a path the core cannot reproduce (GPT-2's
    `reorder_and_upcast_attn`).
    """
    if not is_hf_attention(module):
        raise SchedulingError(
            path,
            f"{type(module).__name__} does not call HF's attention-interface registry.",
            "target the HF attention module itself (e.g. BertSelfAttention, GPT2Attention, "
            "LlamaAttention), or use slapo.op.SelfAttention for models written from scratch.",
        )
    if getattr(module, "reorder_and_upcast_attn", False):
        raise SchedulingError(
            path,
            "GPT-2 attention with reorder_and_upcast_attn=True bypasses the attention registry.",
            "set config.reorder_and_upcast_attn=False or keep this layer's attention.",
        )
    dropped = [] if getattr(core, "runs_model_function", False) else uncomputed_inputs(module)
    if dropped:
        raise SchedulingError(
            path,
            f"{type(module).__name__} passes {', '.join(dropped)} to its attention function, "
            f"which {type(core).__name__} does not compute (it would be dropped).",
            "keep this module's own attention (for `model_schedule.apply`: leave `attention` "
            "unset).",
        )
    register_slapo_attention()
    twin = copy.copy(module)
    # copy.copy shares the containers of nn.Module state; give the twin its own ones.
    for name, value in list(vars(twin).items()):
        if name.startswith("_") and isinstance(value, (dict, set, list)):
            twin.__dict__[name] = copy.copy(value)
    cfg = copy.copy(module.config)
    cfg._attn_implementation_internal = SLAPO_ATTN  # not the setter: sub-configs stay shared
    twin.__dict__["config"] = cfg
    if "attn_core" in twin._modules:
        del twin._modules["attn_core"]
    twin.attn_core = core
    return twin
