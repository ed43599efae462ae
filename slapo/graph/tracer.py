"""Trace one submodule into a `torch.fx.GraphModule` whose leaves stay `call_module` nodes.

Why a custom fx tracer (and not torch.export / dynamo re-structured by `nn_module_stack`):
the graph a schedule works on must (1) keep leaf submodules as real `call_module` nodes so
`sch["mlp.c_fc"]`, their hooks (sync), kernels (shard, decompose) and wrappers (checkpoint) keep
working, (2) keep parameters as `get_attr` of the *same* tensors under the *same* names
(state_dict keys, tied weights, optimizer state, `Verify`), (3) be written in torch-level ops
(`F.gelu`, `x + b`) so a pattern function matches it structurally, and (4) stay shape-generic
(any batch/sequence length). Plain `torch.fx.symbolic_trace` gives all four but fails on every
transformers-5 block; export/dynamo capture works but produces ATen/flattened graphs with lifted
parameters, which would have to be re-assembled. So we keep fx and fix why it fails on HF code:

- `(*x.shape[:-1], -1, d)` iterates a Proxy, and `**kwargs` in `forward` breaks fx's argument
  handling ("co_varnames is too small"). We run the module on example inputs *while* tracing
  (each node carries its example value), so iterating a shape, `len()` and shape-only `if`s are
  resolved from the values; every such decision is recorded as a guard node that raises at run
  time if a later call would take another path. Control flow on tensor *data* is an error.
- Non-tensor inputs (None, bools, KV caches) are specialised to their example value (guarded).
- The HF attention-interface call (`ALL_ATTENTION_FUNCTIONS[...]`/`eager_attention_forward`)
  becomes one `call_module` node (`AttentionCall`), so it can be found and replaced as a whole.

Failures raise `TraceError` naming the tracer, the offending operation and the model's source
line, never a bare fx traceback.

The parts: this file (the tracer and the `GraphModule` it builds), `trace_inputs.py` (binding
and specialising the inputs), `hf_attention.py` (the attention call as one node),
`trace_common.py` (node markers, run-time guards, source lines).
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.node import map_aggregate

from .. import module_patch, sharding
from ..errors import TraceError
from .hf_attention import _hf_attention_as_leaf
from .trace_common import (
    _DATA,
    _UNKNOWN,
    _VALUE,
    _fetch,
    _frame_of,
    _TraceFailure,
    _user_frame,
    guard_absent,
    guard_equal,
    guard_kwargs,
)
from .trace_inputs import _bind_inputs

_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "is_sparse", "layout"}
_SHAPE_METHODS = {"size", "dim", "numel", "get_device", "is_floating_point", "is_contiguous",
                  "element_size", "ndimension", "nelement"}


class _ValueProxy(fx.Proxy):
    def __len__(self) -> int:
        return self.tracer.proxy_len(self)  # type: ignore[attr-defined]


def _describe(node: fx.Node) -> str:
    if node.op == "call_function":
        return f"{getattr(node.target, '__name__', node.target)}() [node {node.name}]"
    if node.op == "call_method":
        return f".{node.target}() [node {node.name}]"
    if node.op == "call_module":
        return f"submodule {node.target!r} [node {node.name}]"
    return f"{node.op} {node.target!r} [node {node.name}]"


class SlapoTracer(fx.Tracer):
    """fx tracer with leaf submodules, example-value propagation and run-time guards."""

    def __init__(self, is_leaf: Callable[[nn.Module, str], bool], *, flatten: bool,
                 example=None, concrete: dict | None = None):
        super().__init__()
        self.example = example
        self.concrete = dict(concrete or {})
        propagate = example is not None
        self._is_leaf = is_leaf
        self.flatten = flatten
        self.propagate = propagate
        self.extra_modules: dict[str, nn.Module] = {}
        self.subtraced: dict[str, fx.GraphModule] = {}
        self.record_stack_traces = True
        self._evaluating = False

    # ---- leaves and nested traces ------------------------------------------------------------
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return self._is_leaf(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        if self._evaluating:  # computing example values: run the real module, record nothing
            return forward(*args, **kwargs)
        qual = self.path_of_module(m)
        if self.is_leaf_module(m, qual) or self.flatten or isinstance(m, fx.GraphModule):
            if isinstance(m, fx.GraphModule) and not self.flatten:
                return self.create_proxy("call_module", qual, args, kwargs)
            return super().call_module(m, forward, args, kwargs)
        # flatten=False: the child becomes its own GraphModule, called from this graph.
        if qual not in self.subtraced:
            ex_args, ex_kwargs = self._values_of(args), self._values_of(kwargs)
            known = not _contains_unknown((ex_args, ex_kwargs))
            prefix = qual + "."
            self.subtraced[qual] = _trace_fx(
                m, lambda mm, q: self._is_leaf(mm, prefix + q),
                flatten=False, example=(ex_args, ex_kwargs) if known else None)
        return self.create_proxy("call_module", qual, args, kwargs)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self._evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_args_for_root(self, root_fn, is_module, concrete_args=None):
        return _bind_inputs(self, self.root, self.example, self.concrete)

    # ---- values ------------------------------------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _ValueProxy(node, self)

    def _values_of(self, obj):
        """Example values of a structure holding Proxies (map_aggregate does not see them)."""
        if isinstance(obj, fx.Proxy):
            return obj.node.meta.get(_VALUE, _UNKNOWN)
        if isinstance(obj, (tuple, list)):
            return type(obj)(self._values_of(x) for x in obj) if type(obj) in (tuple, list) \
                else obj
        if isinstance(obj, dict):
            return {k: self._values_of(v) for k, v in obj.items()}
        return obj

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None,
                     proxy_factory_fn=None):
        if name is None and kind in ("call_module", "get_attr") and \
                (target == "self" or target.startswith("self.")):
            name = "sub_" + target.replace(".", "_")  # a node named `self` shadows the module
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr,
                                     proxy_factory_fn)
        node = proxy.node
        if self.propagate and kind not in ("placeholder", "output") and _VALUE not in node.meta:
            self._evaluate(node)
        return proxy

    def _evaluate(self, node: fx.Node) -> None:
        args = map_aggregate(node.args, self._node_value)
        kwargs = map_aggregate(node.kwargs, self._node_value)
        data = any(n.meta.get(_DATA, True) for n in node.all_input_nodes)
        if node.op == "call_function" and node.target is getattr and \
                node.args[1] in _SHAPE_ATTRS:
            data = False
        if node.op == "call_method" and node.target in _SHAPE_METHODS:
            data = False
        node.meta[_DATA] = data or node.op in ("get_attr", "call_module")
        if _contains_unknown((args, kwargs)):
            node.meta[_VALUE] = _UNKNOWN
            return
        self._evaluating = True
        try:
            with torch.no_grad():
                node.meta[_VALUE] = self._run(node, args, kwargs)
        except Exception as e:  # noqa: BLE001 - value unknown; fx tracing may still succeed
            node.meta[_VALUE] = _UNKNOWN
            if os.environ.get("SLAPO_TRACE_DEBUG"):
                print(f"[slapo.trace] cannot evaluate {node.format_node()}: {e!r}")
                traceback.print_exc()
        finally:
            self._evaluating = False

    def _node_value(self, a):
        return a.meta.get(_VALUE, _UNKNOWN) if isinstance(a, fx.Node) else a

    def _run(self, node: fx.Node, args, kwargs):
        if node.op == "get_attr":
            return _fetch(self.root, node.target)
        if node.op == "call_function":
            if node.target in (guard_equal, guard_absent, guard_kwargs):
                return None
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
        mod = self.extra_modules.get(node.target) or self.root.get_submodule(node.target)
        return mod(*args, **kwargs)

    # ---- control flow on proxies -----------------------------------------------------------
    def _known(self, obj: fx.Proxy, what: str):
        val = obj.node.meta.get(_VALUE, _UNKNOWN)
        if val is _UNKNOWN:
            hint = ("pass example_inputs= so shapes are known while tracing" if not self.propagate
                    else "its value could not be computed from the example inputs")
            raise _TraceFailure(_describe(obj.node), _user_frame(), f"{what} of a traced value "
                                f"({hint})")
        return val

    def to_bool(self, obj: fx.Proxy) -> bool:
        val = self._known(obj, "Python control flow (if/and/or/not)")
        if obj.node.meta.get(_DATA, True):
            raise _TraceFailure(_describe(obj.node), _user_frame(),
                                "data-dependent control flow (a branch on tensor values)")
        b = bool(val)
        where = _user_frame()
        self.create_proxy("call_function", guard_equal, (obj, val, f"`{where}`"), {})
        return b

    def iter(self, obj: fx.Proxy) -> Iterator:
        val = self._known(obj, "iteration")
        if not hasattr(val, "__len__"):
            raise _TraceFailure(_describe(obj.node), _user_frame(), "iteration over a "
                                f"{type(val).__name__}")
        n = len(val)
        if isinstance(val, torch.Tensor):
            self._guard_len(obj, n)
        return iter([obj[i] for i in range(n)])

    def proxy_len(self, obj: fx.Proxy) -> int:
        val = self._known(obj, "len()")
        n = len(val)
        if isinstance(val, torch.Tensor) or obj.node.meta.get(_DATA, True):
            self._guard_len(obj, n)
        return n

    def _guard_len(self, obj: fx.Proxy, n: int) -> None:
        length = self.create_proxy("call_function", len, (obj,), {})
        self.create_proxy("call_function", guard_equal, (length, n, f"len at `{_user_frame()}`"),
                          {})

    def keys(self, obj: fx.Proxy):
        val = self._known(obj, "** unpacking")
        return list(val.keys())


def _contains_unknown(obj) -> bool:
    found = []
    map_aggregate(obj, lambda a: found.append(True) if a is _UNKNOWN else a)
    return bool(found)


# ------------------------------------------------------------------------------------------------
# entry point
# ------------------------------------------------------------------------------------------------

def default_leaf(m: nn.Module) -> bool:
    """Modules never traced through: torch.nn built-ins (except containers), modules whose
    forward slapo changed (checkpoint/sync kernels), and HF Conv1D."""
    if module_patch.wrappers(m) or module_patch.kernel(m) is not None:
        return True
    if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return False
    cls = module_patch.original_class(m)
    if cls.__module__.startswith(("torch.nn", "torch.ao.nn")) or sharding._is_hf_conv1d(m):
        return True
    return bool(getattr(m, "_slapo_leaf", False))


def _trace_fx(root: nn.Module, is_leaf: Callable[[nn.Module, str], bool], *, flatten: bool,
              example=None, concrete: dict | None = None) -> fx.GraphModule:
    tracer = SlapoTracer(is_leaf, flatten=flatten, example=example, concrete=concrete)
    before = set(vars(root))
    try:
        with _hf_attention_as_leaf(root):
            tracer.trace(root)
        return _to_graph_module(root, tracer)
    finally:
        for k in set(vars(root)) - before:  # fx stashes constants on the root: undo
            del root.__dict__[k]


def _to_graph_module(root: nn.Module, tracer: SlapoTracer) -> fx.GraphModule:
    attrs: dict[str, Any] = {}
    for node in tracer.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            t = node.target
            attrs[t] = tracer.subtraced.get(t) or tracer.extra_modules.get(t) or _fetch(root, t)
    # register in the original order, so state_dict keys keep their order too
    order: dict[str, int] = {}
    for name, _ in root.named_modules(remove_duplicate=False):
        order.setdefault(name, len(order))
    for name, _ in [*root.named_parameters(remove_duplicate=False),
                    *root.named_buffers(remove_duplicate=False)]:
        order.setdefault(name, len(order))
    gm = fx.GraphModule(attrs, tracer.graph, class_name=type(root).__name__)
    _reorder(gm, order)
    _restore_buffer_persistence(root, gm, attrs)
    for k, v in vars(root).items():
        if not k.startswith("_") and k not in ("training",) and k not in gm.__dict__ and \
                not isinstance(v, (nn.Module, torch.Tensor)):
            gm.__dict__[k] = v
    gm.train(root.training)
    for node in gm.graph.nodes:
        node.meta.pop(_VALUE, None)
        node.meta.pop(_DATA, None)
    return gm


def _reorder(gm: nn.Module, order: dict[str, int]) -> None:
    """GraphModule registers attributes in graph order; restore the original module order."""
    for prefix, mod in gm.named_modules(remove_duplicate=False):
        for attr in ("_modules", "_parameters", "_buffers"):
            d = getattr(mod, attr)
            items = sorted(d.items(), key=lambda kv, p=prefix: order.get(
                f"{p}.{kv[0]}" if p else kv[0], len(order)))
            d.clear()
            d.update(items)


def _restore_buffer_persistence(root: nn.Module, gm: nn.Module, attrs: dict) -> None:
    for target, v in attrs.items():
        if not isinstance(v, torch.Tensor) or isinstance(v, nn.Parameter):
            continue
        owner_path, _, field = target.rpartition(".")
        try:
            owner = root.get_submodule(owner_path) if owner_path else root
        except AttributeError:
            continue
        if field in owner._non_persistent_buffers_set:
            gm.get_submodule(owner_path)._non_persistent_buffers_set.add(field) if owner_path \
                else gm._non_persistent_buffers_set.add(field)


def trace_module(root: nn.Module, leaves: Callable[[nn.Module, str], bool], *, flatten: bool,
                 example=None, concrete: dict | None = None, path: str = "") -> fx.GraphModule:
    """fx-trace `root`; raise `TraceError` naming the op and the model source line on failure."""
    try:
        return _trace_fx(root, leaves, flatten=flatten, example=example, concrete=concrete)
    except _TraceFailure as f:
        raise TraceError(path, f"tracer 'fx' cannot capture {type(root).__name__}: {f.why} at "
                         f"{f.op}, {f.where}.", _fix_hint(f.why)) from None
    except TraceError:
        raise
    except Exception as e:  # noqa: BLE001 - turn any fx failure into a located error
        raise TraceError(path, f"tracer 'fx' cannot capture {type(root).__name__}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} at "
                         f"{_frame_of(e)}.", _fix_hint(str(e))) from None


def _fix_hint(why: str) -> str:
    if "data-dependent" in why:
        return ("keep this module eager (trace a smaller submodule, or list the module with "
                "this branch in leaves=).")
    if "example" in why:
        return "pass example_inputs=(args, kwargs) captured from a real call."
    return ("list the submodule containing this line in leaves=, pass example_inputs=, or "
            "keep this module eager.")
