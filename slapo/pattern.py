"""2023 pattern language for `sch.find(pattern)`: `call_module`, `Pattern`, `ModulePattern`.

- `call_module("regex", *args)` inside a pattern function matches a `call_module` node whose
  target (the submodule path in the traced graph) contains a match of the regex, with its
  arguments matched like any other op's: `lambda x: F.gelu(call_module("fc|dense", x))`.
- A `Pattern` subclass is an nn.Module pattern whose torch.nn submodules match submodules of the
  same class (e.g. `self.fc = nn.Linear(1, 1)` matches any Linear, whatever its sizes).
- `ModulePattern("regex")` inside a `Pattern` matches submodules by path, as `call_module` does.

They are markers for today's matcher (slapo.graph.matcher), which honours them; there is no
separate 2023 matcher. Outside a trace, `call_module` is an error: it only describes a pattern.
"""

from __future__ import annotations

import re
from typing import Any

import torch.fx as fx
from torch import nn


def call_module(regex: str, *args: Any) -> Any:
    """Pattern placeholder: a call of any submodule whose path matches `regex`."""
    proxy = next((a for a in args if isinstance(a, fx.Proxy)), None)
    if proxy is None:
        raise TypeError("call_module(regex, ...) describes a pattern for sch.find(); it can "
                        "only be called while the pattern is traced (pass at least one input "
                        "of the pattern to it).")
    re.compile(regex)  # a bad regex fails here, at pattern definition, not inside the matcher
    return proxy.tracer.create_proxy("call_function", call_module, (regex, *args), {})


call_module._slapo_module_regex = True  # the matcher's marker


class Pattern(nn.Module):
    """Base class of module patterns: torch.nn submodules match by class (not by sizes)."""

    _slapo_match_by_type = True

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError("a Pattern subclass defines forward() as the ops to match.")


class ModulePattern(nn.Module):
    """A submodule of a `Pattern` that matches any submodule whose path matches `regex`."""

    def __init__(self, regex: str):
        super().__init__()
        re.compile(regex)
        self.regex = regex

    def forward(self, *args: Any) -> Any:
        return call_module(self.regex, *args)


__all__ = ["ModulePattern", "Pattern", "call_module"]
