"""What torch.compile's partitioner keeps for one compiled layer: the real partition, recorded.

A compiled layer keeps what torch.compile's partitioner decides, not what eager autograd
saves: `record_partition` compiles a layer call with inductor's AOTAutograd front half (no
code generation, so it runs on fake tensors too) and reads the forward/backward graphs the
partitioner returned (`PartitionPlan`: saved bytes, FLOPs, fused bytes, kernels, peaks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import TraceError
from .op_costs import _MM_FLOPS, is_fp8, is_matmul


@dataclass
class PartitionPlan:
    """One compiled layer as AOTAutograd's partitioner splits it (forward and backward graphs).

    Read from the graphs the partitioner returned, never from a formula: `saved_bytes` are the
    forward outputs kept for backward (de-duplicated by base tensor; parameters and the layer's
    inputs excluded, as they live anyway). Bytes, kernels and peaks come from a fusion model
    of the two graphs (`graph_costs`): inductor fuses connected elementwise/reduction nodes
    that no matmul separates into one kernel.
    """

    saved_bytes: int
    fwd_flops: int
    bwd_flops: int
    fwd_bytes: int
    bwd_bytes: int
    fwd_kernels: int
    bwd_kernels: int
    fwd_peak: int  # most bytes the forward graph's own buffers hold at once (outputs included)
    bwd_peak: int  # the backward graph's: its buffers + the saved tensors not yet read last
    graphs: int = 1
    fwd_fp8_flops: int = 0  # the part of fwd_flops / bwd_flops in FP8 GEMMs (`_scaled_mm`)
    bwd_fp8_flops: int = 0

    @property
    def kernels(self) -> int:
        return self.fwd_kernels + self.bwd_kernels


_VIEW_TARGETS = ("_unsafe_view", "alias", "lift_fresh")
_EXTERN_NAMES = ("scaled_dot_product", "flash_attention", "efficient_attention", "convolution",
                 "cudnn_attention", "_scaled_mm")


def _target(node: Any) -> tuple[Any, tuple, dict, Any]:
    """(op, args, kwargs, output value) of a node; the op inside the rng wrappers that a
    checkpointed region's random ops get (`run_and_save_rng_state`, `run_with_rng_state`)."""
    if "rng_state" in str(node.target):
        for i, a in enumerate(node.args):
            if isinstance(a, torch._ops.OpOverload):
                out = node.meta.get("val")
                if "save" in str(node.target) and isinstance(out, tuple):
                    out = out[1]  # (rng state, the op's output)
                kwargs = {k: v for k, v in node.kwargs.items() if "rng" not in k}
                return a, tuple(node.args[i + 1:]), kwargs, out
    return node.target, tuple(node.args), dict(node.kwargs), node.meta.get("val")


def _node_kind(node: Any) -> str:
    """"view" (no kernel, aliases its input), "extern" (matmul/attention: its own kernel, its
    time in the FLOP term), "const" (no input: computed inside its readers) or "fused"
    (everything else inductor fuses: pointwise, reductions)."""
    import operator

    t = _target(node)[0]
    if t is operator.getitem:
        return "getitem"
    name = str(t).split(".")[1] if str(t).count(".") >= 2 else str(t)
    if getattr(t, "is_view", False) or name in _VIEW_TARGETS:
        return "view"
    if is_matmul(t) or any(n in name for n in _EXTERN_NAMES):
        return "extern"
    if not node.all_input_nodes:
        return "const"  # full/arange/scalars: inductor computes them inside their readers
    return "fused"


def _to_one(node: Any) -> bool:
    """A node whose output is one value computed from a tensor of many (a full reduction)."""
    def numel(n: Any) -> int:
        val = n.meta.get("val")
        return _int(val.numel()) if isinstance(val, torch.Tensor) else 0

    return numel(node) == 1 and any(numel(a) > 1 for a in node.all_input_nodes)


def _val_bytes(val: Any) -> int:
    return sum(_int(v.numel()) * v.element_size() for v in tree_flatten(val)[0]
               if isinstance(v, torch.Tensor))


def _node_flops(node: Any) -> int:
    from torch.fx import Node
    from torch.utils.flop_counter import flop_registry

    def val(a: Any) -> Any:
        return a.meta.get("val") if isinstance(a, Node) else a

    target, args, kwargs, out = _target(node)
    args, kwargs = tree_map(val, (args, kwargs))
    packet = getattr(target, "overloadpacket", None)
    if packet in flop_registry:
        return _int(flop_registry[packet](*args, **kwargs, out_val=out))
    if str(target) in _MM_FLOPS:
        return _int(_MM_FLOPS[str(target)](args, out))
    return 0


def _int(n: Any) -> int:
    """A size of a fake tensor as an int (a symbolic one by its hint; 0 without one)."""
    if isinstance(n, int):
        return n
    hint = getattr(getattr(n, "node", None), "hint", None)
    return int(hint) if hint is not None else 0


class _Groups:
    """Fused kernels of one graph: a union of producer-consumer pairs of fused nodes at the same
    matmul depth (inductor does not fuse across a matmul: the matmul sits between them) and in
    the same phase. A reduction of a whole tensor to one value (FP8's tensorwise amax) starts a
    new phase for its readers: they run after the whole reduction, in another kernel that reads
    the tensor again (a row reduction, as a norm's, fuses with its readers). A pointwise node
    read only in a later phase is computed there (inductor inlines it into its reader)."""

    def __init__(self, gm: Any) -> None:
        self.nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        self.kind = {n: _node_kind(n) for n in self.nodes}
        for n in self.nodes:  # a getitem is what its source is
            if self.kind[n] == "getitem":
                src = n.args[0]
                self.kind[n] = "fused" if self.kind.get(src) == "fused" else "buffer"
        self.parent = {n: n for n in self.nodes}
        depth: dict = {}
        phase: dict = {}
        for n in gm.graph.nodes:
            ins = [self.base(a) for a in n.all_input_nodes]
            d = max((depth.get(a, 0) for a in ins), default=0)
            depth[n] = d + (1 if self.kind.get(n) == "extern" else 0)
            phase[n] = max((phase.get(a, 0) + (self.kind.get(a) == "fused" and _to_one(a))
                            for a in ins), default=0)
        for n in reversed(self.nodes):  # sink pointwise nodes read only in a later phase
            readers = self._readers(n)
            if self.kind[n] == "fused" and not _to_one(n) and readers and all(
                    self.kind.get(r) == "fused" and depth[r] == depth[n] for r in readers):
                phase[n] = max(phase[n], min(phase[r] for r in readers))
        for n in self.nodes:
            if self.kind[n] == "fused":
                for a in (self.base(a) for a in n.all_input_nodes):
                    if self.kind.get(a) == "fused" and (depth[a], phase[a]) == \
                            (depth[n], phase[n]):
                        self._union(a, n)

    def _readers(self, n: Any) -> list:
        """The nodes that read `n` (through views)."""
        out = []
        for u in n.users:
            out += self._readers(u) if self.kind.get(u) == "view" else [u]
        return out

    def base(self, n: Any) -> Any:
        while self.kind.get(n) == "view" and n.args:
            n = n.args[0]
        return n

    def find(self, n: Any) -> Any:
        while self.parent[n] is not n:
            self.parent[n] = self.parent[self.parent[n]]
            n = self.parent[n]
        return n

    def _union(self, a: Any, b: Any) -> None:
        self.parent[self.find(a)] = self.find(b)

    def group(self, n: Any) -> Any:
        return self.find(n) if self.kind.get(n) == "fused" else n


def graph_costs(gm: Any, saved: dict[str, tuple[str, int]] | None = None) -> dict[str, int]:
    """FLOPs, bytes moved, kernels and peak live bytes of an aten graph as inductor runs it.

    A buffer is a graph input, a matmul/attention output, or a fused node some other kernel
    (or the graph's output) reads; each fused kernel reads its external buffers once and writes
    its buffers once. Buffers are freed after their last reader (inputs included: the compiled
    backward frees saved tensors as it goes), outputs live to the end.
    """
    g = _Groups(gm)
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outputs = {g.base(a) for a in out_node.all_input_nodes}
    readers: dict = {}  # buffer -> set of kernels (groups / extern nodes / the output)
    last: dict = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            b = g.base(a)
            if n.op == "output":
                readers.setdefault(b, set()).add("out")
            elif g.kind.get(n) in ("fused", "extern"):
                readers.setdefault(b, set()).add(g.group(n))
            if g.kind.get(b) != "const":
                last[b] = max(last.get(b, 0), order[n])
    flops = sum(_node_flops(n) for n in g.nodes if g.kind[n] == "extern")
    fp8_flops = sum(_node_flops(n) for n in g.nodes if g.kind[n] == "extern" and any(
        is_fp8(getattr(a, "meta", {}).get("val")) for a in _target(n)[1][:2]))
    buffers = {}
    moved = 0
    for b, who in readers.items():
        kind = g.kind.get(b, "input")
        if kind == "const":
            continue
        if kind == "fused":
            external = who - {g.group(b)}
            if not external:
                continue  # lives in registers inside its kernel
            moved += _val_bytes(b.meta.get("val"))  # written once
            moved += _val_bytes(b.meta.get("val")) * sum(1 for k in external if k != "out"
                                                          and g.kind.get(k) != "extern")
        else:
            moved += _val_bytes(b.meta.get("val")) * sum(1 for k in who if k != "out" and
                                                          g.kind.get(k) != "extern")
        if b.op != "get_attr":
            buffers[b] = _val_bytes(b.meta.get("val"))
    for n in g.nodes:  # extern outputs nobody reads still exist until freed
        if g.kind[n] in ("extern", "buffer") and n not in buffers:
            buffers[n] = _val_bytes(n.meta.get("val")) if g.kind[n] == "buffer" else 0
    kernels = len({g.group(n) for n in g.nodes if g.kind[n] == "fused"})
    kernels += sum(1 for n in g.nodes if g.kind[n] == "extern")
    return {"flops": flops, "fp8_flops": fp8_flops, "bytes": moved, "kernels": kernels,
            **_liveness(gm, buffers, last, outputs, order),
            "held_peak": _held_peak(gm, g, buffers, last, outputs, order, saved or {})}


def _liveness(gm: Any, buffers: dict, last: dict, outputs: set, order: dict) -> dict[str, int]:
    """Peak of the live buffers walking the graph in order; `inputs` are the placeholders."""
    ins = {b: n for b, n in buffers.items() if b.op == "placeholder"}
    live = sum(ins.values())
    peak = live
    start = live
    frees: dict[int, int] = {}
    for b, n in buffers.items():
        if b not in outputs and b in last:
            frees[last[b]] = frees.get(last[b], 0) + n
    made = made_peak = 0  # the same, of the buffers the graph allocates itself
    made_frees: dict[int, int] = {}
    for b, n in buffers.items():
        if b.op != "placeholder" and b not in outputs and b in last:
            made_frees[last[b]] = made_frees.get(last[b], 0) + n
    for node in gm.graph.nodes:
        if node in buffers and node.op != "placeholder":
            live += buffers[node]
            made += buffers[node]
        peak, made_peak = max(peak, live), max(made_peak, made)
        live -= frees.get(order[node], 0)
        made -= made_frees.get(order[node], 0)
    out_bytes = sum(buffers.get(b, 0) for b in outputs)
    return {"peak": peak, "made_peak": made_peak, "input_bytes": start,
            "output_bytes": out_bytes}


def _held_peak(gm: Any, g: _Groups, buffers: dict, last: dict, outputs: set, order: dict,
               saved: dict[str, tuple[str, int]]) -> int:
    """Peak of the saved tensors not yet read for the last time plus the buffers the graph
    allocates: a compiled backward frees each saved tensor after its last reader."""
    ends: dict[str, int] = {}
    size: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node.name in saved:
            base, nbytes = saved[node.name]
            size[base] = nbytes
            ends[base] = max(ends.get(base, 0), last.get(node, 0))
    frees: dict[int, int] = {}
    for base, end in ends.items():
        frees[end] = frees.get(end, 0) + size[base]
    for b, n in buffers.items():
        if b.op != "placeholder" and b not in outputs and b in last:
            frees[last[b]] = frees.get(last[b], 0) + n
    live = peak = sum(size.values())
    for node in gm.graph.nodes:
        if node in buffers and node.op != "placeholder":
            live += buffers[node]
        peak = max(peak, live)
        live -= frees.get(order[node], 0)
    return peak


def _saved_bases(fw: Any, bw: Any) -> dict[str, tuple[str, int]]:
    """{backward input name: (its forward base tensor, that base's bytes)} of the forward
    values the backward graph takes (its non-tangent inputs); graph inputs (parameters, the
    layer's inputs) are free and left out."""
    kinds = _Groups(fw)
    by_name = {n.name: n for n in fw.graph.nodes}
    out = {}
    for p in bw.graph.nodes:
        if p.op != "placeholder" or p.name.startswith("tangents") or p.name not in by_name:
            continue
        if not isinstance(p.meta.get("val"), torch.Tensor):
            continue
        b = kinds.base(by_name[p.name])
        if b.op != "placeholder":
            out[p.name] = (b.name, _val_bytes(b.meta.get("val")))
    return out


def _saved_bytes(fw: Any, bw: Any) -> int:
    """Bytes kept for backward, each base tensor once."""
    return sum(dict(_saved_bases(fw, bw).values()).values())


def _partitioner(partition: str) -> tuple[Callable, Any]:
    """(partition_fn, decompositions) of a torch.compile backend. "inductor": what inductor
    runs (its joint-graph passes, its decompositions, the min-cut partitioner in its inductor
    mode); "aot_eager": the aot_eager backend's (no decompositions, the same min cut)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if partition == "aot_eager":
        return min_cut_rematerialization_partition, None
    if partition != "inductor":
        raise ValueError(f"partition must be 'inductor' or 'aot_eager', got {partition!r}.")
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.decomposition import select_decomp_table

    return partition_fn, select_decomp_table()


def record_partition(fn: Callable, args: tuple, kwargs: dict | None = None,
                     partition: str = "inductor") -> PartitionPlan:
    """Compile `fn` (a layer call) with the partitioner inductor uses and read what it keeps.

    `fn(*args, **kwargs)` runs once through `torch.compile` with a backend that is inductor's
    AOTAutograd front half (same decompositions, joint-graph passes and min-cut partitioner)
    and no code generation: the forward graph runs op by op, so fake tensors (a 1.1B model at
    full batch costs nothing) work as well as real ones. Autocast and checkpoint wrappers
    active around or inside `fn` are traced as a real compile traces them (a selective
    checkpoint's policy becomes the partitioner's MUST_SAVE / PREFER_RECOMPUTE tags).
    """
    from torch._dynamo.backends.common import aot_autograd

    part_fn, decomps = _partitioner(partition)
    pairs: list = []

    def partition_and_keep(gm: Any, joint_inputs: Any, **k: Any) -> tuple:
        from torch._guards import detect_fake_mode
        from torch._inductor.virtualized import V

        with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as compile_fx sets it
            fw, bw = part_fn(gm, joint_inputs, **k)
        pairs.append((fw, bw))
        return fw, bw

    def nop(gm: Any, _inputs: Any) -> Callable:
        return gm

    from functorch.compile import make_boxed_func

    backend = aot_autograd(fw_compiler=lambda g, i: make_boxed_func(nop(g, i)),
                           bw_compiler=lambda g, i: make_boxed_func(nop(g, i)),
                           partition_fn=partition_and_keep, decompositions=decomps,
                           keep_inference_input_mutations=True)

    def call(*a: Any, **k: Any) -> Any:
        return fn(*a, **k)

    compiled = torch.compile(call, backend=backend, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=10**6):
        try:
            compiled(*args, **(kwargs or {}))
        finally:
            torch._C._dynamo.eval_frame.reset_code(call.__code__)
    if not pairs:
        raise TraceError("", "torch.compile produced no backward graph for the layer (no input "
                         "or parameter requires grad, or dynamo fell back to eager).",
                         "call it with grad enabled on a training-mode layer.")
    return _plan(pairs)


def _plan(pairs: list) -> PartitionPlan:
    costs = [(graph_costs(fw), graph_costs(bw, _saved_bases(fw, bw))) for fw, bw in pairs]
    return PartitionPlan(
        saved_bytes=sum(_saved_bytes(fw, bw) for fw, bw in pairs),
        fwd_flops=sum(f["flops"] for f, _ in costs), bwd_flops=sum(b["flops"] for _, b in costs),
        fwd_bytes=sum(f["bytes"] for f, _ in costs), bwd_bytes=sum(b["bytes"] for _, b in costs),
        fwd_kernels=sum(f["kernels"] for f, _ in costs),
        bwd_kernels=sum(b["kernels"] for _, b in costs),
        fwd_peak=max(f["made_peak"] for f, _ in costs),
        bwd_peak=max(b["held_peak"] for _, b in costs), graphs=len(pairs),
        fwd_fp8_flops=sum(f["fp8_flops"] for f, _ in costs),
        bwd_fp8_flops=sum(b["fp8_flops"] for _, b in costs))
