"""`--model` as a local HF model directory or a config file; pretrained weights, shard by shard.

    source = model_source("ckpts/gpt2-small")    # registry name, HF dir, or config.json
    model = source.build_empty()                 # parameters on meta (no memory), buffers real
    sch = model_schedule.apply(model, tp=2, ...) # shards meta parameters (ShardSpec on each)
    load_weights(sch.mod, source)                # each rank reads only its slices

`load_weights` reads every parameter with `safe_open(file).get_slice(key)[...]`: a
tensor-parallel shard (see `slapo.sharding.ShardSpec`: axis, blocks, rank) reads exactly the
rows/columns `sharding.local_slice` would keep, so no rank ever holds the whole model (the
shape of each piece is checked against the parameter). Tied parameters are read once.

Decisions:
- Only safetensors are read (`model.safetensors` or a sharded `model.safetensors.index.json`).
  `pytorch_model.bin` is a pickle that can run code: refused, with the conversion as the fix.
- A directory with config.json but no weights, or a config file, trains from a fresh init
  (the model's own `_init_weights`, seeded), like a registry model.
- Checkpoint keys match parameter names exactly, or across the base-model prefix (a
  `GPT2Model` checkpoint into `GPT2LMHeadModel`: `h.0...` -> `transformer.h.0...`). A parameter
  the checkpoint lacks is an error (a schedule that renamed parameters, a head the checkpoint
  does not have): a silent random init of a "pretrained" model is the failure mode this avoids.
  Checkpoint keys the model does not use (e.g. a pooler) are ignored and counted in the log.
- The task comes from `config.architectures[0]` (`*ForMaskedLM` -> masked, `*ForCausalLM` /
  `*LMHeadModel` -> causal, `*ForConditionalGeneration` / seq2seq LMs -> seq2seq), else from
  which transformers auto mapping knows the `model_type` (seq2seq, causal, then masked).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .. import sharding
from ..data.sources import InputError
from .models import REGISTRY
from .pretrained_experts import MergedKey, merged_key, renamed_key

CONFIG = "config.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
TASK_CLASSES = {"causal": "AutoModelForCausalLM", "masked": "AutoModelForMaskedLM",
                "seq2seq": "AutoModelForSeq2SeqLM"}


@dataclass(frozen=True)
class ModelSource:
    """Where `--model` points: a directory (config.json, maybe weights) or a config file."""

    path: Path
    config_file: Path

    @property
    def directory(self) -> Path | None:
        return self.path if self.path.is_dir() else None

    def config(self):
        """The transformers config (`AutoConfig.for_model(model_type, **fields)`)."""
        from transformers import AutoConfig

        fields = read_config(self.config_file)
        kind = fields.pop("model_type")
        try:
            return AutoConfig.for_model(kind, **fields)
        except (ValueError, KeyError) as e:
            raise InputError(str(self.config_file), f"transformers cannot build model_type "
                             f"{kind!r}: {e}", "use a model type this transformers "
                             "version knows, or upgrade transformers.") from None

    def task(self) -> str:
        return task_of(self.config())

    def has_tokenizer(self) -> bool:
        from ..data.tokenizer import TOKENIZER_FILES

        d = self.directory
        return d is not None and any((d / f).is_file() for f in TOKENIZER_FILES)

    def build_empty(self, dropout: float | None = None) -> nn.Module:
        """The model with parameters on the meta device (buffers real: rotary tables and masks
        are computed in `__init__`), fp32; nothing is allocated for the weights."""
        import transformers
        from accelerate import init_empty_weights

        config = self.config()
        if dropout is not None:
            set_dropout(config, dropout)
        auto = getattr(transformers, TASK_CLASSES[task_of(config)])
        with init_empty_weights(include_buffers=False):
            model = auto.from_config(config)
        model.tie_weights()  # accelerate's re-registered parameters lose HF's ties
        return model.float()

    def weight_files(self) -> dict[str, Path]:
        """{checkpoint key: safetensors file} ({} when the source holds no weights)."""
        return weight_files(self.directory) if self.directory is not None else {}


def is_model_path(name: str) -> bool:
    """Not a registry name: a path (existing, or spelled like one)."""
    return name.lower().replace("-", "_") not in REGISTRY and (
        Path(name).exists() or "/" in name or name.endswith(".json"))


def model_source(name: str) -> ModelSource:
    """Resolve a `--model` path; raises InputError naming the path and the fix."""
    path = Path(name)
    if not path.exists():
        raise InputError(name, "no such model directory or config file.",
                         f"pass a registry name ({', '.join(REGISTRY)}), a local directory "
                         "written by save_pretrained(), or a config.json file.")
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise InputError(name, "the directory has no config.json.",
                             "pass a directory written by model.save_pretrained() (config.json "
                             "and model.safetensors), or a config file.")
        source = ModelSource(path, path / CONFIG)
    else:
        source = ModelSource(path, path)
    read_config(source.config_file)  # fail early on a bad file
    return source


def read_config(path: Path) -> dict[str, Any]:
    try:
        fields = json.loads(Path(path).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(str(path), f"not a JSON config ({e}).",
                         "pass a config.json written by config.save_pretrained().") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise InputError(str(path), "has no 'model_type' field.",
                         "pass a config.json written by config.save_pretrained().")
    return fields


def task_of(config) -> str:
    """causal / masked / seq2seq (see the module docstring)."""
    from transformers.models.auto import modeling_auto as auto

    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch.endswith("ForMaskedLM"):
        return "masked"
    if arch.endswith(("ForCausalLM", "LMHeadModel")):
        return "causal"
    if arch.endswith("ForConditionalGeneration") or arch.endswith("ForSeq2SeqLM"):
        return "seq2seq"
    kind = config.model_type
    for task, names in (("seq2seq", auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
                        ("causal", auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                        ("masked", auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES)):
        if kind in names:
            return task
    raise InputError(kind, "is not a causal, masked or seq2seq language model type.",
                     "train a language model (set config.architectures, e.g. "
                     "['GPT2LMHeadModel']).")


def set_dropout(config, p: float) -> None:
    """Set every dropout probability the config has (names differ between families)."""
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout_prob",
                 "attention_probs_dropout_prob", "attention_dropout", "dropout", "dropout_rate",
                 "embed_dropout", "resid_dropout", "classifier_dropout_prob"):
        if hasattr(config, name) and isinstance(getattr(config, name), (int, float)):
            setattr(config, name, p)


def max_positions(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


# ---- weights ----------------------------------------------------------------------------------
def weight_files(directory: Path) -> dict[str, Path]:
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {k: directory / f for k, f in weight_map.items()}
    single = directory / SAFETENSORS
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as fh:
            return {k: single for k in fh.keys()}
    pickled = [n for n in PICKLE_WEIGHTS if (directory / n).is_file()]
    if pickled:
        raise InputError(str(directory / pickled[0]), "is a pickle (loading it could run code); "
                         "only safetensors weights are read.",
                         "convert once where you trust the file: AutoModel.from_pretrained(dir)"
                         ".save_pretrained(dir, safe_serialization=True).")
    return {}


def checkpoint_key(name: str, keys: dict[str, Path], prefix: str) -> str | None:
    """The checkpoint key of parameter `name`: equal, or across the base-model prefix."""
    if name in keys:
        return name
    if prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in keys:
        return name[len(prefix) + 1:]
    if prefix and f"{prefix}.{name}" in keys:
        return f"{prefix}.{name}"
    return None


def local_piece(sl, spec: sharding.ShardSpec | None) -> torch.Tensor:
    """Read this rank's part of a safetensors slice: everything, or, for a shard, the ranges
    `sharding.local_slice` keeps (one per block of a fused parameter), as `torch.chunk` cuts."""
    shape = list(sl.get_shape())
    if spec is None or spec.world_size == 1:
        return sl[tuple(slice(None) for _ in shape)] if shape else sl[:]
    block = shape[spec.axis] // spec.blocks
    size = math.ceil(block / spec.world_size)
    pieces = []
    for b in range(spec.blocks):
        lo = b * block + min(spec.rank * size, block)
        hi = b * block + min((spec.rank + 1) * size, block)
        index = [slice(None)] * len(shape)
        index[spec.axis] = slice(lo, hi)
        pieces.append(sl[tuple(index)])
    return torch.cat(pieces, dim=spec.axis) if len(pieces) > 1 else pieces[0]


def _spec(t: torch.Tensor) -> sharding.ShardSpec | None:
    """Where `t` sits in the checkpoint's whole tensor: its TP `ShardSpec`, or, for an
    expert-parallel parameter (`--ep`), its rows of the experts (`op.moe.expert_shard_spec`)."""
    from ..op.moe import expert_shard_spec

    return sharding.shard_spec(t) or expert_shard_spec(t)


def _full_shape(t: torch.Tensor) -> tuple[int, ...]:
    spec = _spec(t)
    return tuple(spec.orig_shape) if spec is not None else tuple(t.shape)


def _replace(mod: nn.Module, kind: str, name: str, old: torch.Tensor, value: torch.Tensor):
    """Put `value` in place of `old`, keeping the shard spec and Slapo's tags (as
    `slapo.init.materialize` does)."""
    from ..init import carry_records

    new = nn.Parameter(value, requires_grad=old.requires_grad) if kind == "p" else value
    carry_records(old, new)
    (mod._parameters if kind == "p" else mod._buffers)[name] = new
    return new


@torch.no_grad()
def load_weights(model: nn.Module, source: ModelSource,
                 only: set[str] | None = None) -> dict[str, int]:
    """Fill `model`'s meta parameters (and persistent buffers the checkpoint has) from the
    source's safetensors, each rank reading only its shards. `only`: the tensor names to fill
    (a pipeline rank's stages; the others stay on meta and are never read). Returns counts for
    the log: {"loaded", "unused_keys"}; {} when the source has no weights (fresh init)."""
    from safetensors import safe_open

    keys = source.weight_files()
    if not keys:
        return {}
    prefix = getattr(model, "base_model_prefix", "") or ""
    entries, key_of = _plan(model, keys, prefix, source, only)
    holders = _holders(model)
    handles: dict[Path, Any] = {}
    done: dict[int, torch.Tensor] = {}
    try:
        for mod, kind, name, t in entries:
            if id(t) not in done:
                key = key_of[id(t)]

                def open_key(k: str):
                    fh = handles.get(keys[k]) or handles.setdefault(
                        keys[k], safe_open(str(keys[k]), "pt", device="cpu"))
                    return fh.get_slice(k)
                sl = key.reader(open_key) if isinstance(key, MergedKey) else open_key(key)
                value = local_piece(sl, _spec(t))
                if tuple(value.shape) != tuple(t.shape):
                    raise InputError(f"{_where(key, keys)}", f"this rank's piece has shape "
                                     f"{tuple(value.shape)}, the parameter {tuple(t.shape)}.",
                                     "check that the checkpoint matches config.json.")
                done[id(t)] = _replace(mod, kind, name, t, value.to(t.dtype).contiguous())
            else:  # a tied name: point it at the first owner's new tensor
                (mod._parameters if kind == "p" else mod._buffers)[name] = done[id(t)]
    finally:
        handles.clear()
    # A tied tensor stays one tensor under every name, also names outside `only`: a pipeline
    # rank loads GPT-2's `transformer.wte.weight` for its first stage, and the last stage's
    # `lm_head.weight` (the same tensor) must point at it too, or `find_tied` no longer sees
    # one weight in two stages, and their gradients are never summed: the embedding and the
    # head would train apart, silently.
    for tid, value in done.items():
        for mod, kind, name in holders.get(tid, ()):
            (mod._parameters if kind == "p" else mod._buffers)[name] = value
    used = {key_of[id(t)] for _, _, _, t in entries if id(t) in key_of}
    read = {k for key in key_of.values() for k in _keys_of(key)}
    return {"loaded": len(used), "unused_keys": len(set(keys) - read)}


def _keys_of(key: str | MergedKey) -> list[str]:
    return key.keys() if isinstance(key, MergedKey) else [key]


def _where(key: str | MergedKey, keys: dict[str, Path]) -> str:
    first = _keys_of(key)[0]
    return f"{keys[first]}:{first}" + (f" (+{len(_keys_of(key)) - 1} per-expert keys)"
                                       if isinstance(key, MergedKey) else "")


def _holders(model: nn.Module) -> dict[int, list[tuple[nn.Module, str, str]]]:
    """id(tensor) -> every (module, "p"/"b", name) slot holding it (tied names included)."""
    out: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod in model.modules():
        for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
            for name, t in table.items():
                if t is not None:
                    out.setdefault(id(t), []).append((mod, kind, name))
    return out


def _plan(model: nn.Module, keys: dict[str, Path], prefix: str, source: ModelSource,
          only: set[str] | None = None) -> tuple[list, dict[int, str]]:
    """Every (module, "p"/"b", name, tensor) to fill: the meta parameters (each tied name) and
    the persistent buffers the checkpoint holds, of the names in `only` when given; and
    {id(tensor): checkpoint key}, over every name (a tied parameter is found under whichever
    name the checkpoint has). Every meta parameter must be found under one of its names with
    the checkpoint's full shape: all checked before anything is read."""

    entries, names_of, key_of = [], {}, {}
    adapted = adapter_layers(model)
    for path, mod in model.named_modules(remove_duplicate=False):
        tables = (("p", mod._parameters), ("b", mod._buffers))
        for kind, table in tables:
            for name, t in table.items():
                if t is None or (kind == "b" and name in mod._non_persistent_buffers_set):
                    continue
                if kind == "p" and t.device.type != "meta":
                    continue  # already materialised: not ours to overwrite
                full = f"{path}.{name}" if path else name
                key = checkpoint_key(base_name(full, adapted), keys, prefix)
                if key is None and kind == "p":  # HF's renamings; fused experts
                    own = base_name(full, adapted)

                    def look(k: str) -> str | None:
                        return checkpoint_key(k, keys, prefix)
                    key = renamed_key(model, own, look) or \
                        merged_key(model, own, _full_shape(t), keys, look)
                if kind == "b" and key is None:
                    continue
                if only is None or full in only:
                    entries.append((mod, kind, name, t))
                names_of.setdefault(id(t), full)
                if key is not None:
                    key_of.setdefault(id(t), key)
    missing = [n for i, n in names_of.items() if i not in key_of]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5
                                          else "")
        raise InputError(str(source.path), f"the checkpoint has no weights for {shown}.",
                         "save the model with save_pretrained() from the same architecture "
                         "(config.architectures), or train from the config alone (pass its "
                         "config.json file).")
    _check_shapes(entries, key_of, keys)
    return entries, key_of


@dataclass(frozen=True)
class _Shape:
    """A slice's shape only (the shape check reads no data)."""

    shape: tuple[int, ...]

    def get_shape(self) -> list[int]:
        return list(self.shape)


def adapter_layers(model: nn.Module) -> set[str]:
    """The paths of the PEFT adapter layers inside `model` (none without peft)."""
    from ..model_schedule.lora import is_tuner_layer

    return {p for p, m in model.named_modules() if is_tuner_layer(m)}


def base_name(name: str, adapted: set[str]) -> str:
    """The name a tensor of a LoRA layer's base had before PEFT wrapped it (PEFT moves the
    projection to `<path>.base_layer`): what the pretrained checkpoint calls it."""
    path, _, leaf = name.rpartition(".")
    if path.endswith(".base_layer") and path[:-len(".base_layer")] in adapted:
        return f"{path[:-len('.base_layer')]}.{leaf}"
    return name


def _check_shapes(entries: list, key_of: dict[int, str], keys: dict[str, Path]) -> None:
    from safetensors import safe_open

    want = {key_of[id(t)]: _full_shape(t) for _, _, _, t in entries}
    for key, shape in want.items():
        if isinstance(key, MergedKey):
            def open_key(k: str):
                with safe_open(str(keys[k]), "pt") as fh:
                    return _Shape(tuple(fh.get_slice(k).get_shape()))
            have = tuple(key.reader(open_key).get_shape())
            if have != shape:
                raise InputError(_where(key, keys), f"the per-expert tensors make a fused tensor "
                                 f"of shape {have}, the model expects {shape}.",
                                 "check that config.json belongs to these weights.")
    by_file: dict[Path, list[str]] = {}
    for key in want:
        if isinstance(key, MergedKey):
            continue
        by_file.setdefault(keys[key], []).append(key)
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as fh:
            for key in names:
                have = tuple(fh.get_slice(key).get_shape())
                if have != want[key]:
                    raise InputError(f"{file}:{key}", f"has shape {have}, the model expects "
                                     f"{want[key]}.",
                                     "check that config.json belongs to these weights.")
