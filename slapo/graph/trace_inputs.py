"""The traced module's inputs: placeholders bound to example values, non-tensor inputs
specialised and guarded (`_bind_inputs`), and `capture_inputs`, which records the example
inputs a submodule receives in a real call."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate

from .trace_common import (
    _DATA,
    _UNKNOWN,
    _VALUE,
    _is_cache,
    _is_empty_cache,
    _TraceFailure,
    guard_absent,
    guard_equal,
    guard_kwargs,
)

if TYPE_CHECKING:
    from .tracer import SlapoTracer


def _clone(v):
    return map_aggregate(v, lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t) \
        if isinstance(v, (tuple, list, dict)) else (v.detach().clone()
                                                    if isinstance(v, torch.Tensor) else v)


def _is_tensor_tree(v) -> bool:
    if isinstance(v, torch.Tensor):
        return True
    if isinstance(v, (tuple, list)) and v:
        return all(_is_tensor_tree(x) for x in v)
    return False


def _bind_inputs(tracer: SlapoTracer, root: nn.Module, example, concrete: dict):
    """Create placeholders for `root.forward`'s parameters; return (fn, args) for tracing."""
    fwd = inspect.unwrap(type(root).forward)
    sig = inspect.signature(fwd)
    params = list(sig.parameters.values())[1:]
    ex_args, ex_kwargs = example if example is not None else ((), {})
    try:
        bound = inspect.signature(root.forward).bind_partial(*ex_args, **ex_kwargs).arguments
    except TypeError as e:
        raise _TraceFailure("the module's inputs", "example_inputs", f"example inputs do not "
                            f"match the forward signature: {e}") from None
    call_args: list = [root]
    call_kwargs: dict = {}
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            if bound.get(p.name):
                raise _TraceFailure(f"*{p.name}", "forward signature", "variadic positional "
                                    "inputs are not supported")
            continue
        if p.kind is p.VAR_KEYWORD:
            kw_proxy = tracer.create_proxy("placeholder", "**" + p.name, (), {})
            kw_proxy.node.meta[_DATA] = True
            seen = dict(bound.get(p.name, {}))
            for k, v in seen.items():
                call_kwargs[k] = _input_value(tracer, kw_proxy, k, v, getter=True)
            tracer.create_proxy("call_function", guard_kwargs,
                                (kw_proxy, tuple(seen), f"{type(root).__name__}.forward"), {})
            continue
        default = () if p.default is p.empty else (p.default,)
        ph = tracer.create_proxy("placeholder", p.name, default, {})
        ph.node.meta[_DATA] = True
        if p.name in concrete:
            value = concrete[p.name]
        elif p.name in bound:
            value = bound[p.name]
        elif p.default is not p.empty:
            value = p.default
        else:
            value = _UNKNOWN  # a required input without an example: a tensor of unknown value
        v = _input_value(tracer, ph, p.name, value, getter=False,
                         force_const=p.name in concrete)
        if p.kind is p.KEYWORD_ONLY:
            call_kwargs[p.name] = v
        else:
            call_args.append(v)
    fn = type(root).forward

    def run(*a):
        return fn(*a, **call_kwargs)

    return run, call_args


def _input_value(tracer: SlapoTracer, proxy: fx.Proxy, name: str, value, *, getter: bool,
                 force_const: bool = False):
    """What the traced forward receives for one input, plus the guard that keeps it honest."""
    what = f"input {name!r}"
    if getter:  # an entry of **kwargs
        if not force_const and _is_tensor_tree(value):
            p = tracer.create_proxy("call_method", "get", (proxy, name), {})
            p.node.meta[_VALUE] = _clone(value)
            p.node.meta[_DATA] = True
            return p
        src = tracer.create_proxy("call_method", "get", (proxy, name), {})
        src.node.meta[_VALUE] = value
        src.node.meta[_DATA] = True
        proxy = src
    if value is _UNKNOWN:
        proxy.node.meta[_VALUE] = _UNKNOWN
        return proxy
    if not force_const and _is_tensor_tree(value):
        proxy.node.meta[_VALUE] = _clone(value)
        return proxy
    if _is_cache(value) and not _is_empty_cache(value):
        raise _TraceFailure(what, "example_inputs", "a KV cache that already holds keys/values "
                            "cannot be traced (graphs are for training: use_cache=False)")
    if value is None or _is_cache(value):
        tracer.create_proxy("call_function", guard_absent, (proxy, what), {})
        return None
    if isinstance(value, (bool, int, float, str)):
        tracer.create_proxy("call_function", guard_equal, (proxy, value, what), {})
        return value
    raise _TraceFailure(what, "example_inputs", f"an input of type {type(value).__name__} cannot "
                        "be traced (only tensors, tuples of tensors, None, bool/int/float/str "
                        "and empty KV caches)")


def capture_inputs(model: nn.Module, paths, *args, **kwargs) -> dict[str, tuple[tuple, dict]]:
    """Run `model(*args, **kwargs)` once (no grad) and return the (args, kwargs) each submodule
    in `paths` received: the `example_inputs` for tracing it."""
    paths = [paths] if isinstance(paths, str) else list(paths)
    seen: dict[str, tuple[tuple, dict]] = {}
    handles = []
    for p in paths:
        def hook(mod, a, k, p=p):
            seen.setdefault(p, (tuple(_clone(x) for x in a), {n: _clone(v) for n, v in k.items()}))
        handles.append(model.get_submodule(p).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [p for p in paths if p not in seen]
    if missing:
        raise ValueError(f"submodules {missing} were not called by this forward")
    return seen
