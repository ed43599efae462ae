"""HF attention dispatch as one graph node: while tracing, the attention-interface functions
(`ALL_ATTENTION_FUNCTIONS[...]`, `eager_attention_forward`) become `AttentionCall` modules, so a
schedule can find and replace the attention call as a whole."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from .trace_common import _fetch


class AttentionCall(nn.Module):
    """One HF attention-interface call (eager/sdpa/flash...) kept as a single graph node.

    The function receives this module as its `module` argument, so the plain attributes the
    attention functions read (`is_causal`, `scaling`, `num_key_value_groups`, `config`, ...) are
    copied from the attention module; `training` follows `model.train()/eval()` as usual.
    """

    def __init__(self, fn: Callable, owner: nn.Module):
        super().__init__()
        self.fn = fn
        for k, v in vars(owner).items():
            if not k.startswith("_") and k != "training" and not isinstance(v, (nn.Module,
                                                                             torch.Tensor)):
                self.__dict__[k] = v
        self.train(owner.training)

    def forward(self, *args, **kwargs):
        return self.fn(self, *args, **kwargs)

    def extra_repr(self) -> str:
        return getattr(self.fn, "__name__", repr(self.fn))



def _first_proxy(obj) -> fx.Proxy | None:
    found: list = []

    def visit(a):
        if isinstance(a, fx.Proxy):
            found.append(a)
        elif isinstance(a, (tuple, list)):
            for x in a:
                visit(x)
        elif isinstance(a, dict):
            for x in a.values():
                visit(x)

    visit(obj)
    return found[0] if found else None


def _attention_leaf(fn: Callable) -> Callable:
    """Wrap an HF attention function: with Proxy inputs it becomes an `AttentionCall` node of
    the tracer that owns the proxies (nested traces share the patched function)."""
    if getattr(fn, "_slapo_attention_leaf", False) or not callable(fn):
        return fn

    @functools.wraps(fn)
    def leaf(module, *args, **kwargs):
        from .tracer import SlapoTracer  # here: the tracer module imports this one

        proxy = _first_proxy((args, kwargs))
        tracer = getattr(proxy, "tracer", None)
        if not isinstance(tracer, SlapoTracer) or not isinstance(module, nn.Module) or \
                tracer._evaluating:
            return fn(module, *args, **kwargs)
        owner = tracer.path_of_module(module)
        base = f"{owner}.attention_fn" if owner else "attention_fn"
        target, i = base, 1
        while target in tracer.extra_modules or _has_attr(tracer.root, target):
            target, i = f"{base}_{i}", i + 1
        tracer.extra_modules[target] = AttentionCall(fn, module)
        return tracer.create_proxy("call_module", target, args, kwargs)

    leaf._slapo_attention_leaf = True
    return leaf


@contextlib.contextmanager
def _hf_attention_as_leaf(root: nn.Module):
    """Temporarily route HF attention-interface functions through `AttentionCall` nodes."""
    try:
        from transformers import modeling_utils
    except Exception:  # noqa: BLE001 - transformers absent or broken: nothing to patch
        yield
        return
    mapping = type(modeling_utils.ALL_ATTENTION_FUNCTIONS)._global_mapping
    saved_mapping = dict(mapping)
    patched_globals: list[tuple[dict, str, Any]] = []
    for m in root.modules():
        g = getattr(sys.modules.get(type(m).__module__), "__dict__", {})
        fn = g.get("eager_attention_forward")
        if fn is not None and not getattr(fn, "_slapo_attention_leaf", False):
            patched_globals.append((g, "eager_attention_forward", fn))
            g["eager_attention_forward"] = _attention_leaf(fn)
    try:
        for k, v in saved_mapping.items():
            mapping[k] = _attention_leaf(v)
        yield
    finally:
        mapping.clear()
        mapping.update(saved_mapping)
        for g, name, fn in patched_globals:
            g[name] = fn


def _has_attr(root: nn.Module, target: str) -> bool:
    try:
        _fetch(root, target)
        return True
    except AttributeError:
        return False
