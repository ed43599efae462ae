"""`cut_pipeline_stage`: mark a pipeline stage boundary after this module."""

from __future__ import annotations

import torch.fx as fx
import torch.nn as nn

from ..errors import SchedulingError
from .base import Primitive, register_primitive


def _crossing_values(gm: fx.GraphModule, target: str) -> tuple[list[str], bool]:
    """Values other than the cut module's output that are live across it, and whether the
    graph calls the module exactly once."""
    nodes = list(gm.graph.nodes)
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module" and n.target == target]
    if len(calls) != 1:
        return [], False
    cut = calls[0]
    before = set(nodes[:cut + 1])
    live = [n.name for n in nodes[:cut] if n.op not in ("get_attr",)
            and any(u not in before for u in n.users)]
    return live, True


def _ends_encoder(sch) -> bool:
    """The last block of an encoder-decoder model's encoder (T5's `encoder.block.{E-1}`): the
    stage boundary between encoder and decoder, where the next stage holds decoder blocks
    (`runtime.stages_seq2seq` builds the stages and checks the model type)."""
    stack = sch.parent.parent  # the container's owner (validate checked sch.parent exists)
    owner = stack.parent if stack is not None else None
    return (owner is not None and stack.name == "encoder" and
            isinstance(getattr(owner.mod, "decoder", None), nn.Module) and
            bool(getattr(getattr(owner.mod, "config", None), "is_encoder_decoder", False)))


@register_primitive
class CutPipelineStagePrimitive(Primitive):
    """End a pipeline stage after this module. The cut is recorded, in model order, in
    `sch.pipeline_cuts`; `slapo.pipeline.partition` (and the pipeline runtime)
    build the stage modules from it.

    The module must be a layer of a sequential container (nn.ModuleList / nn.Sequential), where
    only its output crosses the boundary, or a `call_module` of a traced parent whose graph
    passes nothing else across it. A cut inside a residual branch (the residual would have to
    cross the boundary too) is an error, and so is a cut on the last layer of a ModuleList
    (the next stage would have no layer of it), except an encoder-decoder model's last encoder
    layer: the boundary between its encoder and decoder.
    """

    name = "cut_pipeline_stage"

    @classmethod
    def validate(cls, sch):
        if sch.parent is None:
            raise SchedulingError(sch.path, "the root module cannot be cut: a stage ends after a "
                                  "submodule.", "cut one of its layers, e.g. "
                                  "sch['transformer.h.5'].cut_pipeline_stage().")
        cuts = sch.pipeline_cuts
        if sch.path in cuts:
            raise SchedulingError(sch.path, "this module is already a stage boundary.",
                                  "remove the second cut.")
        parent = sch.parent.mod
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            names = list(parent._modules)
            if names and names[-1] == sch.name and not isinstance(parent, nn.Sequential) \
                    and not _ends_encoder(sch):
                raise SchedulingError(sch.path, "this is the last layer of its container; a cut "
                                      "here leaves the next stage without layers of it.",
                                      f"cut an earlier layer (e.g. {names[-2] if len(names) > 1 else '0'}).")
            return
        if isinstance(parent, fx.GraphModule):
            live, once = _crossing_values(parent, sch.name)
            if not once:
                raise SchedulingError(sch.path, "the traced parent does not call this module "
                                      "exactly once.", "cut a module called once.")
            if live:
                raise SchedulingError(sch.path, f"a cut here is inside a residual branch: besides "
                                      f"this module's output, {live} cross the boundary.",
                                      "cut after the whole block (e.g. the decoder layer) instead.")
            return
        raise SchedulingError(sch.path, f"a cut inside {type(parent).__name__} is inside a block "
                              "whose data flow is unknown (e.g. a residual branch).",
                              "cut a layer of a ModuleList/Sequential (a whole block), or trace "
                              "the parent first so the boundary can be checked.")

    @classmethod
    def apply(cls, sch):
        order = {path: i for i, (path, _) in enumerate(sch.root.named_schedules())}
        cuts = [*sch.pipeline_cuts, sch.path]
        sch._root.pipeline_cuts = sorted(cuts, key=lambda p: order.get(p, len(order)))
        sch.metadata["pipeline_cut"] = True
