"""2023 build-side names: `consolidate_model`, `init_target_engine`, `trace`,
`generate_pipeline_partition`, as calls into today's runtime; and `build`, the public
`slapo.build`: `adapt_build_args` translates 2023's `build(sch, target=, config=, topology=,
init_weights=)` spellings to today's arguments, then the core `slapo.runtime.build.build` runs
(which knows only today's signature).

Fixed 2023 bugs: `consolidate_model` re-initialised every weight, loaded ones included, and only
on CUDA; here it materialises meta (delayed-init) tensors only, shards only, on any device, with
the same per-module seeding as `slapo.build` (so the result does not depend on the TP degree).
"""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..distributed import group as _g
from ..errors import SchedulingError
from ..init import has_meta_tensors, materialize
from ..init import init_empty_weights as _init_empty_weights
from ..notices import notice_once
from ..runtime.build import build as _runtime_build
from ..runtime.build import mesh_info
from ..runtime.precision import precision_arg
from ..schedule import Schedule, create_schedule


def consolidate_model(sch: Schedule, target: str | None = None,
                      param_init_fn: Callable | None = None, topology: Any = None,
                      device: torch.device | str | None = None, seed: int = 0) -> Schedule:
    """Materialise `sch`'s meta tensors in place (this rank's shards), initialised with
    `param_init_fn(mod[, path])` or the model's own init; materialised weights are kept.
    `target` and `topology` (DeepSpeed's) are accepted for the 2023 signature and unused: the
    schedule's group already says which slice each rank keeps."""
    model = sch.mod
    if has_meta_tensors(model):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        materialize(model, device, init_fn=param_init_fn, seed=seed)
    return sch


def init_empty_weights(enable: bool = True,
                       include_buffers: bool = False) -> contextlib.AbstractContextManager:
    """`slapo.init_empty_weights` with 2023's signature: `enable=False` is a no-op context
    (2023's `init_empty_weights(enable=delay_init)`); `include_buffers` is accepted and unused
    (buffers always go to meta and `build` materialises them). Otherwise the core's
    `slapo.init.init_empty_weights()`."""
    return _init_empty_weights() if enable else contextlib.nullcontext()


def init_target_engine(model: nn.Module, target: str | None = None,
                       **kwargs: Any) -> tuple[Any, Any]:
    """`(model, None)` for the native target; for "deepspeed", `deepspeed.initialize(model=...,
    model_parameters=<trainable params>, **kwargs)` -> (engine, optimizer), as in 2023."""
    if target is None:
        return model, None
    if target != "deepspeed":
        raise SchedulingError("", f"unknown target {target!r}.", "use None or 'deepspeed'.")
    from ..runtime.deepspeed import import_deepspeed

    ds = import_deepspeed()
    params = [p for p in model.parameters() if p.requires_grad]
    engine, optimizer, *_ = ds.initialize(model=model, model_parameters=params, **kwargs)
    return engine, optimizer


def trace(model: nn.Module, **kwargs: Any) -> nn.Module:
    """2023 `slapo.trace(model, tracer=, recursive=, flatten=, leaf_modules=, concrete_args=)`:
    the GraphModule of `model` (through the `trace` primitive, 2023 spellings accepted)."""
    from .spellings import TRACING_2023

    sch = create_schedule(model)
    token = TRACING_2023.set(True)  # 2023's rule: a submodule it cannot trace stays a leaf
    try:
        return sch.trace(**kwargs)
    finally:
        TRACING_2023.reset(token)


def generate_pipeline_partition(sch: Schedule, num_stages: int | None = None) -> list[nn.Module]:
    """2023's partition step: the stage modules at the schedule's `cut_pipeline_stage` cuts.

    2023 split one traced GraphModule into `submod_i` children; today a stage is a module that
    shares the model's layers (slapo.pipeline.partition), so this returns the list of stages.
    A traced model of no family `partition` knows is cut from its graph, as 2023 cut it
    (`slapo.compat.pipeline.graph_stages`)."""
    import torch.fx as fx

    from ..runtime.partition import check_partitionable, partition
    from .pipeline import graph_stages

    if not isinstance(sch.mod, fx.GraphModule) or _family_known(check_partitionable, sch.mod):
        return partition(sch, num_stages)
    if num_stages is not None and num_stages != len(sch.pipeline_cuts) + 1:
        raise SchedulingError(sch.path, f"num_stages={num_stages}, but the "
                              f"{len(sch.pipeline_cuts)} cuts make "
                              f"{len(sch.pipeline_cuts) + 1} stages.",
                              "drop num_stages (the cuts decide).")
    return graph_stages(sch)


def _family_known(check: Callable[[nn.Module], None], model: nn.Module) -> bool:
    try:
        check(model)
    except SchedulingError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# slapo.build: today's arguments, plus the 2023 spellings
# ------------------------------------------------------------------------------------------------

# `help(slapo.build)` shows the core's signature and docstring (functools.wraps), which name
# this adapter; the 2023 spellings are listed in `adapt_build_args`.
@functools.wraps(_runtime_build)
def build(sch: Schedule, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """`slapo.build`: the 2023 spellings translated (`adapt_build_args`, every error before
    anything is built), then the core `slapo.runtime.build.build` with today's arguments."""
    return _runtime_build(sch, **adapt_build_args(sch, kwargs))

SPELLINGS_2023 = ("config", "topology")
EARLIER_SPELLINGS = ("mixed_precision",)  # this project's earlier name of `precision=`
TOPOLOGY_AXES = {"pipe": "pp", "data": "dp", "model": "tp"}  # DeepSpeed axis -> mesh dimension


def adapt_build_args(sch: Schedule, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Today's `slapo.build` keyword arguments for a call written the 2023 way.

    - `target`: 2023's dialect names, any case: None, "deepspeed"; "megatron" (2023's Megatron
      dialect only parsed logs and built nothing) and unknown names are errors.
    - `config=`: the DeepSpeed config (a dict, or the path of a JSON file, as
      `deepspeed.initialize(config=)` took) -> `deepspeed_config=`; needs target="deepspeed".
    - `topology=`: DeepSpeed's `PipeModelDataParallelTopology` (or a {"pipe", "data", "model"}
      mapping): checked against the schedule's mesh, then dropped (the mesh decides; notice).
    - `init_weights=True` -> the default: delayed-init (meta) weights get the model's own init;
      materialised weights are kept (notice: 2023 re-initialised them). `init_weights=False` ->
      weights as they are; an error if some are still on meta (they cannot train).
    - `mixed_precision=` (the earlier name of `precision=`, not a 2023 one) -> `precision=`;
      both given and different is an error.
    Errors are raised before anything is built or changed.
    """
    out = dict(kwargs)
    unknown = sorted(set(out) - set(_BUILD_ARGS) - set(SPELLINGS_2023) - set(EARLIER_SPELLINGS))
    if unknown:
        raise SchedulingError(sch.path, f"build got unknown argument(s) {unknown}.",
                              f"today's arguments: {sorted(_BUILD_ARGS)}; 2023 spellings: "
                              f"{list(SPELLINGS_2023)} (docs/migrating.md).")
    if "mixed_precision" in out:
        out["precision"] = precision_arg(out.get("precision"), out.pop("mixed_precision"))
    out["target"] = _target(out.get("target"))
    config = out.pop("config", None)
    if config is not None:
        out["deepspeed_config"] = _deepspeed_config(config, out)
    topology = out.pop("topology", None)
    if topology is not None:
        _check_topology(sch, topology, out)
    if isinstance(out.get("init_weights"), bool):
        out["init_weights"] = _init_weights(sch, out["init_weights"])
    return out


def _build_arg_names() -> tuple[str, ...]:
    import inspect

    params = inspect.signature(_runtime_build).parameters.values()
    return tuple(p.name for p in params if p.kind is p.KEYWORD_ONLY)


_BUILD_ARGS = _build_arg_names()


def _target(target: Any) -> str | None:
    if target is None:
        return None
    name = str(target).lower()
    if name == "deepspeed":
        return "deepspeed"
    if name == "megatron":
        raise SchedulingError("", "target='megatron': Slapo 2023's Megatron dialect only parsed "
                              "Megatron-LM logs; its build(target='megatron') returned the "
                              "model as target=None does (one TP group, no pipeline), and "
                              "Megatron-LM's own loop trained it (docs/migrating.md, "
                              "'Megatron-LM').",
                              "use target=None (and hand the model to Megatron's loop), or "
                              "target='deepspeed'.")
    raise SchedulingError("", f"target={target!r} is not a Slapo target.",
                          "use None (the native runtime) or 'deepspeed'.")


def _deepspeed_config(config: Any, kwargs: dict[str, Any]) -> dict:
    """2023's `config=`: the DeepSpeed config, as a dict or a JSON file's path."""
    if kwargs.get("target") != "deepspeed":
        raise SchedulingError("", "config= is the DeepSpeed config (2023 passed it to "
                              "deepspeed.initialize), but target is not 'deepspeed'.",
                              "pass target='deepspeed', or drop config=.")
    if kwargs.get("deepspeed_config") is not None:
        raise SchedulingError("", "both config= (2023) and deepspeed_config= were given.",
                              "pass the DeepSpeed config once, as deepspeed_config=.")
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise SchedulingError("", f"config={str(config)!r}: cannot read a JSON DeepSpeed "
                                  f"config there ({e}).", "pass a dict or a JSON file path.") \
                from None
        if isinstance(loaded, dict):
            return loaded
    raise SchedulingError("", f"config= must be a dict or a JSON file path, got "
                          f"{type(config).__name__}.", "pass the DeepSpeed config dict.")


def _topology_dims(topology: Any) -> dict[str, int]:
    """{"pipe", "data", "model"} sizes of a DeepSpeed topology or a mapping (absent axes: 1)."""
    if isinstance(topology, Mapping):
        get = topology.get
    elif callable(getattr(topology, "get_dim", None)):
        get = topology.get_dim
    else:
        raise SchedulingError("", f"topology= must be DeepSpeed's PipeModelDataParallelTopology "
                              f"or a mapping, got {type(topology).__name__}.",
                              "drop topology=: the schedule's mesh (slapo.init_mesh) decides.")
    return {axis: int(get(axis) or 1) for axis in TOPOLOGY_AXES}


def _check_topology(sch: Schedule, topology: Any, kwargs: dict[str, Any]) -> None:
    """The 2023 topology must describe the layout the schedule's mesh already has.

    Without a mesh there is no data or pipeline dimension; the DeepSpeed target then spans the
    whole world with data parallelism, so its data axis is the world over the model axis."""
    dims = _topology_dims(topology)
    info = mesh_info(sch, kwargs.get("mesh"))
    have = {"pp": info.pp, "dp": info.dp, "tp": info.tp}
    if info.mesh is None and kwargs.get("target") == "deepspeed":
        have["dp"] = max(_g.world_size(None) // max(info.tp, 1), 1)
    wrong = {axis: (n, have[TOPOLOGY_AXES[axis]]) for axis, n in dims.items()
             if n != have[TOPOLOGY_AXES[axis]]}
    if wrong:
        said = ", ".join(f"{a}={n} (here {h})" for a, (n, h) in wrong.items())
        raise SchedulingError(sch.path, f"topology= says {said}; the layout comes from the "
                              "schedule's mesh here.",
                              f"create the schedule with slapo.create_schedule(model, mesh="
                              f"slapo.init_mesh(dp={dims['data']}, pp={dims['pipe']}, "
                              f"tp={dims['model']})), or drop topology=.")
    notice_once("build.topology", "slapo.build(topology=...): the 2023 DeepSpeed topology was "
                "checked against the schedule's mesh and is not used further; the mesh "
                "(slapo.init_mesh) decides the layout.", stacklevel=5)


def _init_weights(sch: Schedule, init: bool) -> None:
    """2023's boolean `init_weights`: True re-initialised every weight; here it initialises the
    delayed-init (meta) ones only, False initialises nothing."""
    meta = has_meta_tensors(sch.mod)
    if not init and meta:
        raise SchedulingError(sch.path, "init_weights=False, but some weights are still on the "
                              "meta device (delayed init) and cannot train.",
                              "pass init_weights=True (or a function), or load weights first.")
    if init and any(p.device.type != "meta" for p in sch.mod.parameters()):
        notice_once("build.init_weights", "slapo.build(init_weights=True) initialises only "
                    "delayed-init (meta) weights; weights already materialised (e.g. loaded) "
                    "are kept. Slapo 2023 re-initialised them.", stacklevel=5)
    return None

