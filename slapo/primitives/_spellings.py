"""2023 keyword spellings (Slapo 2023's API, docs/migrating.md) of `sch.trace(...)` and `sch.fuse(...)`, rewritten to today's.

The primitives call these from their `run`, so a 2023 schedule's calls reach the modern
primitive with its own validation. What maps to what (docs/migrating.md has the table):

trace: `tracer="pytorch"|"huggingface"` -> "fx" (one tracer handles HF models now, given
`example_inputs` where HF code reads shapes); `leaf_modules=` -> `leaves=`; `recursive=False`
-> every direct child is a leaf; `config=` (the HF tracer's dummy-input config) is dropped with a
notice; modules marked `traceable = False` (2023's leaf marker) are leaves. "dynamo" stays
refused by the primitive, with its reason. 2023 returned False on failure (which hid errors,
upstream issue #89); a failure now raises, and success returns the (truthy) GraphModule.

fuse: `compiler="TorchInductor"` -> "inductor"; `compiler="TorchScript"` (deprecated by PyTorch)
-> "inductor" with a one-time notice. `compiler=None` keeps today's meaning (no compilation).
"""

from __future__ import annotations

import torch.nn as nn

from ..notices import notice_once

_TRACERS_2023 = {"pytorch": "fx", "huggingface": "fx"}
_COMPILERS_2023 = {"TorchInductor": "inductor", "TorchScript": "inductor"}


def _untraceable(mod: nn.Module) -> list[str]:
    return [name for name, m in mod.named_modules() if name and
            getattr(m, "traceable", True) is False]


def trace_kwargs(sch, kwargs: dict) -> dict:
    """Today's trace keywords for a call that may use 2023 spellings (input not mutated)."""
    kw = dict(kwargs)
    tracer = kw.get("tracer")
    if isinstance(tracer, str) and tracer in _TRACERS_2023:
        kw["tracer"] = _TRACERS_2023[tracer]
    if "leaf_modules" in kw:
        extra = list(kw.pop("leaf_modules") or ())
        kw["leaves"] = list(kw.get("leaves") or ()) + extra
    if "config" in kw:
        kw.pop("config")
        notice_once("trace.config", "sch.trace(config=...) is the 2023 HF tracer's dummy-input "
                    "config; it is ignored. Pass example_inputs=(args, kwargs) if the model "
                    "reads input shapes while tracing.")
    recursive = kw.pop("recursive", True)
    leaves = list(kw.get("leaves") or ())
    if recursive is False:
        leaves += [n for n, _ in sch.mod.named_children()]
    if kw.get("tracer") != "export":
        leaves += _untraceable(sch.mod)
    if leaves:
        kw["leaves"] = list(dict.fromkeys(leaves))
    return kw


def fuse_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Today's fuse arguments for a call that may use 2023 compiler names (`compiler` may be
    the second positional argument, after the subgraph)."""
    if len(args) >= 2:
        return (args[0], _fuse_compiler(args[1]), *args[2:]), kwargs
    return args, fuse_kwargs(kwargs)


def _fuse_compiler(compiler):
    return fuse_kwargs({"compiler": compiler})["compiler"]


def fuse_kwargs(kwargs: dict) -> dict:
    """Today's fuse keywords for a call that may use 2023 compiler names."""
    kw = dict(kwargs)
    compiler = kw.get("compiler")
    if compiler == "TorchScript":
        notice_once("fuse.TorchScript", "fuse(compiler='TorchScript'): TorchScript is "
                    "deprecated in PyTorch; the subgraph is compiled with torch.compile "
                    "(backend 'inductor') instead.")
    if compiler in _COMPILERS_2023:
        kw["compiler"] = _COMPILERS_2023[compiler]
    return kw
