"""Training without a KV cache unless the call asks for one (`training_without_cache`): what
checkpointed and compiled layers need, without changing the model's config. Split from
`_registry.py`, which calls it."""

from __future__ import annotations

import inspect
from typing import Any

import torch.nn as nn

from ..module_patch import module_meta
from ..schedule import Schedule


def training_without_cache(sch: Schedule) -> None:
    """Calls that do not ask for a KV cache run without one: checkpointed layers must not
    append to a cache twice (recomputation), and compiled layers would specialise on the
    `layer_idx` a cache is indexed by. A forward pre-hook on the root passes `use_cache=False`
    when the caller passed no `use_cache` and no cache (so every layer, T5's decoder stack with
    its own config copy included, gets False from its parent); `generate` passes `use_cache`
    itself, so generation keeps its cache (`generation_config.use_cache`).

    The model's configs are left as the user made them: setting `config.use_cache = False`
    here (as before) was written to disk by `save_pretrained`, so a saved model generated
    without a cache once loaded (issue 29). Installed once; `deepcopy` copies the hook. On a
    PEFT `PeftModel` the hook goes on the Hugging Face model inside (the wrapper's forward
    takes `**kwargs` and names no `use_cache`, so a hook there was never installed: a LoRA run
    kept its cache, which also made HF skip the packed-documents mask of `--sft pack`)."""
    from .lora import model_inside

    root = model_inside(sch).mod
    if _use_cache_position(type(root)) is None:  # the root takes no `use_cache`: no cache
        return
    meta = module_meta(root, create=True)
    if not meta.get("no_cache_unless_asked"):
        root.register_forward_pre_hook(_no_cache_unless_asked, with_kwargs=True)
        meta["no_cache_unless_asked"] = True


_USE_CACHE_AT: dict[type, int | None] = {}
_ABSENT = -1  # `use_cache` is a keyword-only parameter (or read from **kwargs)


def _use_cache_position(cls: type) -> int | None:
    """Where `use_cache` sits among the positional arguments of `cls.forward` (`_ABSENT`:
    keyword only), None when the forward does not name it."""
    if cls not in _USE_CACHE_AT:
        try:
            params = list(inspect.signature(cls.forward).parameters.values())[1:]  # no self
        except (TypeError, ValueError):
            params = []
        names = [p.name for p in params]
        if "use_cache" not in names:
            _USE_CACHE_AT[cls] = None
        else:
            positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY,
                                                               p.POSITIONAL_OR_KEYWORD)]
            _USE_CACHE_AT[cls] = positional.index("use_cache") if "use_cache" in positional \
                else _ABSENT
    return _USE_CACHE_AT[cls]


def _is_cache(value: Any) -> bool:
    return hasattr(value, "get_seq_length") and hasattr(value, "update")


def _no_cache_unless_asked(module: nn.Module, args: tuple, kwargs: dict):
    """The root's pre-hook (see `training_without_cache`): `use_cache=False` unless the call
    passes `use_cache` (by keyword or position) or a cache to continue."""
    if kwargs.get("use_cache") is not None:
        return None
    at = _use_cache_position(type(module))
    if at is None or (at != _ABSENT and len(args) > at):
        return None
    if any(_is_cache(v) for v in (*args, *kwargs.values())):
        return None
    return args, {**kwargs, "use_cache": False}
