"""Recognising a PEFT wrapper (`peft.PeftModel`) and the Hugging Face model inside it: what the
ready schedules (`model_schedule.lora`) and the pipeline partition (`runtime.partition`) both
ask. `peft` is never imported here: a PEFT model cannot exist unless something imported it."""

from __future__ import annotations

import sys

import torch.nn as nn


def peft_module():
    """The `peft` module when something imported it, else None."""
    return sys.modules.get("peft")


def is_peft_model(mod: nn.Module) -> bool:
    peft = peft_module()
    return peft is not None and isinstance(mod, peft.PeftModel)


def peft_inner_path(mod: nn.Module) -> str | None:
    """The path of the wrapped Hugging Face model inside a `PeftModel` (`base_model.model` for
    tuners such as LoRA, `base_model` for prompt learning), None for any other module."""
    if not is_peft_model(mod):
        return None
    from peft.tuners.tuners_utils import BaseTuner

    return "base_model.model" if isinstance(mod.base_model, BaseTuner) else "base_model"


__all__ = ["is_peft_model", "peft_inner_path", "peft_module"]
