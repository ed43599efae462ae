"""Ready schedules for real architectures.

    sch = slapo.model_schedule.apply(model, tp=2, ckpt_ratio=0.5, attention="sdpa")

`apply` detects the architecture from the model (`config.model_type`; a decoder no family
covers gets a family derived from the tensor-parallel plan its config declares, `hf_plan.py`)
and applies, in this order, each concern its knobs ask for:

1. `attention`: not given (the model's own), "eager" (HF's eager attention, forced), "sdpa" or
   "flash": swap the attention core of every HF attention module for Slapo's SDPA core
   (flash-attn on GPU for "flash");
2. `tp`: Megatron tensor parallelism over the schedule's group (column/row parallel projections,
   vocabulary-parallel embedding and LM head when the vocabulary divides);
3. `fuse`: trace each MLP and compile its bias+activation or gated activation (`fuse_compiler`,
   default inductor; the families in `fusion.PLANS`);
4. `tempo`: Tempo's memory-efficient GELU / LayerNorm / softmax-dropout-matmul, on whatever
   `fuse` left (a fused GELU stays fused);
5. `ckpt_ratio`: checkpoint the first round(ratio * L) layers;
6. `pp_stages`: pipeline cuts at evenly spaced layer boundaries;
7. `sequence_parallel` (with tp > 1; GPT-2, GPT-Neo, LLaMA, BERT, RoBERTa, OPT): Megatron
   sequence parallelism — norms, dropout and residuals on sequence shards, all-gather into /
   reduce-scatter out of the TP regions, norm gradients summed over the group (see
   docs/model_schedule.md).

Beyond transformers: a torchvision-layout ResNet/WideResNet (no HF config; detected by its
modules) gets channel tensor parallelism, per-stage checkpointing and pipeline cuts
(`wideresnet.py`); the transformer knobs are refused for it with a `KnobError`. Recurrent
models: `apply_rnn(model, layout=, compile_cell=, ckpt_chunk=)` swaps every nn.LSTM/nn.GRU for
the fused `slapo.op.rnn` module (`rnn.py`, docs/rnn.md).

Every knob is a plain value, so the tuner can search over them. `knobs.ScheduleKnobs` declares
each one once (help text, domain, tuning candidates) and validates them; `slapo train`'s flags and
TOML keys and `slapo tune`'s spaces derive from it. Supported families live one per
file; `supported()` lists them. To add one, write `slapo/model_schedule/<family>.py` with a
`Family` (see `_registry.py`) whose `tp_plan` is a `TPPlan` table, and register it
(`register_family`; the built-in ones are listed in `BUILTIN_FAMILIES` below).
"""

from __future__ import annotations

from . import albert, bert, gpt2, gpt_neo, llama, moe_families, opt, roberta, t5, wideresnet
from ._registry import Family, apply, detect, register_family, supported
from .compat import apply_schedule  # noqa: F401  (Slapo 2023 spelling, compat.py)
from .knobs import KnobError, ScheduleKnobs
from .plan import TPPlan
from .plan_block import shard_block
from .rnn import apply_rnn, rnn_paths

# The built-in families, registered here in one visible list (a family file only declares its
# `FAMILY`); users add theirs with `register_family`.
BUILTIN_FAMILIES = (gpt2.FAMILY, gpt_neo.FAMILY, llama.FAMILY, bert.FAMILY, roberta.FAMILY,
                    opt.FAMILY, t5.FAMILY, albert.FAMILY, wideresnet.FAMILY,
                    moe_families.MIXTRAL, moe_families.QWEN3_MOE, moe_families.DEEPSEEK_V3)
for _family in BUILTIN_FAMILIES:
    register_family(_family)

__all__ = ["BUILTIN_FAMILIES", "Family", "KnobError", "ScheduleKnobs", "TPPlan", "apply",
           "apply_rnn", "detect", "register_family", "rnn_paths", "shard_block", "supported"]
