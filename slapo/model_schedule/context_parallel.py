"""Context parallelism in a ready schedule: on a mesh with cp > 1, `apply` gives every layer's
attention module the context-parallel core (`op/context_parallel.py`), over the mesh's "cp"
group, by the `cp_attention` knob ("allgather", "ring" or "ulysses").

Only attention changes: under cp each rank holds its chunks of every sequence from the
embedding to the loss (the step splits the batch: `runtime/context_parallel.py`), and
everything else a decoder computes is per token. Which families Slapo splits exactly (a
`Family.context_parallel` path; checked here before anything changes):

- LLaMA, Mistral, Qwen2, Qwen3 (the "llama" family): RoPE from the global `position_ids` the
  cp batch passes, GQA, causal; sliding-window layers (Mistral's, Qwen2/3's `layer_types`)
  masked by the window HF passes each layer.
- GPT-2: learned absolute positions, `wpe(position_ids)` of the same global ids (HF's default
  ids are the token indices, as the cp batch's are).
- BERT (`*ForMaskedLM`): bidirectional (the module's `is_causal` is False), learned absolute
  positions and token types split with the tokens, the masked-LM labels unshifted.
- OPT (causal) and RoBERTa (masked LM): learned positions that count only unpadded tokens;
  the split passes the model's own numbering, computed over the whole sequence before it
  (`runtime.context_parallel.position_rule`).
- Refused, naming why (`WHY_NOT`): GPT-Neo (attention outside HF's registry,
  local layers), ALBERT (one shared layer; not wired yet), T5 (a learned relative position
  bias over the whole sequence), and any family without a plan.
- Mixtral, Qwen3-MoE, DeepSeek-V3 (multi-head latent attention): the experts run per token
  (each rank routes its own tokens, to replicated experts or, with ep, to its ep group's); the
  load-balancing loss takes its statistics over the cp ranks (`op/router_balance.py`).

What cp does not compose with yet is refused too: `attention` (the cp core *is* the
attention), `tempo` (its attention replaces the core), and `fused_loss` with `pp_stages > 1`
(a pipeline's last stage computes the fused loss from its micro-batch's labels alone, without
the pre-shifted labels and the global token count). Equal to one process with the same knobs
(tests/test_context_parallel.py): pipelines (`pp_stages`: the decoder and encoder stages take
the cp batch's positions and key flags), the fused loss (the kernel takes `shift_labels` and
`num_items_in_batch` as HF's loss does), full activation checkpointing (recomputation repeats
the core's collectives in the same order on every rank) and compiled blocks with the ring
(its autograd function inside inductor layers). Allowed but not tested with cp: selective
checkpointing, compiled blocks with all-gather or Ulysses, `fuse` and `kernels`.
"""

from __future__ import annotations

from ..errors import SchedulingError
from ..module_patch import module_meta
from ..runtime.context_parallel import CP_META
from ..schedule import Schedule

WHY_NOT = {
    "gpt_neo": "its attention computes scores itself, outside HF's attention registry, and "
               "has local (windowed) layers",
    "albert": "its one shared layer is not wired for the cp core yet",
    "t5": "an encoder-decoder whose relative position bias spans the whole sequence",
    "wideresnet": "a CNN has no sequence",
}


def _refuse(sch: Schedule, cp: int, why: str, fix: str) -> SchedulingError:
    return SchedulingError(sch.path, f"the mesh has cp={cp}: {why}.", fix)


def check_context_parallel(sch: Schedule, family, layers: list[Schedule], *, attention,
                           tempo: bool, fused_loss: bool, pp_stages: int, cp_attention: str,
                           tp: int):
    """Every check of the mesh's cp against the model and the knobs, before anything changes.
    Returns the mesh's view (`runtime.mesh.MeshInfo`) when cp > 1, else None."""
    from ..op.hf_attention import is_hf_attention
    from ..runtime.mesh import MeshInfo

    info = MeshInfo.of(sch.mesh) if sch.mesh is not None else None
    if info is None or info.cp == 1:
        return None
    cp, rel = info.cp, family.context_parallel
    if rel is None:
        why = WHY_NOT.get(family.name, "it has no context-parallel plan")
        raise _refuse(sch, cp, f"family {family.name!r} cannot be split exactly over the "
                      f"sequence: {why}", "use a mesh with cp=1 (context parallelism supports "
                      "the llama family: LLaMA, Mistral, Qwen2, Qwen3; GPT-2; OPT; BERT, RoBERTa).")
    _check_config(sch, cp, getattr(sch.mod, "config", None))
    if cp_attention == "ulysses":
        _check_ulysses(sch, cp, tp, getattr(sch.mod, "config", None))
    # a pipeline's last stage computes the fused loss from its micro-batch's labels alone (no
    # pre-shifted labels, no global token count: `stages_decoder.FusedLossStage`)
    # the stages carry the router's statistics of their micro-batch's chunk only
    # (`runtime/stage_router.py`); summing them over the cp ranks is not built
    router = bool(getattr(getattr(sch.mod, "config", None), "output_router_logits", False))
    conflicts = {"attention": attention is not None, "tempo": tempo,
                 "fused_loss with pp_stages > 1": fused_loss and pp_stages > 1,
                 "output_router_logits with pp_stages > 1": router and pp_stages > 1}
    for knob, on in conflicts.items():
        if on:
            raise _refuse(sch, cp, f"{knob} does not compose with context parallelism yet "
                          "(module docstring of slapo/model_schedule/context_parallel.py)",
                          f"leave {knob.split()[0]} at its default on a cp mesh.")
    for layer in layers:
        if rel not in layer or not is_hf_attention(layer[rel].mod):
            raise _refuse(sch, cp, f"{layer.path}.{rel} is not an HF attention module the "
                          "context-parallel core can replace", "check the model's layout.")
    return info


def _check_ulysses(sch: Schedule, cp: int, tp: int, cfg) -> None:
    """Ulysses splits each tp rank's query heads over the cp ranks."""
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    if heads is not None and (heads // tp) % cp:
        raise _refuse(sch, cp, f"cp_attention='ulysses' splits the {heads // tp} query heads "
                      f"of each tp rank (num_attention_heads={heads}, tp={tp}) over the cp "
                      "ranks, which does not divide them", "use cp_attention='allgather' or "
                      "'ring', or a cp that divides the heads.")


def _check_config(sch: Schedule, cp: int, cfg) -> None:
    """Attention dropout is not computed by the cp core; an MoE load-balancing loss must be
    one `op.router_balance` can take over the cp ranks."""
    from ..op.router_balance import router_counts

    if getattr(cfg, "output_router_logits", False) and router_counts(cfg) is None:
        raise _refuse(sch, cp, "output_router_logits=True adds a load-balancing loss whose "
                      "experts and top-k the config does not name (num_local_experts or "
                      "num_experts, num_experts_per_tok)", "set output_router_logits=False, "
                      "or use cp=1.")
    for name in ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob"):
        if getattr(cfg, name, 0.0):  # LLaMA's, GPT-2's, BERT's
            raise _refuse(sch, cp, f"{name}={getattr(cfg, name)} is not implemented by "
                          "context-parallel attention", f"set {name}=0.0.")


def context_parallel(sch: Schedule, family, layers: list[Schedule], info, mode: str) -> None:
    """Install the cp core in every layer's attention (checked by `check_context_parallel`),
    and mark the model for `build` (which refuses a cp mesh without it)."""
    from ..op.context_parallel import install

    group = info.group("cp")
    for layer in layers:
        node = layer[family.context_parallel]
        node.replace(install(node.mod, group, mode, node.path))
    cfg = getattr(sch.mod, "config", None)
    if getattr(cfg, "output_router_logits", False):  # the aux loss over the cp ranks
        from ..module_patch import add_wrapper
        from ..op.router_balance import ContextParallelBalance, router_counts

        experts, top_k = router_counts(cfg)
        add_wrapper(sch.mod, ContextParallelBalance(group, info.replicas, experts, top_k,
                                                    cfg.router_aux_loss_coef))
    module_meta(sch.mod, create=True)[CP_META] = info.cp
