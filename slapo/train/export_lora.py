"""`slapo export RUN_DIR --out DIR --adapter | --merge`: a LoRA run as PEFT's adapter directory
or as one merged Hugging Face model.

    slapo export runs/lora --out adapters/lora --adapter
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), "adapters/lora")
    slapo export runs/lora --out merged/lora --merge   # AutoModelForCausalLM.from_pretrained(...)

What a LoRA run's checkpoint holds: the adapters and their AdamW state, nothing of the frozen
base (`run_state` saves what the optimizer trains). Export therefore rebuilds the base the way
the run built it (`--model DIR`: its safetensors, read with the same loader; a registry model:
its seeded init), wraps it with the run's LoRA options (`assemble.with_lora`: the same targets,
rank, alpha) and fills the adapters from the checkpoint with `export.load_checkpoint_model`
(tensor-parallel shards read whole, whatever layout wrote them).

`--adapter` writes `PeftModel.save_pretrained` output (`adapter_config.json`, whose
`base_model_name_or_path` is the run's `--model` directory, and `adapter_model.safetensors`
with PEFT's key names), and checks it by loading it the way a user does,
`PeftModel.from_pretrained(AutoModel*.from_pretrained(base), OUT)`: its logits on a probe batch
must equal the rebuilt model's. A registry-model run has no base a user can load, so `--adapter`
is refused for it (`--merge` writes the whole model). `--merge` folds each adapter into its base
weight (`merge_and_unload`: W + B A alpha / r) and writes the plain model (export's own
`save_pretrained` path and reload check); the merged logits must equal the adapter model's up to
the rounding of that sum.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..data.sources import InputError

__all__ = ["check_mode", "lora_info", "lora_model", "merged", "trained_names", "write_adapter"]


def check_mode(cfg: Any, adapter: bool, merge: bool, where: Path) -> None:
    """Which export a run takes, refused before anything is read or written: a LoRA run needs
    `--adapter` or `--merge` (its checkpoint holds no base), a full run neither, and `--adapter`
    needs a base directory that `from_pretrained` loads."""
    from . import pretrained

    if adapter and merge:
        raise InputError(str(where), "--adapter and --merge write different directories.",
                         "pass one of them.")
    if cfg.lora_r and not (adapter or merge):
        raise InputError(str(where), f"is a LoRA run (--lora-r {cfg.lora_r}): its checkpoints "
                         "hold the adapters, not the whole model.",
                         "pass --adapter (a PEFT adapter directory) or --merge (the model with "
                         "the adapters merged in).")
    flag = "--adapter" if adapter else "--merge"
    if not cfg.lora_r and (adapter or merge):
        raise InputError(str(where), f"{flag}: the run trained no LoRA adapters (--lora-r 0).",
                         f"export it without {flag}.")
    if adapter and not _has_weights(cfg.model):
        raise InputError(str(where), f"--adapter: the run's base is a fresh init of "
                         f"{cfg.model!r}, which from_pretrained cannot load, so the adapters "
                         "would have no base.", "pass --merge (the whole model), or train LoRA "
                         "on a --model DIR with weights.")
    if pretrained.is_model_path(cfg.model):
        pretrained.model_source(cfg.model)  # the base must still be there


def _has_weights(model: str) -> bool:
    from . import pretrained

    if not pretrained.is_model_path(model) or not Path(model).is_dir():
        return False
    return bool(pretrained.model_source(model).weight_files())


def lora_model(cfg: Any) -> tuple[nn.Module, str, str | None]:
    """(PEFT model, task, tokenizer dir): the run's base rebuilt as `assemble.build` built it
    (one process, no schedule), wrapped with the run's LoRA options; the adapters are then the
    checkpoint's to fill."""
    from . import pretrained
    from .assemble import _load_pretrained, hf_model, with_lora
    from .export import _tokenizer_source
    from .models import build_model, get_model_spec
    from .setup import Env

    source = pretrained.model_source(cfg.model) if pretrained.is_model_path(cfg.model) else None
    tok_dir = _tokenizer_source(cfg, source)
    torch.manual_seed(cfg.seed)  # what `build` seeds before the model: a registry base's init
    if source is None:
        from ..data.tokenizer import load_tokenizer

        base = build_model(cfg.model, cfg.size(load_tokenizer(tok_dir)))[0]
        return with_lora(base, cfg), get_model_spec(cfg.model).task, tok_dir
    model = with_lora(source.build_empty(dropout=cfg.dropout), cfg)
    _load_pretrained(hf_model(model), source, cfg, Env(), log=lambda *a, **k: None)
    return model, source.task(), tok_dir


def lora_info(cfg: Any, adapter: bool) -> dict[str, Any]:
    """What `slapo_export.json` records of a LoRA export."""
    return {"export": "adapter" if adapter else "merged", "r": cfg.lora_r,
            "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout, "targets": cfg.lora_targets,
            "base": cfg.model}


def trained_names(model: nn.Module) -> set[str]:
    """The tensors a LoRA run's checkpoint holds: the adapters (what trained)."""
    return {n for n, p in model.named_parameters() if p.requires_grad}


def write_adapter(tmp: Path, model: nn.Module, cfg: Any, task: str,
                  check: bool) -> float | None:
    """PEFT's adapter directory of `model` into `tmp`, and (`check`) loaded onto the base as a
    user does; returns the largest logit difference (None: not checked)."""
    import peft

    from .export import _auto_class

    base_dir = str(Path(cfg.model).resolve())
    for config in model.peft_config.values():
        config.base_model_name_or_path = base_dir
    model.save_pretrained(str(tmp), safe_serialization=True)
    if not check:
        return None
    base = _auto_class(task).from_pretrained(base_dir, local_files_only=True)
    reloaded = peft.PeftModel.from_pretrained(base, str(tmp))
    from .export import compare_logits

    return compare_logits(model, reloaded, task, tmp, "PeftModel.from_pretrained")


def merged(model: nn.Module, task: str) -> tuple[nn.Module, float]:
    """The base with every adapter merged in (a plain HF model), and how far its probe logits
    are from the adapter model's (the rounding of W + B A alpha / r)."""
    from .export import _probe

    vocab = model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        want = _probe(model, task, vocab)
        plain = model.merge_and_unload()
        got = _probe(plain, task, vocab)
    diff = float((want - got).abs().max())
    if not torch.allclose(want, got, rtol=1e-4, atol=1e-5):
        raise RuntimeError(f"merging the adapters changed the logits by {diff:.3e} (please "
                           "report this: the merged model would not be what trained).")
    return plain, diff
