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


def llama(seed: int = 0, layers: int = 2, dropout: float = 0.0, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=128,
                      max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, attention_dropout=dropout, **kw)
    return LlamaForCausalLM(cfg)


def ids(batch: int = 2, seq: int = 16, vocab: int = 128, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def _build(config_cls, model_cls, seed: int, **cfg):
    torch.manual_seed(seed)
    return model_cls(config_cls(**cfg))


def bert_mlm(seed: int = 0, layers: int = 2, dropout: float = 0.0):
    from transformers import BertConfig, BertForMaskedLM

    return _build(BertConfig, BertForMaskedLM, seed, hidden_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, intermediate_size=128, vocab_size=128,
                  max_position_embeddings=64, hidden_dropout_prob=dropout,
                  attention_probs_dropout_prob=dropout)


def roberta(seed: int = 0, layers: int = 2, dropout: float = 0.0):
    from transformers import RobertaConfig, RobertaForMaskedLM

    return _build(RobertaConfig, RobertaForMaskedLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                  vocab_size=128, max_position_embeddings=80, hidden_dropout_prob=dropout,
                  attention_probs_dropout_prob=dropout, pad_token_id=1)


def albert(seed: int = 0, layers: int = 2):
    from transformers import AlbertConfig, AlbertForMaskedLM

    return _build(AlbertConfig, AlbertForMaskedLM, seed, hidden_size=64, embedding_size=32,
                  num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                  vocab_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0)


def gpt_neo(seed: int = 0, layers: int = 2, dropout: float = 0.0):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    return _build(GPTNeoConfig, GPTNeoForCausalLM, seed, hidden_size=64, num_layers=layers,
                  num_heads=4, vocab_size=128, max_position_embeddings=64,
                  attention_types=[[["global", "local"], layers // 2]], window_size=8,
                  bos_token_id=0, eos_token_id=0, embed_dropout=dropout,
                  attention_dropout=dropout, resid_dropout=dropout)


def opt(seed: int = 0, layers: int = 2, dropout: float = 0.0):
    from transformers import OPTConfig, OPTForCausalLM

    return _build(OPTConfig, OPTForCausalLM, seed, hidden_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, ffn_dim=128, vocab_size=128, word_embed_proj_dim=64,
                  max_position_embeddings=64, dropout=dropout, attention_dropout=dropout,
                  bos_token_id=0, eos_token_id=0, pad_token_id=1)


def t5(seed: int = 0, layers: int = 2):
    from transformers import T5Config, T5ForConditionalGeneration

    return _build(T5Config, T5ForConditionalGeneration, seed, d_model=64, d_kv=16, d_ff=128,
                  num_layers=layers, num_decoder_layers=layers, num_heads=4, vocab_size=128,
                  decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0)


def t5_gated(seed: int = 0, layers: int = 2):
    """T5 v1.1 layout: gated-GELU `DenseReluDense` (`wi_0`, `wi_1`), untied LM head."""
    from transformers import T5Config, T5ForConditionalGeneration

    return _build(T5Config, T5ForConditionalGeneration, seed, d_model=64, d_kv=16, d_ff=128,
                  num_layers=layers, num_decoder_layers=layers, num_heads=4, vocab_size=128,
                  decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def qwen2(seed: int = 0, layers: int = 2):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(Qwen2Config, Qwen2ForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0)


def batch_for(family: str, batch: int = 2, seq: int = 16, seed: int = 1) -> dict:
    """Keyword inputs with labels, so `out.loss` is the training loss."""
    x = ids(batch, seq, seed=seed)
    if family in ("t5", "t5_gated", "mt5"):
        return {"input_ids": x, "labels": ids(batch, seq // 2, seed=seed + 1)}
    if family == "roberta":
        x = x.clamp(min=3)  # keep clear of padding/special ids
    return {"input_ids": x, "labels": x}


def qwen3(seed: int = 0, layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _build(Qwen3Config, Qwen3ForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=128, vocab_size=128,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0)


def mistral(seed: int = 0, layers: int = 2):
    """Mistral with a sliding window (4) shorter than `batch_for`'s 16 tokens, so the window
    mask, not `is_causal`, decides what each token sees (it changes the loss)."""
    from transformers import MistralConfig, MistralForCausalLM

    return _build(MistralConfig, MistralForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=128, max_position_embeddings=64,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, sliding_window=4)


def mt5(seed: int = 0, layers: int = 2):
    """mT5: T5 v1.1's gated-GELU layers with a tied head whose 5.x forward does not rescale
    the decoder output (T5's does)."""
    from transformers import MT5Config, MT5ForConditionalGeneration

    return _build(MT5Config, MT5ForConditionalGeneration, seed, d_model=64, d_kv=16, d_ff=128,
                  num_layers=layers, num_decoder_layers=layers, num_heads=4, vocab_size=128,
                  decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=True)


# HF's eager expert loop, the definition its kernels (grouped_mm, HF's CPU default in 5.24,
# which orders each expert's rows differently) agree with to roundoff: the MoE tests compare
# Slapo's experts against it exactly.
def mixtral(seed: int = 0, layers: int = 2, experts: int = 4, impl: str | None = "eager"):
    """Mixtral, 4 experts, top-2, with the router's auxiliary loss in `out.loss` (`impl`:
    HF's experts implementation; None: HF's default)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    chosen = {} if impl is None else {"experts_implementation": impl}
    return _build(MixtralConfig, MixtralForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=32, vocab_size=128, max_position_embeddings=64,
                  num_local_experts=experts, num_experts_per_tok=2,
                  output_router_logits=True, router_aux_loss_coef=0.02,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, **chosen)


def qwen3_moe(seed: int = 0, layers: int = 2, experts: int = 4):
    """Qwen3-MoE, 4 experts, top-2, `norm_topk_prob`, every layer sparse, aux loss on."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return _build(Qwen3MoeConfig, Qwen3MoeForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                  vocab_size=128, max_position_embeddings=64, num_experts=experts,
                  num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                  output_router_logits=True, router_aux_loss_coef=0.02,
                  experts_implementation="eager", bos_token_id=0, eos_token_id=0,
                  pad_token_id=0)


def deepseek_v3(seed: int = 0, layers: int = 2, experts: int = 4):
    """DeepSeek-V3: MLA attention, a dense first layer, then sigmoid-scored, group-limited
    routing (2 groups of 2 experts, 1 group per token, top-2) with the score-correction bias
    and a shared expert. HF's model has no auxiliary loss (bias-balanced routing)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return _build(DeepseekV3Config, DeepseekV3ForCausalLM, seed, hidden_size=64,
                  num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                  v_head_dim=16, intermediate_size=64, moe_intermediate_size=32,
                  n_routed_experts=experts, n_shared_experts=1, num_experts_per_tok=2,
                  n_group=2, topk_group=1, first_k_dense_replace=1, vocab_size=128,
                  max_position_embeddings=64, experts_implementation="eager",
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)


def causal_loss_as_is(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100,
                      shift_labels=None, **kw):
    """HF's `ForCausalLMLoss` without its `logits.float()`: the reference's loss in the model's
    own dtype (float64 here), as the fused loss computes it."""
    import torch.nn.functional as F

    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch
