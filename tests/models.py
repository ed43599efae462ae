"""Small Hugging Face models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def bert(seed: int = 0, layers: int = 2, dropout: float = 0.0, **kw):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                     intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                     hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, **kw)
    return BertModel(cfg)


def gpt2(seed: int = 0, layers: int = 2, dropout: float = 0.0, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=64, n_layer=layers, n_head=4, vocab_size=128, n_positions=64,
                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout,
                     attn_pdrop=dropout, **kw)
    return GPT2LMHeadModel(cfg)


def llama(seed: int = 0, layers: int = 2, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, **kw)
    return LlamaForCausalLM(cfg)


def ids(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)
