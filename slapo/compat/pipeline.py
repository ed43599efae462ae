"""Slapo 2023's pipeline helpers at the edge: `analyze_tie_weights`, DeepSpeed's
`analyze_tie_ranks`, and partitioning a traced model of any structure at its cuts.

Tie analysis. 2023's `slapo.pipeline.analyze_tie_weights(top_mod, is_pipeline_partitioned)`
reported the parameters several modules share ("tied" weights, e.g. an embedding and the LM
head). Today the pipeline runtime finds the ties it must synchronise itself, by parameter
identity over the stages (`slapo.runtime.pipeline_tied.find_tied`); `analyze_tie_weights` is the
same identity scan with 2023's report:
- not partitioned: {parameter: {(name, 0), ...}}, one entry per parameter reached under more
  than one name;
- partitioned (`top_mod`'s children are the stages, as 2023's partitioned GraphModule had them,
  or a list of stage modules, as `slapo.pipeline.partition` returns them today): {parameter:
  [(name inside its stage, stage id), ...]}, for parameters shared by different stages; names
  the parameter also has inside its first stage are not listed (2023 skipped ties within one
  stage). 2023 returned the names as a set in the partitioned case too, in no order; here a
  list, sorted by stage then name.

`analyze_tie_ranks(tie_weight_groups, topology)`: for each group of `analyze_tie_weights`'s
values, the ranks that hold it, one list per position in a stage's rank list (DeepSpeed's
`topology.filter_match(pipe=stage)`), and the stage ids: what 2023's DeepSpeed dialect fed to
`dist.new_group` for tied gradients. Kept for 2023 programs that compute these groups;
today's pipelines sum tied gradients themselves.

Partitioning a traced model (`graph_stages`): today's `slapo.pipeline.partition` builds stages
for the model families it knows (their stage classes reproduce the forward); 2023 split any
traced model's graph at the cuts. For a schedule whose root is a GraphModule of a model no
family covers (say a `pre -> layers -> post` module, traced with `sch.trace_until(...)`), the
stages are cut from the graph: the graphs of the traced modules above the cuts are inlined into
one, an `nn.Sequential` above a cut is unrolled (its forward is the chain of its children), and
the nodes are split after each cut module's call. Stage 0 takes the model's inputs, stage i>0
the values stage i-1 returns (the values later stages still need, in graph order: one value
alone, several as a tuple), the last returns the model's output, so
`slapo.pipeline.run_stages(stages, *inputs)` is the model's forward. A stage is a GraphModule
holding the model's own submodules and parameters under their full paths (shared, not copied;
`named_parameters()` names are the model's). 2023 returned one GraphModule with `submod_i`
children; here the list of stage modules, as for every model today.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.nn as nn

from ..errors import SchedulingError


# ------------------------------------------------------------------------------- tie weights
def _stages_of(top_mod: Any, is_pipeline_partitioned: bool) -> list[nn.Module]:
    if not isinstance(is_pipeline_partitioned, bool):
        raise TypeError(f"is_pipeline_partitioned must be a bool, got "
                        f"{type(is_pipeline_partitioned).__name__}.")
    if isinstance(top_mod, (list, tuple)):
        if not is_pipeline_partitioned:
            raise TypeError("a list of stage modules is a partitioned model: pass "
                            "is_pipeline_partitioned=True.")
        bad = [type(m).__name__ for m in top_mod if not isinstance(m, nn.Module)]
        if bad or not top_mod:
            raise TypeError(f"the stages must be nn.Modules, got {bad or 'an empty list'}.")
        return list(top_mod)
    if not isinstance(top_mod, nn.Module):
        raise TypeError(f"analyze_tie_weights needs an nn.Module (or a list of stage modules), "
                        f"got {type(top_mod).__name__}.")
    return [m for _, m in top_mod.named_children()] if is_pipeline_partitioned else [top_mod]


def _names_in_2023_order(mod: nn.Module, prefix: str = "") -> list[tuple[str, nn.Parameter]]:
    """Every (dotted name, parameter) under `mod`, each name once, in the order 2023's scan
    met them: a module's own `named_parameters()` (which lists a shared parameter once), then
    each child's, depth first (so a shared parameter's other names come from its owners)."""
    seen: dict[str, nn.Parameter] = {}

    def visit(m: nn.Module, pre: str) -> None:
        for name, p in m.named_parameters():
            seen.setdefault(f"{pre}.{name}" if pre else name, p)
        for cname, child in m.named_children():
            visit(child, f"{pre}.{cname}" if pre else cname)

    visit(mod, prefix)
    return list(seen.items())


def analyze_tie_weights(top_mod: nn.Module | Sequence[nn.Module],
                        is_pipeline_partitioned: bool) -> dict[nn.Parameter, Any]:
    """2023's tie report (module docstring): {parameter: names} for every shared parameter."""
    stages = _stages_of(top_mod, is_pipeline_partitioned)
    earlier: list[tuple[str, int, nn.Parameter]] = []
    groups: dict[int, tuple[nn.Parameter, list[tuple[str, int]]]] = {}
    for sid, stage in enumerate(stages):
        for name, p in _names_in_2023_order(stage):
            for other, osid, q in earlier:
                if q is not p or (is_pipeline_partitioned and osid == sid):
                    continue
                _, members = groups.setdefault(id(p), (p, [(other, osid)]))
                if (name, sid) not in members:
                    members.append((name, sid))
            earlier.append((name, sid, p))
    if not is_pipeline_partitioned:
        return {p: set(members) for p, members in groups.values()}
    return {p: sorted(members, key=lambda m: (m[1], m[0])) for p, members in groups.values()}


def analyze_tie_ranks(tie_weight_groups: Sequence[Sequence[tuple[str, int]]],
                      topology: Any) -> tuple[list[list[list[int]]], list[list[int]]]:
    """(tie_ranks, tie_stages): for each group, the rank lists that share its gradient (the
    i-th rank of each of its stages, sorted) and its sorted stage ids. `topology`: DeepSpeed's
    `PipeModelDataParallelTopology` (or anything with `filter_match(pipe=stage) -> ranks`)."""
    if not callable(getattr(topology, "filter_match", None)):
        raise TypeError(f"topology must have filter_match(pipe=stage) -> ranks (DeepSpeed's "
                        f"PipeModelDataParallelTopology), got {type(topology).__name__}.")
    groups = [list(g) for g in tie_weight_groups]
    for g in groups:
        if not g or not all(isinstance(m, (tuple, list)) and len(m) == 2 and isinstance(m[1], int)
                            for m in g):
            raise TypeError(f"each tie group must be a non-empty list of (name, stage id), as "
                            f"analyze_tie_weights(model, True) returns; got {g!r}.")
    tie_ranks, tie_stages = [], []
    for g in groups:
        per_stage = [list(topology.filter_match(pipe=sid)) for _, sid in g]
        width = len(per_stage[0])
        if any(len(r) != width for r in per_stage):
            raise SchedulingError("", f"the stages {[sid for _, sid in g]} hold different "
                                  f"numbers of ranks {[len(r) for r in per_stage]}.",
                                  "every pipeline stage needs the same data x tensor ranks.")
        tie_ranks.append([sorted(r[i] for r in per_stage) for i in range(width)])
        tie_stages.append(sorted(sid for _, sid in g))
    return tie_ranks, tie_stages


# --------------------------------------------------------------------------- graph partition
def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class _Flattener:
    """Inline the graphs above the cuts into one graph whose call_module/get_attr targets are
    full paths from the root."""

    def __init__(self, root: nn.Module, cuts: Sequence[str]):
        self.root, self.cuts = root, list(cuts)
        self.graph = fx.Graph()
        self.cut_nodes: dict[str, fx.Node] = {}

    def _above_cut(self, path: str) -> bool:
        return any(c.startswith(path + ".") for c in self.cuts)

    def run(self) -> fx.Node:
        gm = self.root
        env: dict[fx.Node, Any] = {}
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                new = self.graph.placeholder(n.target, default_value=n.args[0] if n.args else
                                             inspect.Parameter.empty)
                new.meta = dict(n.meta)
                env[n] = new
        return self._body(gm, "", env)

    def _body(self, gm: fx.GraphModule, prefix: str, env: dict) -> Any:
        out = None
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                out = fx.map_arg(n.args[0], lambda a: env[a])
                break
            args = fx.map_arg(n.args, lambda a: env[a])
            kwargs = fx.map_arg(n.kwargs, lambda a: env[a])
            if n.op == "call_module":
                env[n] = self._call(_join(prefix, n.target), args, kwargs)
            elif n.op == "get_attr":
                env[n] = self.graph.get_attr(_join(prefix, n.target))
            else:
                env[n] = self.graph.create_node(n.op, n.target, args, kwargs, n.name)
                env[n].meta = dict(n.meta)
        return out

    def _call(self, path: str, args: tuple, kwargs: dict) -> Any:
        mod = self.root.get_submodule(path)
        if self._above_cut(path):
            if isinstance(mod, fx.GraphModule):
                return self._inline(mod, path, args, kwargs)
            if type(mod) is nn.Sequential and not kwargs and len(args) == 1:
                x = args[0]
                for name, _ in mod.named_children():
                    x = self._call(_join(path, name), (x,), {})
                return x
            raise SchedulingError(path, f"a pipeline cut lies inside this "
                                  f"{type(mod).__name__}, which is not traced, so its graph "
                                  "cannot be split.", "trace it (sch.trace_until([...]) on "
                                  "the root, or sch['...'].trace()) before partitioning.")
        node = self.graph.call_module(path, args, kwargs)
        if path in self.cuts:
            self.cut_nodes[path] = node
        return node

    def _inline(self, gm: fx.GraphModule, path: str, args: tuple, kwargs: dict) -> Any:
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        env: dict[fx.Node, Any] = {}
        for i, ph in enumerate(phs):
            if i < len(args):
                env[ph] = args[i]
            elif ph.target in kwargs:
                env[ph] = kwargs[ph.target]
            elif ph.args:
                env[ph] = ph.args[0]
            else:
                raise SchedulingError(path, f"input {ph.target!r} of this module is not "
                                      "given by its caller's graph.",
                                      "partition a model whose traced calls pass every input.")
        return self._body(gm, path, env)


def _owner_attrs(root: nn.Module, graph: fx.Graph) -> dict[str, Any]:
    attrs = {}
    for n in graph.nodes:
        if n.op == "call_module":
            attrs[n.target] = root.get_submodule(n.target)
        elif n.op == "get_attr":
            owner, _, field = n.target.rpartition(".")
            attrs[n.target] = getattr(root.get_submodule(owner) if owner else root, field)
    return attrs


def graph_stages(sch) -> list[nn.Module]:
    """The stage modules of a traced model (module docstring), split at `sch.pipeline_cuts`."""
    root, cuts = sch.mod, list(sch.pipeline_cuts)
    if not isinstance(root, fx.GraphModule):
        raise SchedulingError(sch.path, "partitioning a model by its graph needs the root "
                              "traced.", "call sch.trace_until([...]) (or sch.trace()) first.")
    if not cuts:
        raise SchedulingError(sch.path, "the schedule has no pipeline cuts.",
                              "call sch['<module>'].cut_pipeline_stage() first.")
    flat = _Flattener(root, cuts)
    result = flat.run()
    missing = [c for c in cuts if c not in flat.cut_nodes]
    if missing:
        raise SchedulingError(sch.path, f"the cut module(s) {missing} are not called by the "
                              "traced graph (traced into, or not used by the forward).",
                              "cut after a module the graph calls (keep it a leaf: "
                              "sch.trace_until([...]) with its path).")
    flat.graph.output(result)
    nodes = list(flat.graph.nodes)
    stage_of: dict[fx.Node, int] = {}
    sid = 0
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        stage_of[n] = sid if n.op != "get_attr" else -1  # get_attr: copied where used
        if n in flat.cut_nodes.values():
            sid += 1
    n_stages = sid + 1 if any(s == sid for s in stage_of.values()) else sid
    if n_stages < 2:
        raise SchedulingError(sch.path, "every node comes before the first cut: one stage.",
                              "cut before the model's last module.")
    return [_stage_module(root, nodes, stage_of, s, n_stages) for s in range(n_stages)]


def _stage_module(root: nn.Module, nodes: list[fx.Node], stage_of: dict[fx.Node, int], s: int,
                  n_stages: int) -> fx.GraphModule:
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")

    def live_after(k: int) -> list[fx.Node]:
        """Values made by stages <= k (or model inputs) that stages > k (or the output) use."""
        made = [n for n in nodes if n.op == "placeholder" or 0 <= stage_of.get(n, -1) <= k]
        later = [n for n in nodes if stage_of.get(n, -1) > k] + [output]
        used = {a for u in later for a in u.all_input_nodes}
        return [n for n in made if n in used]

    inputs = placeholders if s == 0 else live_after(s - 1)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in inputs:
        if n.op == "placeholder" and s == 0:
            env[n] = graph.placeholder(n.target, default_value=n.args[0] if n.args else
                                       inspect.Parameter.empty)
        else:
            env[n] = graph.placeholder(n.name)

    def value(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = graph.get_attr(a.target)
        return env[a]

    for n in nodes:
        if stage_of.get(n) == s:
            env[n] = graph.node_copy(n, value)
    if s == n_stages - 1:
        graph.output(fx.map_arg(output.args[0], value))
    else:
        out = [value(a) for a in live_after(s)]
        graph.output(out[0] if len(out) == 1 else tuple(out))
    graph.lint()
    gm = fx.GraphModule(_owner_attrs(root, graph), graph, class_name=f"Stage{s}")
    _model_order(root, gm)
    return gm


def _model_order(root: nn.Module, gm: fx.GraphModule) -> None:
    """Register the stage's submodules in the model's order (GraphModule registers them in
    graph order), so `named_parameters()` lists them as the model does. Only the containers
    GraphModule made are reordered: the model's own modules are not touched."""
    order = {name: i for i, (name, _) in enumerate(root.named_modules(remove_duplicate=False))}
    owned = {id(m) for m in root.modules()}
    for prefix, mod in gm.named_modules(remove_duplicate=False):
        if id(mod) in owned:
            continue
        items = sorted(mod._modules.items(),
                       key=lambda kv, p=prefix: order.get(_join(p, kv[0]), len(order)))
        mod._modules.clear()
        mod._modules.update(items)


__all__ = ["analyze_tie_ranks", "analyze_tie_weights", "graph_stages"]
