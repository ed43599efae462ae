"""MoE checkpoints in Hugging Face's per-expert format (`save_pretrained` and the Hub keep one
tensor per expert; the model fuses them) read by `slapo train --model DIR`'s loader
(`slapo/train/pretrained_experts.py`): the fused tensors equal what `from_pretrained` builds,
for Qwen2-MoE (gate|up concatenated) and Mixtral (its `block_sparse_moe.experts.*.w1/w3/w2`
renamed), and each tensor-parallel shard is read from the per-expert slices it covers."""

from __future__ import annotations

import pytest
import torch

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=48, vocab_size=64, max_position_embeddings=32)


def _saved(tmp_path, name: str):
    import transformers as tf

    cfg, cls = {
        "qwen2_moe": (lambda: tf.Qwen2MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=24,
                                                shared_expert_intermediate_size=32),
                      tf.Qwen2MoeForCausalLM),
        "mixtral": (lambda: tf.MixtralConfig(**TINY, num_local_experts=4), tf.MixtralForCausalLM),
    }[name]
    torch.manual_seed(0)
    model = cls(cfg())
    model.save_pretrained(tmp_path / name)
    return tmp_path / name, cls


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_fused_experts_read_from_per_expert_keys_equal_from_pretrained(tmp_path, name):
    from safetensors import safe_open

    from slapo.train.pretrained import load_weights, model_source

    path, cls = _saved(tmp_path, name)
    with safe_open(str(path / "model.safetensors"), "pt") as fh:  # really the per-expert form
        assert not any(k.endswith("experts.gate_up_proj") for k in fh.keys())
    want = cls.from_pretrained(path).state_dict()
    source = model_source(str(path))
    model = source.build_empty()
    counts = load_weights(model, source)
    assert counts["unused_keys"] == 0
    got = model.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_tensor_parallel_shard_reads_exactly_its_part(tmp_path):
    """Each rank's piece of a fused experts tensor, read from the per-expert slices, equals
    `sharding.local_slice` of the whole: gate|up split per block (expert TP), down_proj on its
    input features, and the experts axis (expert parallelism's split)."""
    from safetensors import safe_open

    from slapo import sharding
    from slapo.train.pretrained import checkpoint_key, local_piece, weight_files
    from slapo.train.pretrained_experts import merged_key

    path, cls = _saved(tmp_path, "qwen2_moe")
    whole = cls.from_pretrained(path).state_dict()
    keys = weight_files(path)
    model = cls.from_pretrained(path)
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        for name, axis, blocks in [("model.layers.1.mlp.experts.gate_up_proj", 1, 2),
                                   ("model.layers.1.mlp.experts.down_proj", 2, 1),
                                   ("model.layers.1.mlp.experts.gate_up_proj", 0, 1)]:
            key = merged_key(model, name, tuple(whole[name].shape), keys,
                             lambda k: checkpoint_key(k, keys, "model"))
            assert key is not None and len(key.parts) == (2 if "gate_up" in name else 1)
            for rank in range(2):
                spec = sharding.ShardSpec(tuple(whole[name].shape), axis, 2, rank, blocks)
                got = local_piece(key.reader(fh.get_slice), spec)
                want = sharding.local_slice(whole[name], axis, 2, rank, blocks)
                assert torch.equal(got, want), (name, axis, rank)


def test_a_missing_expert_is_still_the_loaders_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from slapo.data.sources import InputError
    from slapo.train.pretrained import load_weights, model_source

    path, _ = _saved(tmp_path, "qwen2_moe")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    source = model_source(str(path))
    with pytest.raises(InputError, match=r"no weights for model.layers.0.mlp.experts.gate_up_proj"):
        load_weights(source.build_empty(), source)
