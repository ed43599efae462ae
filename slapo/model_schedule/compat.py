"""Slapo 2023 `model_schedule.apply_schedule(model, key, **sch_config)` over `apply`.

    sch = apply_schedule(model, "gpt2", model_config=config, prefix="transformer",
                         attn_op_name="cuda", ckpt_ratio=0.5, checkpoint_method="uniform")

Each 2023 key maps onto a knob of `apply` (or a primitive call after it):

| 2023 key | here |
|---|---|
| `model_config` | accepted; the family is detected from `model.config` and must equal `key` |
| `fp16` / `bf16` | the model is cast before scheduling, as in 2023 (prefer `build(precision=)`) |
| `group` | the tensor-parallel group (`tp` is its size) |
| `prefix` | checked to exist; layer paths are found by the family's own suffixes |
| `delay_init` | accepted; nothing is created here, a meta model stays meta until `build` |
| `attn_op_name` | "cuda"/"triton" -> `attention="flash"` when flash-attn and CUDA exist, else "sdpa"; "auto"/"cutlass" -> "sdpa"; "native_*" (reference einsum) -> "eager" |
| `disable_fuse_bias_gelu` / `disable_fusion` | `fuse = not ...` (default: no fusion, as 2023) |
| `ckpt_ratio`, `checkpoint_method` | n = round(ratio * L) layers: "head" the first n, "uniform" n evenly spaced |
| `pipeline_cuts` | `cut_pipeline_stage()` after each listed layer; T5 takes `[[encoder cuts], [decoder cuts]]` and is always cut between encoder and decoder, as in 2023 (ALBERT is refused: one shared layer) |
| `sequence_parallel` | `sequence_parallel` |
| `disable_shard_embedding` | `vocab_parallel = not ...` |
| `bcast_input` | a forward pre-hook broadcasting tensor inputs from the group's first rank |

Fixed 2023 bugs: "uniform" checkpointed every floor(1/r)-th layer (r=0.34 gave every 2nd layer,
not a third of them) in GPT-2/GPT-Neo and the *first* layers in BERT/OPT/T5; here both methods
checkpoint exactly round(r * L) layers, placed as named. ALBERT honours the ratio. The ready
schedules underneath are today's (SDPA cores keep HF's masks: no encoder turns causal).

`"wideresnet"` (a torchvision-layout ResNet, bare or under the 2023 loss wrapper's `prefix=
"model"`; see `wideresnet.py`) takes `model_config` (accepted: 2023's `(width_per_group,
layers)`), `fp16`/`bf16`, `group`, `prefix`, `delay_init`, `ckpt_ratio` with
`checkpoint_method` per stage (2023 floored r * n_k and always took the first blocks),
`pipeline_cuts` as four lists (cut after `layer{k+1}[i]`), `bcast_input`, and `fuse_conv`
(2023: `torch.jit.trace`d Bottlenecks on CUDA, a speed-only change): accepted with a one-time
notice, the blocks run eagerly. The transformer keys (`attn_op_name`, `sequence_parallel`,
`disable_shard_embedding`, `disable_fuse_bias_gelu`, `disable_fusion`) are errors for it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ..errors import SchedulingError
from ..schedule import Schedule, create_schedule
from . import _common
from ._registry import apply, detect, layers_of, supported

KEYS_2023 = ("model_config", "fp16", "bf16", "group", "prefix", "delay_init", "attn_op_name",
             "disable_fuse_bias_gelu", "disable_fusion", "ckpt_ratio", "checkpoint_method",
             "bcast_input", "pipeline_cuts", "sequence_parallel", "disable_shard_embedding",
             "fuse_conv")
CHECKPOINT_METHODS = ("uniform", "head")
TRANSFORMER_KEYS = ("attn_op_name", "sequence_parallel", "disable_shard_embedding",
                    "disable_fuse_bias_gelu", "disable_fusion")


def apply_schedule(model: nn.Module, schedule_key: str, **sch_config: Any) -> Schedule:
    """Schedule `model` with the ready schedule `schedule_key` and 2023 configuration keys."""
    cfg = _validated(model, schedule_key, sch_config)
    if cfg.get("bf16") or cfg.get("fp16"):
        model.to(torch.bfloat16 if cfg.get("bf16") else torch.float16)
    sch = create_schedule(model, group=cfg.get("group"))
    if schedule_key == "wideresnet":
        _apply_wideresnet(sch, cfg)
        _bcast(sch, cfg)
        return sch
    ratio, method = float(cfg.get("ckpt_ratio", 0.0)), cfg.get("checkpoint_method", "uniform")
    apply(sch, ckpt_ratio=ratio if method == "head" else 0.0,
          attention=_attention(cfg.get("attn_op_name", "cuda")),
          fuse=not (cfg.get("disable_fuse_bias_gelu", True) and
                    cfg.get("disable_fusion", True)),
          sequence_parallel=bool(cfg.get("sequence_parallel", False)),
          vocab_parallel=not cfg.get("disable_shard_embedding", False))
    family = detect(sch.mod)
    if method == "uniform" and ratio > 0:
        _checkpoint_uniform(layers_of(sch, family), ratio)
    if cfg.get("pipeline_cuts"):
        _cut(sch, family, cfg["pipeline_cuts"])
    _bcast(sch, cfg)
    return sch


def _bcast(sch: Schedule, cfg: dict) -> None:
    if cfg.get("bcast_input") and sch.tp_size > 1:
        sch.mod.register_forward_pre_hook(_broadcast_hook(sch.group), with_kwargs=True)


def _apply_wideresnet(sch: Schedule, cfg: dict) -> None:
    """Channel TP (`apply`), then 2023's per-stage checkpointing and four-list cuts."""
    from . import wideresnet

    ratio, method = float(cfg.get("ckpt_ratio", 0.0)), cfg.get("checkpoint_method", "uniform")
    if not 0.0 <= ratio <= 1.0:
        raise SchedulingError(sch.path, f"ckpt_ratio must be in [0, 1], got {ratio}.",
                              "pass e.g. ckpt_ratio=0.5.")
    cuts = cfg.get("pipeline_cuts")
    if cuts:
        wideresnet.check_cut_lists(sch, cuts)
    if cfg.get("fuse_conv"):
        from ..notices import notice_once

        notice_once("wideresnet.fuse_conv", "apply_schedule(fuse_conv=True): 2023 traced the "
                    "Bottleneck blocks with TorchScript on CUDA (speed only); here the blocks "
                    "run eagerly (same numbers).")
    apply(sch)  # channel TP over the schedule's group (validated whole before any change)
    wideresnet.checkpoint_stages(wideresnet.stage_nodes(sch), ratio, method=method)
    if cuts:
        wideresnet.cut_lists(sch, cuts)


def _validated(model: nn.Module, key: str, cfg: dict) -> dict:
    """Every check before anything changes (a bad config leaves the model untouched)."""
    if key not in supported():
        raise SchedulingError("", f"unknown schedule key {key!r}.",
                              f"use one of: {', '.join(supported())}.")
    unknown = sorted(set(cfg) - set(KEYS_2023))
    if unknown:
        raise SchedulingError("", f"unknown apply_schedule option(s) {unknown}.",
                              f"use the 2023 keys {', '.join(KEYS_2023)}, or "
                              "slapo.model_schedule.apply for today's knobs.")
    family = detect(model).name
    if family != key:
        raise SchedulingError("", f"schedule key {key!r} does not fit this {family} model "
                              f"({type(model).__name__}).", f"use apply_schedule(model, "
                              f"{family!r}, ...).")
    if cfg.get("fuse_conv") and key != "wideresnet":
        raise SchedulingError("", "fuse_conv is a wideresnet option.", "drop it.")
    given = sorted(k for k in TRANSFORMER_KEYS if k in cfg)
    if key == "wideresnet" and given:
        raise SchedulingError("", f"{', '.join(given)} mean nothing for the wideresnet "
                              "schedule (a CNN has no attention, embedding or sequence).",
                              "drop them.")
    if cfg.get("pipeline_cuts") and key != "wideresnet":
        from ..runtime.partition import check_partitionable

        check_partitionable(model)  # ALBERT: refused here, not at build after the cuts
        _cut_paths(model, detect(model), cfg["pipeline_cuts"])
    if cfg.get("bf16") and cfg.get("fp16"):
        raise SchedulingError("", "bf16 and fp16 are both set.", "choose one.")
    if cfg.get("checkpoint_method", "uniform") not in CHECKPOINT_METHODS:
        raise SchedulingError("", f"unknown checkpoint_method {cfg['checkpoint_method']!r}.",
                              f"use one of {CHECKPOINT_METHODS}.")
    prefix = cfg.get("prefix")
    if prefix and prefix not in dict(model.named_modules()):
        raise SchedulingError("", f"prefix {prefix!r} is not a submodule of "
                              f"{type(model).__name__}.", "pass the base model's attribute "
                              "name (e.g. 'transformer' for GPT2LMHeadModel) or leave it out.")
    return cfg


def _attention(attn_op_name: str | None) -> str:
    from ..op import flash_attn_available
    from ..op.compat2023 import ATTN_OP_NAMES

    if attn_op_name is None or attn_op_name.startswith("native_"):
        return "eager"
    if attn_op_name not in ATTN_OP_NAMES:
        raise SchedulingError("", f"unknown attn_op_name {attn_op_name!r}.",
                              f"use one of {ATTN_OP_NAMES}.")
    if attn_op_name in ("cuda", "triton") and flash_attn_available():
        return "flash"
    return "sdpa"


def _checkpoint_uniform(layers: list[Schedule], ratio: float) -> None:
    """round-half-up(ratio * L) layers, evenly spaced (first one included)."""
    if not 0.0 <= ratio <= 1.0:
        raise SchedulingError("", f"ckpt_ratio must be in [0, 1], got {ratio}.",
                              "pass e.g. ckpt_ratio=0.5.")
    n = math.floor(ratio * len(layers) + 0.5)
    for i in sorted({math.floor(k * len(layers) / n) for k in range(n)}) if n else ():
        layers[i].checkpoint()


def _cut_paths(model: nn.Module, family, cuts: list) -> list[str]:
    """The layer paths 2023's `pipeline_cuts` cut after (one list of ints, or one list per
    layer list), checked before anything changes. T5 is always cut between its encoder and
    decoder too, as 2023's T5 schedule did."""
    per_list = cuts if cuts and isinstance(cuts[0], (list, tuple)) else [cuts]
    if len(per_list) > len(family.layer_lists):
        raise SchedulingError("", f"pipeline_cuts has {len(per_list)} lists but the "
                              f"{family.name} model has {len(family.layer_lists)} layer list(s).",
                              "pass one list of layer indices per layer list.")
    paths = []
    for n, (suffix, ks) in enumerate(zip(family.layer_lists, per_list)):
        base = _common.find_path(model, suffix)
        if base is None:
            raise SchedulingError("", f"the {family.name} schedule expects a submodule "
                                  f"'{suffix}', which this model does not have.",
                                  "check the model class.")
        count = len(model.get_submodule(base))
        final = n == len(family.layer_lists) - 1
        for k in ks:
            if not 0 <= k < count - final:
                raise SchedulingError("", f"pipeline cut {k} is outside 0..{count - 1 - final} "
                                      f"of '{suffix}' (a cut after the model's last layer leaves "
                                      "the next stage empty).", "cut after an existing layer.")
        paths += [f"{base}.{k}" for k in ks]
        if family.name == "t5" and not final and f"{base}.{count - 1}" not in paths:
            paths.append(f"{base}.{count - 1}")
    return paths


def _cut(sch: Schedule, family, cuts: list) -> None:
    for path in _cut_paths(sch.mod, family, cuts):
        sch[path].cut_pipeline_stage()


def _broadcast_hook(group):
    """Forward pre-hook: every tensor input takes the values of the group's first rank."""
    src = dist.get_global_rank(group, 0) if group is not None else 0

    def hook(module, args, kwargs):
        for t in [*args, *kwargs.values()]:
            if isinstance(t, torch.Tensor):
                dist.broadcast(t, src=src, group=group)
        return None

    return hook


def gen_embedding_hooks(sch: Schedule, vocab_size: int):
    """2023's `slapo.model_schedule.gpt2.gen_embedding_hooks(sch, vocab_size)`: the forward
    pre- and post-hook of a word embedding sharded over the vocabulary
    (`sch["wte"].shard("weight", axis=0)`), for `sync(mode="fwd_pre" / "fwd_post")`. Today's
    `shard` of an Embedding already maps the token ids to this rank's rows and zeroes the rows
    of ids it does not hold, which 2023's pre-hook and the first line of its post-hook did; so
    here the pre-hook changes nothing and the post-hook is the all-reduce of the ranks' partial
    embeddings (2023's `reduce_forward_output`). `vocab_size` is accepted for the 2023 call."""
    from ..distributed.collectives import reduce_forward

    group = sch.group

    def fwd_pre_hook(_module, _input):
        return None

    def fwd_post_hook(_module, _input, output):
        return reduce_forward(output, group)

    return fwd_pre_hook, fwd_post_hook


__all__ = ["CHECKPOINT_METHODS", "KEYS_2023", "apply_schedule", "gen_embedding_hooks"]
