"""Apply recorded init ops (`record.py`) to one rank's shard, never building the whole tensor.

Deterministic ops are cut to the shard: each recorded view (a `Box` of the full tensor) is
intersected with the rows/columns this rank holds, and tensor arguments (a `copy_` source, a
mask) are cut the same way. Random ops cannot be cut after the fact, so their values are defined
per block instead of by one stream over the whole tensor (what DTensor's random ops achieve with
per-shard Philox offsets, here device-agnostic):

    the view a random op fills is split along its first dimension into blocks of R rows
    (R = max(1, 2**16 // row size), at most half the rows, so no block is the whole view);
    block b is drawn on its own generator seeded from (seed, module path, tensor, op index, b).

Each value therefore depends only on the full shape and its position, not on the TP degree or
rank: a row-sharded rank draws only the blocks overlapping its rows, a column-sharded rank draws
each block (one at a time, at most 2**16 elements or one row) and keeps its columns, so memory
never holds more than the shard plus one block. (The column case spends the compute of the whole
tensor per rank; per-column streams would avoid it at the price of much smaller draws.)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .record import Box, Op, whole

BLOCK_ELEMS = 1 << 16
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class Layout:
    """Where a rank's shard lies in the full tensor: along `axis` (None: not sharded), the
    `pieces` (full lo, full hi, local lo), one per block of a fused tensor (e.g. q|k|v)."""

    full_shape: tuple[int, ...]
    axis: int | None
    pieces: tuple[tuple[int, int, int], ...] = ()

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.axis is None:
            return self.full_shape
        shape = list(self.full_shape)
        shape[self.axis] = sum(hi - lo for lo, hi, _ in self.pieces)
        return tuple(shape)


def layout(full_shape: tuple[int, ...], spec) -> Layout:
    """The `Layout` of a tensor with `ShardSpec` `spec` (or None), with `local_slice`'s chunk
    arithmetic: `blocks` equal parts, each split in ceil-sized chunks over the ranks."""
    if spec is None or spec.world_size == 1:
        return Layout(tuple(full_shape), None)
    axis = spec.axis % len(full_shape)
    part = full_shape[axis] // spec.blocks
    chunk = -(-part // spec.world_size)
    pieces, local = [], 0
    for b in range(spec.blocks):
        lo = b * part + min(spec.rank * chunk, part)
        hi = b * part + min((spec.rank + 1) * chunk, part)
        pieces.append((lo, hi, local))
        local += hi - lo
    return Layout(tuple(full_shape), axis, tuple(pieces))


@dataclass(frozen=True)
class Segment:
    """The part of a recorded view that lies in the shard: view indices [lo, hi) along view
    dimension `vdim` (None: the whole view), at (`size`, `stride`, `offset`) in the local
    tensor."""

    vdim: int | None
    lo: int
    hi: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def segments(box: Box, lay: Layout) -> list[Segment]:
    """The pieces of `box` (a view of the full tensor) held by the shard described by `lay`."""
    local_strides = _strides(lay.local_shape)
    starts = dict(box.fixed)
    starts.update({d: s for d, s, _, _ in box.dims if d is not None})

    def make(axis_start: int, vdim: int | None, lo: int, hi: int) -> Segment:
        size = tuple(hi - lo if k == vdim else n for k, (_, _, _, n) in enumerate(box.dims))
        stride = tuple(1 if d is None else t * local_strides[d] for d, _, t, _ in box.dims)
        offset = sum((axis_start if d == lay.axis else s) * local_strides[d]
                     for d, s in starts.items())
        return Segment(vdim, lo, hi, size, stride, offset)

    if lay.axis is None:
        return [make(0, None, 0, 0)]
    fixed = dict(box.fixed)
    if lay.axis in fixed:
        i = fixed[lay.axis]
        return [make(i - lo + at, None, 0, 0) for lo, hi, at in lay.pieces if lo <= i < hi]
    k = next(k for k, (d, _, _, _) in enumerate(box.dims) if d == lay.axis)
    _, s, t, n = box.dims[k]
    out = []
    for lo, hi, at in lay.pieces:
        j0, j1 = max(0, -(-(lo - s) // t)), min(n, -(-(hi - s) // t))
        if j0 < j1:
            out.append(make(s + j0 * t - lo + at, k, j0, j1))
    return out


def stream_seed(seed: int, key: str) -> int:
    """A 63-bit seed for the random stream named `key` (module path, tensor, op index)."""
    digest = hashlib.blake2b(f"{seed}|{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK63


def block_seed(stream: int, block: int) -> int:
    """splitmix64 of (stream, block): independent seeds for neighbouring blocks."""
    z = (stream + (block + 1) * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


def rows_per_block(shape: tuple[int, ...]) -> int:
    """Rows of the first dimension drawn together: ~`BLOCK_ELEMS` elements, at least one row,
    at most half the rows (a block is never the whole view)."""
    rows, row = shape[0], math.prod(shape[1:])
    r = max(1, BLOCK_ELEMS // max(row, 1))
    return min(r, max(1, rows // 2))


def _cut(value, seg: Segment, shape: tuple[int, ...], device: torch.device):
    """A tensor argument of an elementwise op, cut to the segment (scalars pass through)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() > 0:
        value = value.expand(shape)
        if seg.vdim is not None:
            value = value.narrow(seg.vdim, seg.lo, seg.hi - seg.lo)
    return value.to(device)


def _index_fill(op: Op, view: torch.Tensor, seg: Segment, shape, device) -> None:
    dim, index, value = op.args
    dim = dim % max(len(shape), 1)
    idx = [i % shape[dim] for i in index.reshape(-1).tolist()] if shape else []
    if seg.vdim == dim:
        idx = [i - seg.lo for i in idx if seg.lo <= i < seg.hi]
    if idx:
        op.func(view, dim, torch.tensor(idx, dtype=torch.long, device=device),
                _cut(value, seg, shape, device), **op.kwargs)


def _draw(op: Op, shape, dtype, device, gen: torch.Generator, seed: int) -> torch.Tensor:
    gen.manual_seed(seed)
    out = torch.empty(shape, dtype=dtype, device=device)
    op.func(out, *op.args, **op.kwargs, generator=gen)
    return out


def _random(op: Op, view: torch.Tensor, seg: Segment, shape, stream: int,
            gen: torch.Generator) -> None:
    """Fill the segment with its part of the op's canonical block stream (module docstring)."""
    if not shape:
        view.copy_(_draw(op, (), view.dtype, view.device, gen, block_seed(stream, 0)))
        return
    rows, r = shape[0], rows_per_block(shape)
    first, last = (seg.lo // r, (seg.hi - 1) // r) if seg.vdim == 0 else (0, (rows - 1) // r)
    for b in range(first, last + 1):
        b0, b1 = b * r, min(rows, (b + 1) * r)
        block = _draw(op, (b1 - b0, *shape[1:]), view.dtype, view.device, gen,
                      block_seed(stream, b))
        if seg.vdim == 0:
            r0, r1 = max(b0, seg.lo), min(b1, seg.hi)
            view[r0 - seg.lo:r1 - seg.lo].copy_(block[r0 - b0:r1 - b0])
        elif seg.vdim is None:
            view[b0:b1].copy_(block)
        else:
            view[b0:b1].copy_(block.narrow(seg.vdim, seg.lo, seg.hi - seg.lo))
        del block


# In-place ops that set every element of their view without reading it.
_OVERWRITES = {"aten::normal_", "aten::uniform_", "aten::random_", "aten::exponential_",
               "aten::geometric_", "aten::cauchy_", "aten::log_normal_", "aten::bernoulli_",
               "aten::zero_", "aten::fill_", "aten::copy_"}


def live(ops: list[Op], shape: tuple[int, ...]) -> list[Op]:
    """The ops from the last one that rewrites every element without reading it on.

    Why: a tensor's ops accumulate over its owner's init and its ancestors' (a Linear's own
    `normal_(0.02)`, then T5's `normal_(d_model ** -0.5)` from the attention module); drawing
    the overwritten fill too would only cost time. Pruning is a function of the recording
    alone, so every rank and TP degree prunes alike."""
    full = whole(shape)
    start = 0
    for i, op in enumerate(ops):
        if op.box == full and op.func._schema.name in _OVERWRITES:
            start = i
    return ops[start:]


def replay(ops: list[Op], local: torch.Tensor, lay: Layout, seed: int, key: str,
           gen: torch.Generator) -> torch.Tensor:
    """Apply `ops` (recorded on the full tensor) to `local`, this rank's contiguous shard;
    random op i draws the stream `key#i`."""
    for i, op in enumerate(ops):
        shape = op.box.shape
        stream = stream_seed(seed, f"{key}#{i}")
        for seg in segments(op.box, lay):
            view = local.as_strided(seg.size, seg.stride, seg.offset)
            if op.kind == "random":
                _random(op, view, seg, shape, stream, gen)
            elif op.kind == "index_fill":
                _index_fill(op, view, seg, shape, local.device)
            else:
                args = [_cut(a, seg, shape, local.device) for a in op.args]
                kwargs = {k: _cut(v, seg, shape, local.device) for k, v in op.kwargs.items()}
                op.func(view, *args, **kwargs)
    return local
