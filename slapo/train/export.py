"""`slapo export RUN_DIR --out HF_DIR`: a `slapo train` checkpoint as a Hugging Face directory.

    slapo export runs/gpt2-tp2 --out exported/gpt2      # newest intact checkpoint
    model = AutoModelForCausalLM.from_pretrained("exported/gpt2")

Why a separate step: a run's checkpoints are DCP directories written by every rank (tensor-
parallel shards as DTensors, pipeline stages by the rank that owns them, FSDP2 shards), built for
exact resume, not for sharing. Export reads one in a single process, with the same loaders that
run no code from the files (`run_state`), into the unsharded model the run started from, and
writes `save_pretrained` output: `config.json`, `model.safetensors`, the tokenizer, and
`slapo_export.json` (which run, step and checkpoint it came from).

Consolidation needs no process group: DCP's metadata holds every tensor's global shape, so each
tensor is read at full size, whatever the tp / pp / dp-shard layout that wrote it. A shard of a
fused parameter (GPT-2's `c_attn`, saved as `[..., blocks, rest, ...]`) is reshaped back.

A `--model DIR` run is rebuilt as `slapo train` built it: parameters on meta, filled from the
checkpoint, buffers as the constructor computes them (`allocate_for_checkpoint`: non-persistent
buffers such as rotary `inv_freq` or BERT's `position_ids` are in no checkpoint).

Checks, before anything is written: the checkpoint is verified (marker, sizes, sha256) and is
the directory's own run's (`run_owner.owner_problem`: a checkpoint of another run copied into
it is never exported); every parameter of the model must come from the checkpoint (a missing
one is an error, never a random init); after writing, the directory is loaded back with
`AutoModel*.from_pretrained` and its logits on a probe batch must equal the consolidated
model's (`check=False` skips this). The output directory is written as `OUT.tmp` and renamed;
a failure on the way removes `OUT.tmp`, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..data.sources import InputError
from . import checkpoint_read, checkpoints, export_lora, run_owner
from . import run_state as ckpt
from .pretrained import TASK_CLASSES

__all__ = ["ExportResult", "export_run", "load_checkpoint_model"]

EXPORT_FILE = "slapo_export.json"


@dataclass
class ExportResult:
    out: Path
    checkpoint: Path
    step: int
    tensors: int
    tokenizer: str | None      # where the tokenizer came from; None: byte-level ids
    max_logit_diff: float | None  # reloaded vs consolidated model (None: check skipped)


# ---- which checkpoint --------------------------------------------------------------------------
def pick(run_dir: Path, step: int | None, what: str = "export") -> Path:
    """The newest intact checkpoint of `run_dir`'s run (or the one of `step`), verified. A
    checkpoint of another run in the directory (see `run_owner.owner_problem`) is never taken:
    the export must be the model this run trained."""
    run_dir = Path(run_dir)
    if not (run_dir / checkpoints.CHECKPOINTS).is_dir():
        raise InputError(str(run_dir), "is not a `slapo train` run directory (no "
                         f"{checkpoints.CHECKPOINTS}/ inside).",
                         "pass the --out directory of a run that saved checkpoints "
                         "(--save-every N, or the final save).")
    if step is not None:
        path = checkpoints.checkpoint_dir(run_dir, step)
        reason = (run_owner.owner_problem(path, run_owner.run_id(run_dir)) or ckpt.verify(path)
                  if path.is_dir() else "no such checkpoint")
        if reason is not None:
            steps = sorted(checkpoints.step_of(p) for p in run_owner.own_candidates(run_dir))
            have = ", ".join(map(str, steps)) or "none"
            raise InputError(str(path), f"cannot {what} step {step}: {reason}.",
                             f"pick one of the saved steps ({have}) or leave --step out.")
        return path
    path, skipped = ckpt.find_resumable(run_dir)
    if path is None:
        why = "; ".join(f"{p.name}: {r}" for p, r in skipped) or "none saved"
        raise InputError(str(run_dir / checkpoints.CHECKPOINTS), f"no intact checkpoint ({why}).",
                         f"{what} another run, or resume this one to write a checkpoint.")
    return path


# ---- the model the run trained ---------------------------------------------------------------
def run_config(trainer: dict[str, Any], path: Path):
    """The run's TrainConfig from its trainer.json (unknown keys from a newer Slapo: error)."""
    from .config import TrainConfig, config_fields

    names = set(config_fields())
    saved = trainer["config"]
    unknown = sorted(set(saved) - names)
    if unknown:
        raise InputError(str(Path(path) / checkpoints.TRAINER_FILE), f"the run's config has options this Slapo does not "
                         f"know: {', '.join(unknown)}.", "export with the Slapo that trained it.")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()}
    return TrainConfig(**values)



def _tokenizer_source(cfg, source) -> str | None:
    if cfg.tokenizer is not None:
        return cfg.tokenizer
    if source is not None and source.has_tokenizer():
        return str(source.directory)
    return None


def unsharded_model(cfg) -> tuple[nn.Module, str, str | None]:
    """(model, task, tokenizer dir): the architecture the run trained, on one process, no
    schedule (the schedule changes how it runs, not its parameters' names or values)."""
    from ..data.tokenizer import load_tokenizer
    from . import pretrained
    from .models import build_model, get_model_spec

    source = pretrained.model_source(cfg.model) if pretrained.is_model_path(cfg.model) else None
    tok_dir = _tokenizer_source(cfg, source)
    if source is not None:  # parameters on meta until the checkpoint fills them (all must)
        return allocate_for_checkpoint(source.build_empty(dropout=cfg.dropout), cfg.model), \
            source.task(), tok_dir
    tokenizer = load_tokenizer(tok_dir)
    model = build_model(cfg.model, cfg.size(tokenizer))[0]
    return model, get_model_spec(cfg.model).task, tok_dir


def allocate_for_checkpoint(model: nn.Module, where: str) -> nn.Module:
    """Allocate (uninitialised, on CPU) the meta parameters and persistent buffers of a model
    built by `ModelSource.build_empty`, which the checkpoint then fills; every tensor the
    constructor computed stays as computed.

    Why not `model.to_empty()`: it re-allocates *every* tensor, also the non-persistent buffers
    the constructor computed from the config (LLaMA's rotary `inv_freq`, BERT's `position_ids`
    and `token_type_ids`), which no checkpoint holds, so they stayed uninitialised memory: wrong
    logits, or an index out of bounds. The run trained with the constructor's values (`slapo
    train` builds the same way), and `from_pretrained` recomputes them the same way, so keeping
    them is what reproduces the trained model, for any architecture. A tied parameter stays one
    tensor under all its names. A non-persistent buffer left on meta could be filled by nothing:
    refused, naming it."""
    new: dict[int, torch.Tensor] = {}
    for path, mod in model.named_modules(remove_duplicate=False):
        for kind, table in (("p", mod._parameters), ("b", mod._buffers)):
            for name, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if kind == "b" and name in mod._non_persistent_buffers_set:
                    full = f"{path}.{name}" if path else name
                    raise InputError(where, f"the model's non-persistent buffer {full} is "
                                     "built on the meta device; no checkpoint holds it, so "
                                     "export cannot recompute it.",
                                     "please report this architecture to Slapo.")
                if id(t) not in new:
                    value = torch.empty(t.shape, dtype=t.dtype)
                    new[id(t)] = (nn.Parameter(value, requires_grad=t.requires_grad)
                                  if kind == "p" else value)
                table[name] = new[id(t)]
    return model


def _auto_class(task: str):
    import transformers

    return getattr(transformers, TASK_CLASSES[task])


@torch.no_grad()
def load_checkpoint_model(path: Path, model: nn.Module, names: set[str] | None = None) -> int:
    """Fill `model` (unsharded, one process) from the DCP checkpoint at `path`; return how many
    tensors were read. Every parameter (of `names`, when given: a LoRA run's adapters) must be
    in the checkpoint."""
    import torch.distributed.checkpoint as dcp

    meta = checkpoint_read.SafeReader(str(path)).read_metadata().state_dict_metadata
    saved = {k[len("model."):]: m for k, m in meta.items() if k.startswith("model.")}
    own = {k: v for k, v in model.state_dict().items() if names is None or k in names}
    missing = [k for k in own if k not in saved and not _tied_elsewhere(model, k, saved)]
    if missing:
        raise InputError(str(path), f"the checkpoint lacks {len(missing)} of the model's "
                         f"tensors ({', '.join(missing[:5])}{'...' if len(missing) > 5 else ''}).",
                         "export the run with the same --model and options it trained with.")
    state = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype)
             for k in own if k in saved}
    for k, t in state.items():
        if t.numel() != own[k].numel():
            raise InputError(str(path), f"tensor {k} has {tuple(t.shape)} in the checkpoint, "
                             f"{tuple(own[k].shape)} in the model.",
                             "export with the --model / size options the run trained with.")
    with ckpt._quiet_single_process():
        dcp.load({"model": state}, storage_reader=checkpoint_read.SafeReader(str(path)),
                 planner=checkpoint_read.SafeLoadPlanner(path), no_dist=True)
    # a fused-parameter shard is saved in its block layout: the same elements, reshaped
    full = {k: t.reshape(own[k].shape).to(own[k].dtype) for k, t in state.items()}
    model.load_state_dict(full, strict=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return len(full)


def _tied_elsewhere(model: nn.Module, key: str, saved: dict) -> bool:
    """A tied parameter saved under its other name (HF ties lm_head to the embedding)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(q is p and name in saved for name, q in params.items())


# ---- export ------------------------------------------------------------------------------------
def _probe(model: nn.Module, task: str, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    kwargs = {"input_ids": ids}
    if task == "seq2seq":
        kwargs["decoder_input_ids"] = ids[:, :8]
    model.eval()
    return model(**kwargs).logits.float()


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()) and not force:
        raise InputError(str(out), "exists and is not empty.",
                         "pass a new --out directory (or --force to replace it).")


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None,
               check: bool = True, force: bool = False, adapter: bool = False,
               merge: bool = False, log=print) -> ExportResult:
    """Consolidate a `slapo train` checkpoint into a `save_pretrained` directory (see module
    docstring); a LoRA run (`--lora-r`) as PEFT's adapter directory (`adapter`) or merged
    into its base (`merge`): `export_lora`. Raises InputError (naming the path and the fix)
    before writing anything."""
    out = Path(out)
    _check_out(out, force)
    path = pick(Path(run_dir), step)
    trainer = ckpt.read_trainer(path)
    cfg = run_config(trainer, path)
    export_lora.check_mode(cfg, adapter, merge, Path(run_dir))
    if cfg.lora_r:
        model, task, tok_dir = export_lora.lora_model(cfg)
        count = load_checkpoint_model(path, model, names=export_lora.trained_names(model))
    else:
        model, task, tok_dir = unsharded_model(cfg)
        count = load_checkpoint_model(path, model)
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # whatever fails (the check, a full disk, Ctrl-C), no `OUT.tmp` is left behind
        info = {"run": str(Path(run_dir).resolve()), "run_id": run_owner.manifest_run_id(path),
                "checkpoint": path.name, "step": trainer["step"], "model": cfg.model,
                "task": task,
                "tokenizer": tok_dir or "bytes (slapo.data.ByteTokenizer: ids 0-255 are "
                "bytes; 256 pad, 257 bos, 258 eos, 259 mask)"}
        if cfg.lora_r:
            info["lora"] = export_lora.lora_info(cfg, adapter)
        if cfg.lora_4bit:  # a QLoRA run: what the export is relative to its 4-bit base
            from .qlora import export_info

            info["lora"]["qlora"] = export_info(cfg, adapter)
        if merge:
            model, info["lora"]["merge_max_logit_diff"] = export_lora.merged(model, task)
        diff = _write(tmp, model, task, tok_dir, info, check, adapter_of=cfg if adapter else None)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"exported {path} (step {trainer['step']}, {count} tensors) to {out}"
        + (f"; reloaded logits match (max diff {diff:.1e})" if diff is not None else ""))
    return ExportResult(out, path, trainer["step"], count, tok_dir, diff)


def _write(tmp: Path, model: nn.Module, task: str, tok_dir: str | None, info: dict,
           check: bool, adapter_of: Any = None) -> float | None:
    """The export into `tmp`: weights (`adapter_of`, a LoRA run's config: PEFT's adapter
    directory), tokenizer, provenance; then (`check`) the reload check."""
    if adapter_of is not None:
        diff = export_lora.write_adapter(tmp, model, adapter_of, task, check)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    if tok_dir is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tok_dir, local_files_only=True).save_pretrained(tmp)
    (tmp / EXPORT_FILE).write_text(json.dumps(info, indent=1))
    if adapter_of is not None:
        return diff
    return _check_reload(tmp, model, task) if check else None


def _check_reload(directory: Path, model: nn.Module, task: str) -> float:
    """Load the written directory with transformers and compare logits on a probe batch."""
    reloaded = _auto_class(task).from_pretrained(str(directory), local_files_only=True)
    return compare_logits(model, reloaded, task, directory, TASK_CLASSES[task])


def compare_logits(model: nn.Module, reloaded: nn.Module, task: str, where: Path,
                   how: str) -> float:
    """The export check: `reloaded` (the written directory loaded `how`) gives `model`'s logits
    on a probe batch, to 1e-5; the largest difference, or a RuntimeError."""
    vocab = model.get_input_embeddings().num_embeddings
    with torch.no_grad():
        want, got = _probe(model, task, vocab), _probe(reloaded, task, vocab)
    diff = float((want - got).abs().max())
    if not torch.allclose(want, got, rtol=0, atol=1e-5):
        raise RuntimeError(f"export check failed: {where} reloaded with {how} gives logits "
                           f"{diff:.3e} off the checkpoint's model (please report this: the "
                           "export would not be what trained).")
    return diff
