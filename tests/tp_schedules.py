"""Megatron-style tensor-parallel schedules written with the module primitives only.

These are the schedules a user writes by hand (issue: core schedule language); the ready-made,
knob-driven versions live in `slapo.model_schedule`.
"""

from __future__ import annotations


def bert_tp(sch, checkpoint_layers=(), skip_sync: str | None = None):
    """Column-parallel q/k/v and FFN-in, row-parallel attention-out and FFN-out."""
    ws = sch.world_size
    for i, _ in enumerate(sch["encoder.layer"].child):
        layer = sch[f"encoder.layer.{i}"]
        attn = layer["attention.self"]
        for name in ("query", "key", "value"):
            attn[name].shard(["weight", "bias"], axis=0)
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        out = layer["attention.output.dense"]
        out.shard("weight", axis=1)
        if skip_sync != "attention_out":
            out.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        layer["intermediate.dense"].shard(["weight", "bias"], axis=0)
        layer["intermediate.dense"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        layer["output.dense"].shard("weight", axis=1)
        layer["output.dense"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if i in checkpoint_layers:
            layer.checkpoint()
    assert ws >= 1
    return sch


def gpt2_tp(sch, checkpoint_layers=(), vocab_parallel: bool = True):
    """GPT-2: fused c_attn (Conv1D, (in, 3*out)) sharded per q/k/v block; vocab-parallel
    embedding tied with the LM head."""
    ws = sch.world_size
    for i, _ in enumerate(sch["transformer.h"].child):
        blk = sch[f"transformer.h.{i}"]
        attn = blk["attn"]
        attn["c_attn"].shard("weight", axis=1, blocks=3)
        attn["c_attn"].shard("bias", axis=0, blocks=3)
        attn["c_attn"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        attn.set_attr("split_size", attn.mod.split_size // ws)
        attn["c_proj"].shard("weight", axis=0)
        attn["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        mlp = blk["mlp"]
        mlp["c_fc"].shard("weight", axis=1)
        mlp["c_fc"].shard("bias", axis=0)
        mlp["c_fc"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        mlp["c_proj"].shard("weight", axis=0)
        mlp["c_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if i in checkpoint_layers:
            blk.checkpoint()
    if vocab_parallel:
        wte = sch["transformer.wte"]
        wte.shard("weight", axis=0)              # also shards the tied lm_head.weight
        wte.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        sch["lm_head"].sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        sch["lm_head"].sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)
    return sch


def llama_tp(sch, checkpoint_layers=()):
    """LLaMA with grouped-query attention: q/k/v/gate/up column, o/down row parallel."""
    for i, _ in enumerate(sch["model.layers"].child):
        layer = sch[f"model.layers.{i}"]
        attn = layer["self_attn"]
        for name in ("q_proj", "k_proj", "v_proj"):
            attn[name].shard("weight", axis=0)
        attn.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        attn["o_proj"].shard("weight", axis=1)
        attn["o_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        mlp = layer["mlp"]
        mlp["gate_proj"].shard("weight", axis=0)
        mlp["up_proj"].shard("weight", axis=0)
        mlp.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
        mlp["down_proj"].shard("weight", axis=1)
        mlp["down_proj"].sync(mode="fwd_post", sync_op_or_fn="all_reduce")
        if i in checkpoint_layers:
            layer.checkpoint()
    emb = sch["model.embed_tokens"]
    emb.shard("weight", axis=0)
    emb.sync(mode="fwd_post", sync_op_or_fn="all_reduce")
    head = sch["lm_head"]
    head.shard("weight", axis=0)
    head.sync(mode="bwd_post", sync_op_or_fn="all_reduce")
    head.sync(mode="fwd_post", sync_op_or_fn="all_gather", axis=-1)
    return sch
