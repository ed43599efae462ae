"""`shard`: keep this rank's slice of parameters/buffers along an axis."""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import module_patch, sharding
from ..errors import SchedulingError
from ._util import direct_tensor, holders, refuse_in_export_capture
from .base import Primitive, register_primitive


@register_primitive
class ShardPrimitive(Primitive):
    """Split parameter(s)/buffer(s) `name_or_names` into `tp_size` equal slices (the
    tensor-parallel group's size) along `axis` and keep this rank's slice.

    - `blocks=k` treats the axis as k equal blocks sharded separately (fused q|k|v weights such as
      GPT-2's `c_attn`: `shard("weight", axis=1, blocks=3)`).
    - The tensor records its original shape, axis and group (`tensor._slapo_shard`), so it can be
      gathered, consolidated and verified.
    - Attributes stay coherent (`in_features`/`out_features`, Conv1D `nx`/`nf`, `num_embeddings`/
      `embedding_dim`), a vocabulary-sharded embedding masks ids owned by other ranks, and tied
      parameters (e.g. embedding and LM head) are sharded together and stay tied.
    - The output layout is recorded for `sync`: Linear axis 0 (Conv1D axis 1) gives a partitioned
      output, Linear axis 1 (Conv1D axis 0) and embedding axis 0 a partial sum.

    Sizes must divide evenly by `world_size` (times `blocks`); a tensor can be sharded once.
    """

    name = "shard"

    @classmethod
    def validate(cls, sch, name_or_names, axis: int, blocks: int = 1):
        refuse_in_export_capture(sch, "shard", "shard before tracing (shapes are fixed at capture).")
        names = _names(sch, name_or_names)
        if not names:
            raise SchedulingError(sch.path, "no tensor names given.", "pass e.g. 'weight'.")
        if len(set(names)) != len(names):
            raise SchedulingError(sch.path, f"duplicate names in {names}.", "list each once.")
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise SchedulingError(sch.path, f"axis must be an int, got {axis!r}.", "pass axis=0 or 1.")
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks < 1:
            raise SchedulingError(sch.path, f"blocks must be a positive int, got {blocks!r}.",
                                  "pass blocks=1 (default) or the number of fused blocks.")
        rule = sharding.rule_for(sch.mod)
        ws = sch.tp_size
        for name in names:
            _, t = direct_tensor(sch, name)
            if sharding.shard_spec(t) is not None:
                spec = sharding.shard_spec(t)
                raise SchedulingError(sch.path, f"{name!r} is already sharded (axis {spec.axis}, "
                                      f"original shape {tuple(spec.orig_shape)}).",
                                      "shard each tensor once; remove the second call.")
            if t.dim() == 0:
                raise SchedulingError(sch.path, f"{name!r} is a scalar and cannot be sharded.",
                                      "leave it replicated.")
            if not -t.dim() <= axis < t.dim():
                raise SchedulingError(sch.path, f"axis {axis} is out of range for {name!r} of "
                                      f"shape {tuple(t.shape)}.",
                                      f"use an axis in [0, {t.dim() - 1}].")
            ax = axis % t.dim()
            size = t.shape[ax]
            if size % (ws * blocks) != 0:
                what = f"world size {ws}" + (f" x {blocks} blocks" if blocks > 1 else "")
                raise SchedulingError(sch.path, f"cannot shard {name!r} of shape {tuple(t.shape)} "
                                      f"along axis {ax}: size {size} is not divisible by {what}.",
                                      "choose a tensor-parallel degree that divides it, or "
                                      "another axis (uneven sharding is not supported).")
            problem = rule.validate(sch.mod, name, ax)
            if problem:
                raise SchedulingError(sch.path, problem, "leave this tensor replicated.")

    @classmethod
    def apply(cls, sch, name_or_names, axis: int, blocks: int = 1):
        names = [name_or_names] if isinstance(name_or_names, str) else list(name_or_names)
        root = sch.root.mod
        for name in names:
            kind, t = direct_tensor(sch, name)
            ax = axis % t.dim()
            spec = sharding.ShardSpec(tuple(t.shape), ax, sch.tp_size, sch.tp_rank, blocks,
                                      sch.group)
            local = sharding.local_slice(t.detach(), ax, sch.tp_size, sch.tp_rank, blocks)
            local = local.clone() if local.device.type != "meta" else local.contiguous()
            new = nn.Parameter(local, requires_grad=t.requires_grad) if kind == "parameter" \
                else local
            _copy_tags(t, new)
            if hasattr(t, "_slapo_init"):  # the constructor's init, in full-shape coordinates
                new._slapo_init = t._slapo_init
            new._slapo_shard = spec
            tied = [(m, n, k) for (m, n, k) in holders(root, t)]
            for m, n, k in tied or [(sch.mod, name, kind)]:
                if k == "parameter":
                    m._parameters[n] = new
                else:
                    m._buffers[n] = new
                sharding.rule_for(m).postproc(m, n, ax, spec)
                layout = sharding.rule_for(m).output_layout(m, n, ax)
                if layout is not None:
                    module_patch.module_meta(m, create=True)["output_layout"] = layout
                if m is not sch.mod:
                    node = sch._node_of(m)
                    if node is not None:
                        node._record("shard", (n,), {"axis": ax, "tied_with": sch.path})


def _names(sch, name_or_names) -> list[str]:
    """The tensor names of a call: one name or a list/tuple of names. Anything else (a number,
    None, a dict) is a usage mistake named here, not a TypeError from deep inside `list()`."""
    if isinstance(name_or_names, str):
        return [name_or_names]
    if isinstance(name_or_names, (list, tuple)) and all(isinstance(n, str)
                                                        for n in name_or_names):
        return list(name_or_names)
    raise SchedulingError(sch.path, f"expected a tensor name or a list of names, got "
                          f"{name_or_names!r}.", "pass e.g. 'weight' or ['weight', 'bias'].")


def _copy_tags(old: torch.Tensor, new: torch.Tensor) -> None:
    tags = getattr(old, "_slapo_tags", None)
    if tags:
        new._slapo_tags = dict(tags)
        for k, v in tags.items():
            setattr(new, k, v)

