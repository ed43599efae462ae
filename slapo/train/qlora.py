"""QLoRA: `slapo train --model DIR --lora-r N --lora-4bit` trains LoRA adapters on a base
quantized to 4-bit NF4 by bitsandbytes.

    slapo train --model ckpts/llama --lora-r 8 --lora-4bit --precision bf16 --out runs/qlora
    torchrun --nproc-per-node 2 -m slapo.cli train --model ckpts/llama --lora-r 8 --lora-4bit

The run is PEFT's QLoRA recipe, step by step:

1. `AutoModel*.from_pretrained(DIR, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
   bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bf16
   under --precision bf16, else fp32), dtype=float32, device_map={"": device})`: every linear
   layer of the blocks becomes a `bitsandbytes.nn.Linear4bit` (the LM head stays unquantized,
   HF's rule); `quantization_config` holds exactly these settings (a test builds the same one).
2. `peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)`: the base
   frozen, fp16/bf16 parameters upcast to fp32.
3. The adapters by the path every LoRA run takes (`assemble.with_lora`: `lora_wrap.add_lora`,
   the family's projections or `--lora-targets`); PEFT dispatches its bitsandbytes layer
   (`peft.tuners.lora.bnb.Linear4bit`: base in 4-bit, A and B in fp32).

Decisions:
- HF's loader, not Slapo's shard-by-shard one (`pretrained.load_weights`): quantizing is
  bitsandbytes' job through `from_pretrained`, so the 4-bit bytes the run trains on are the
  ones a user gets with the same `BitsAndBytesConfig`, which is what `PeftModel.from_pretrained`
  of the exported adapter needs to reproduce the trained loss. Quantization is deterministic:
  a resume (or `slapo eval`) rebuilds the same bytes from DIR.
- What stays unquantized (embeddings, norms, LM head) is loaded in fp32 (`dtype=float32`), so
  PEFT's fp32 upcast has nothing left to do. This is what we want: Slapo trains on fp32 master
  weights with autocast for --precision bf16 (as every other run), the norms are the layers
  that upcast exists for (their mean and variance are computed in fp32 either way), and the
  frozen embedding and head in fp32 cost 2 bytes per parameter more than bf16, small next to
  the 4-bit projections (they get no gradient and no optimizer state). (Loading in bf16, as
  many QLoRA scripts do, would round them to bf16 before the upcast; fp32 keeps the
  checkpoint's values.)
- `use_gradient_checkpointing=False`: PEFT's default turns on HF's gradient checkpointing in
  every layer (and an input-requires-grad hook for the reentrant variant); activation
  checkpointing is the schedule's knob (`--ckpt-ratio`, non-reentrant), so the run checkpoints
  what was asked and nothing else.
- The checkpoint holds the adapters and their AdamW state, never the base: `run_state` saves
  the parameters the optimizer trains, but bitsandbytes also writes each Linear4bit's
  quantization state (`weight.absmax`, `weight.quant_map`, `weight.nested_*`,
  `weight.quant_state.*`) into `state_dict()`; a state-dict hook on those layers of the run's
  model (`drop_quant_state`) leaves them out.
- Not composed (refused by `TrainConfig.check`, before anything is built): --tp, --pp-stages,
  --cp, --dp-shard, --ep, --precision fp16/fp8 (`config_checks._check_qlora`); a registry model
  there, a config without weights and a missing bitsandbytes here (`check_source`, the first
  thing `assemble.build` does).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..data.sources import InputError

__all__ = ["INSTALL_FIX", "check_source", "compute_dtype", "drop_quant_state", "export_info",
           "load_4bit", "note", "quantization_config", "quantized_layers"]

INSTALL_FIX = "pip install slapo[qlora] (bitsandbytes), or drop --lora-4bit"


def check_source(cfg: Any, source) -> None:
    """What `--lora-4bit` needs of the machine and of `--model`, before anything is built or
    written: bitsandbytes imports, and the model is a directory with safetensors weights."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise InputError("--lora-4bit", f"QLoRA needs the bitsandbytes package ({e}).",
                         INSTALL_FIX + ".") from None
    if source is None or source.directory is None:
        raise InputError(cfg.model, "--lora-4bit quantizes a pretrained model's weights, and "
                         "this is a config file without weights (nothing to quantize).",
                         "pass --model DIR (a save_pretrained directory with "
                         "model.safetensors), or drop --lora-4bit.")
    if not source.weight_files():
        raise InputError(str(source.path), "--lora-4bit quantizes a pretrained model's "
                         "weights, and the directory has none (no model.safetensors).",
                         "save the model with save_pretrained() into it, or drop --lora-4bit.")


def compute_dtype(cfg: Any) -> torch.dtype:
    """The 4-bit layers' compute dtype: bf16 under --precision bf16, else fp32."""
    return torch.bfloat16 if cfg.precision == "bf16" else torch.float32


def quantization_config(cfg: Any):
    """The run's `BitsAndBytesConfig`: NF4, double quantization, the compute dtype."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype(cfg))


def load_4bit(source, cfg: Any, device: torch.device) -> nn.Module:
    """The source's model, its linear layers quantized to 4-bit NF4 on `device` (the rest in
    fp32), prepared by PEFT's `prepare_model_for_kbit_training` (base frozen; no gradient
    checkpointing: the schedule's knob), its quantization state kept out of `state_dict()`."""
    import peft
    import transformers

    from .pretrained import TASK_CLASSES, set_dropout, task_of

    config = source.config()
    if cfg.dropout is not None:
        set_dropout(config, cfg.dropout)
    auto = getattr(transformers, TASK_CLASSES[task_of(config)])
    where = device.type if device.index is None else f"{device.type}:{device.index}"
    model = auto.from_pretrained(str(source.directory), config=config, local_files_only=True,
                                 quantization_config=quantization_config(cfg),
                                 dtype=torch.float32, device_map={"": where})
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if not quantized_layers(model):
        raise InputError(str(source.path), "bitsandbytes quantized none of the model's layers "
                         "to 4-bit.", "use a model whose projections are nn.Linear layers, "
                         "or drop --lora-4bit.")
    drop_quant_state(model)
    return model


def quantized_layers(model: nn.Module) -> list[str]:
    """The paths of the bitsandbytes 4-bit layers inside `model`."""
    import bitsandbytes as bnb

    return [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]


def drop_quant_state(model: nn.Module) -> int:
    """Keep each 4-bit layer's quantization state (`<prefix>weight.absmax`, ...: the tensors
    bitsandbytes adds to `state_dict()` beside the packed weight) out of the model's state
    dict, so a run's checkpoint holds no part of the frozen base (`run_state` already leaves
    out the untrained parameters, the packed weights among them). Returns the layers hooked."""
    import bitsandbytes as bnb

    def hook(module, state, prefix, local_metadata):
        for key in [k for k in state if k.startswith(prefix + "weight.")]:
            del state[key]
        return state

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m._register_state_dict_hook(hook)
    return len(layers)


def note(model: nn.Module, source, cfg: Any) -> str:
    """One log line: what was quantized, and how."""
    return (f"loaded {source.path} with {len(quantized_layers(model))} linear layers in 4-bit "
            f"NF4 (bitsandbytes, double quantization, compute dtype "
            f"{str(compute_dtype(cfg)).removeprefix('torch.')}); the rest in fp32")


def export_info(cfg: Any, adapter: bool) -> dict[str, str]:
    """What `slapo_export.json` records of a QLoRA run's export: the base it trained on, and
    what the export is relative to it."""
    trained = (f"4-bit NF4 (bitsandbytes, double quantization, compute dtype "
               f"{str(compute_dtype(cfg)).removeprefix('torch.')})")
    if adapter:
        return {"trained_on": trained, "load": "PeftModel.from_pretrained onto the base loaded "
                "with the same BitsAndBytesConfig reproduces the trained model; onto the "
                "full-precision base it is that base plus the adapters"}
    return {"trained_on": trained, "merged_into": "the full-precision base weights read from "
            "the directory: its outputs differ from the trained (4-bit) model's by the "
            "quantisation error"}
