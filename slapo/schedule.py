"""The schedule tree: one `Schedule` node per module, mirroring `named_modules()`.

A node's path is exactly the module's fully-qualified name (`encoder.layer.0.attention`), so
schedule paths, `state_dict` keys and error messages all speak the same language. Nodes do not
hold their module: `sch.mod` is looked up from the parent each time, so a node stays valid after
its module (or an ancestor) is replaced.

Primitives are classes (see `slapo.primitives`) reachable as methods of every node:
`sch["encoder.layer.0"].checkpoint()`. Each successful call is recorded in the node's history,
so `print(sch)` shows what was done, with the arguments, without running the model.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from .distributed import group as _g
from .errors import SchedulingError
from .primitives.methods import PrimitiveMethods


class ScheduleKeyError(SchedulingError, KeyError):
    """A schedule path that does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class UnknownPrimitiveError(SchedulingError, AttributeError):
    """A primitive name that is not registered."""


@dataclass
class AppliedPrimitive:
    """One entry of a node's history."""

    name: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [_short(a) for a in self.args]
        parts += [f"{k}={_short(v)}" for k, v in self.kwargs.items()]
        return f"{self.name}({', '.join(parts)})"


def _short(v: Any) -> str:
    if isinstance(v, nn.Module):
        return type(v).__name__ + "(...)"
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


class _Root:
    """State shared by every node of one schedule tree."""

    def __init__(self, model: nn.Module, group, mesh):
        self.model = model
        self.group = group
        self.mesh = mesh
        self.world_size = _g.world_size(group)
        self.rank = _g.rank(group)
        self.pipeline_cuts: list[str] = []  # `cut_pipeline_stage` paths, in model order


# The edge's seam for other names of a node's attributes: `node.<name>` (when the class has no
# such attribute) is `_ATTRIBUTES[name](node)`. Filled by `slapo.compat.install` (Slapo 2023's
# `world_size`/`rank`, docs/migrating.md); the tree itself knows only today's names.
_ATTRIBUTES: dict[str, Callable[[Schedule], Any]] = {}


def register_attribute(name: str, get: Callable[[Schedule], Any]) -> None:
    """Serve `node.<name>` as `get(node)` on every schedule node (a name the class defines or a
    primitive's name cannot be taken: those always win, so they are refused here)."""
    from .primitives import get_primitive

    if _ATTRIBUTES.get(name) is get:
        return
    if hasattr(Schedule, name) or get_primitive(name) is not None or name.startswith("_") or \
            name in _ATTRIBUTES:
        raise ValueError(f"{name!r} is already a Schedule attribute, primitive or registered "
                         "name.")
    _ATTRIBUTES[name] = get


# The same seam for a node's metadata: `node.metadata.<name>` (the metadata is a dict; names are
# not items) is `_METADATA_ATTRIBUTES[name](node)`. Filled by `slapo.compat.install` (2023's
# `sch.metadata.param_tags`).
_METADATA_ATTRIBUTES: dict[str, Callable[[Schedule], Any]] = {}


def register_metadata_attribute(name: str, get: Callable[[Schedule], Any]) -> None:
    """Serve `node.metadata.<name>` as `get(node)` (a dict method's name cannot be taken)."""
    if _METADATA_ATTRIBUTES.get(name) is get:
        return
    if hasattr(dict, name) or name.startswith("_") or name in _METADATA_ATTRIBUTES:
        raise ValueError(f"{name!r} is already a metadata attribute or dict method.")
    _METADATA_ATTRIBUTES[name] = get


class NodeMetadata(dict):
    """A node's metadata: what primitives record (a plain dict); the names the edge registers
    (`register_metadata_attribute`) read as attributes."""

    def __init__(self, node: Schedule):
        super().__init__()
        self._node = weakref.ref(node)

    def __getattr__(self, name: str):
        get = _METADATA_ATTRIBUTES.get(name)
        node = self.__dict__.get("_node")
        node = node() if node is not None else None
        if get is None or node is None:
            raise AttributeError(name)
        return get(node)


class Schedule(PrimitiveMethods):
    """A node of the schedule tree. Create the tree with `slapo.create_schedule(model)`.

    The built-in primitives are its methods (`PrimitiveMethods`, typed, one per primitive
    class); primitives a user registers (`slapo.register_primitive`) and attributes the edge
    registers (`register_attribute`) are looked up by `__getattr__`."""

    def __init__(self, root: _Root, name: str, path: str, parent: Schedule | None):
        self._root = root
        self.name = name
        self.path = path
        self.parent = parent
        self.history: list[AppliedPrimitive] = []
        self.metadata: dict[str, Any] = NodeMetadata(self)
        self.child: dict[str, Schedule] = {}
        self._build_children()

    # ---- tree -------------------------------------------------------------------------------
    def _build_children(self) -> None:
        """(Re)build the child nodes from the current module. A child node (and its history)
        is kept only if it still stands for the *same module object*; whoever swaps this node's
        module calls this, so the node's own module reference is refreshed here too."""
        mod = self.mod
        self._mod_ref = weakref.ref(mod)
        old = self.child
        self.child = {}
        for name, sub in mod.named_children():
            node = old.get(name)
            if node is not None and node._mod_ref() is sub:
                self.child[name] = node
            else:
                self.child[name] = Schedule(self._root, name, _join(self.path, name), self)

    @property
    def mod(self) -> nn.Module:
        if self.parent is None:
            return self._root.model
        parent_mod = self.parent.mod
        sub = parent_mod._modules.get(self.name)
        if sub is None:
            raise SchedulingError(self.path, "this schedule node no longer has a module (an "
                                  "ancestor was replaced by a module without this child).",
                                  "index the schedule again from its root.")
        return sub

    @property
    def group(self):
        return self._root.group

    @property
    def mesh(self):
        return self._root.mesh

    @property
    def pipeline_cuts(self) -> tuple[str, ...]:
        """Paths of the modules after which a pipeline stage ends (`cut_pipeline_stage`), in
        model order; the pipeline runtime builds its stages from them."""
        return tuple(self._root.pipeline_cuts)

    @property
    def tp_size(self) -> int:
        """Ranks of the tensor-parallel group this schedule shards over (`shard` splits each
        tensor into this many slices). Not the job's world size: under a ("dp", "pp", "tp")
        mesh it is the "tp" dimension's size."""
        return self._root.world_size

    @property
    def tp_rank(self) -> int:
        """This process's rank in the tensor-parallel group (the slice `shard` keeps)."""
        return self._root.rank

    @property
    def root(self) -> Schedule:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def __getitem__(self, key: str) -> Schedule:
        if not isinstance(key, str):
            key = str(key)
        node = self
        for part in key.split(".") if key else []:
            if part not in node.child:
                avail = ", ".join(list(node.child)[:12]) or "none (a leaf module)"
                raise ScheduleKeyError(
                    node.path, f"has no submodule {part!r} (while resolving {key!r} from "
                    f"{self.path or '<root>'}).", f"use one of: {avail}.")
            node = node.child[part]
        return node

    def __contains__(self, key: str) -> bool:
        try:
            self[key]
        except ScheduleKeyError:
            return False
        return True

    def __iter__(self) -> Iterator[Schedule]:
        return iter(list(self.child.values()))

    def __len__(self) -> int:
        return len(self.child)

    def named_schedules(self, prefix: str = "") -> Iterator[tuple[str, Schedule]]:
        """Pre-order (path relative to this node, node) pairs, like `named_modules()`."""
        yield prefix, self
        for name, sub in list(self.child.items()):
            yield from sub.named_schedules(_join(prefix, name))

    def _node_of(self, module: nn.Module) -> Schedule | None:
        for _, node in self.root.named_schedules():
            if node.mod is module:
                return node
        return None

    # ---- primitives ---------------------------------------------------------------------------
    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in _ATTRIBUTES:
            return _ATTRIBUTES[name](self)
        from .primitives import get_primitive

        prim = get_primitive(name)
        if prim is None:
            from .primitives import list_primitives

            raise UnknownPrimitiveError(
                self.path, f"{name!r} is not a schedule primitive or attribute.",
                f"registered primitives: {', '.join(list_primitives())}.")

        @functools.wraps(prim.apply)
        def bound(*args, **kwargs):
            return prim.run(self, *args, **kwargs)

        bound.__doc__ = prim.__doc__
        bound.__name__ = bound.__qualname__ = name
        try:  # help() shows the call as the user writes it: without the schedule argument
            sig = inspect.signature(prim.apply)
            bound.__signature__ = sig.replace(parameters=list(sig.parameters.values())[1:])
        except (TypeError, ValueError):
            pass
        return bound

    def _record(self, name: str, args: tuple, kwargs: dict) -> None:
        self.history.append(AppliedPrimitive(name, tuple(args), dict(kwargs)))

    def applied(self) -> list[tuple[str, AppliedPrimitive]]:
        """Every primitive applied in this subtree, as (path, entry), in tree order."""
        out = []
        for _, node in self.named_schedules():
            out += [(node.path, h) for h in node.history]
        return out

    # ---- printing -----------------------------------------------------------------------------
    def tree(self, only_scheduled: bool = False) -> str:
        lines = [f"{self.path or '<root>'}: {type(self.mod).__name__}{_hist(self)}"]
        self._tree_lines(lines, "", only_scheduled)
        return "\n".join(lines)

    def _tree_lines(self, lines: list[str], indent: str, only: bool) -> None:
        kids = [c for c in self.child.values() if not only or c.applied()]
        for i, c in enumerate(kids):
            last = i == len(kids) - 1
            lines.append(f"{indent}{'└─ ' if last else '├─ '}{c.name}: "
                         f"{type(c.mod).__name__}{_hist(c)}")
            c._tree_lines(lines, indent + ("   " if last else "│  "), only)

    def __repr__(self) -> str:
        return (f"Schedule(path={self.path!r}, mod={type(self.mod).__name__}, "
                f"tp_size={self.tp_size})\n{self.tree()}")

    def __str__(self) -> str:
        return self.tree()


def _hist(node: Schedule) -> str:
    return ("  ← " + "; ".join(str(h) for h in node.history)) if node.history else ""


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _check_group_and_mesh(group, mesh) -> None:
    """A wrong object here would fail much later, inside a collective: refuse it up front."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if group is not None and not isinstance(group, (dist.ProcessGroup, _g.VirtualGroup)):
        raise SchedulingError("", f"group= must be a torch.distributed ProcessGroup, got "
                              f"{type(group).__name__}.",
                              "pass e.g. dist.new_group(ranks), mesh.get_group('tp'), or leave "
                              "it out (the default group).")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise SchedulingError("", f"mesh= must be a DeviceMesh, got {type(mesh).__name__}.",
                              "pass slapo.init_mesh(...) (or init_device_mesh), or leave it "
                              "out.")


def create_schedule(model: nn.Module, *, group=None, mesh=None) -> Schedule:
    """Build the schedule tree of `model`.

    `group`: the tensor-parallel process group for `shard`/`sync` (default: the default process
    group when torch.distributed is initialised, else a world of one rank). `mesh`: a DeviceMesh;
    its "tp" dimension's group is used when `group` is not given.
    """
    if not isinstance(model, nn.Module):
        raise SchedulingError("", f"create_schedule expects an nn.Module, got {type(model).__name__}.",
                              "pass the model object (e.g. BertModel(config)).")
    _check_group_and_mesh(group, mesh)
    if group is None and mesh is not None:
        names = mesh.mesh_dim_names or ()
        group = mesh.get_group("tp") if "tp" in names else (mesh.get_group() if mesh.ndim == 1
                                                             else None)
    if group is None:
        group = _g.default_group()
    return Schedule(_Root(model, group, mesh), "", "", None)
