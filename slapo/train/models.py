"""Small configs of the architectures `slapo train` knows, built from configs (no download).

Each entry says which HF class to build and which task (data format) it trains on. Sizes are
tiny by default (hidden 128, 4 layers, 4 heads: ~0.8 M parameters) so CPU runs take seconds;
`--hidden-size/--num-layers/--num-heads` scale them. The vocabulary is the byte tokenizer's.

The mixtures of experts (`mixtral`, `qwen3_moe`, `deepseek_v3`; `ModelSpec.moe`) have
`--num-experts` experts
per layer (default 4), each token routed to `--experts-per-token` of them (default 2), and train
with HF's own loss *including* the auxiliary load-balancing loss (`output_router_logits=True`,
HF's `router_aux_loss_coef` 0.001; DeepSeek-V3 has none): what `model(..., labels=)` returns
is the loss
`slapo train` steps on. Their experts run HF's `"eager"` loop (`experts_implementation`), the
order of sums expert parallelism (`--ep`, `op.moe.ExpertParallelExperts`) reproduces, so a run
equals itself to roundoff on any ep; HF's default (`grouped_mm`) sums in another order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch.nn as nn

from ..data import ByteTokenizer


@dataclass(frozen=True)
class ModelSize:
    """Size of a registry model, and the vocabulary of its tokenizer (the byte tokenizer's by
    default; `--tokenizer DIR` sets `vocab_size` and the special ids from that tokenizer)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    max_positions: int = 1024
    dropout: float = 0.0
    vocab_size: int = ByteTokenizer.vocab_size
    pad_id: int | None = ByteTokenizer.pad_id
    bos_id: int | None = ByteTokenizer.bos_id
    eos_id: int | None = ByteTokenizer.eos_id
    experts: int = 4            # per MoE layer (the MoE models only)
    experts_per_token: int = 2  # top-k routing (the MoE models only)

    def special(self) -> dict[str, int | None]:
        return dict(pad_token_id=self.pad_id, bos_token_id=self.bos_id, eos_token_id=self.eos_id)

    def check(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden size {self.hidden} is not divisible by {self.heads} heads")
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"{self.experts_per_token} experts per token is not in 1..{self.experts}"
                             " (the experts per layer)")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    task: str  # "causal" | "masked" | "seq2seq" (see slapo.data.CorpusLoader)
    build: Callable[[ModelSize], nn.Module]
    description: str
    moe: bool = False  # a mixture of experts: --num-experts, --experts-per-token and --ep apply


def _gpt2(s: ModelSize) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=s.vocab_size, n_positions=s.max_positions, n_embd=s.hidden,
                     n_layer=s.layers, n_head=s.heads, resid_pdrop=s.dropout,
                     embd_pdrop=s.dropout, attn_pdrop=s.dropout, **s.special())
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # HF cannot infer it from the class name ("LMHead")
    return model


def _llama(s: ModelSize) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    kv_heads = s.heads // 2 if s.heads % 2 == 0 else s.heads  # grouped-query attention
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden,
                      intermediate_size=_multiple(8 * s.hidden // 3, 16),
                      num_hidden_layers=s.layers, num_attention_heads=s.heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=s.max_positions,
                      attention_dropout=s.dropout, tie_word_embeddings=False, **s.special())
    return LlamaForCausalLM(cfg)


def _opt(s: ModelSize) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=s.vocab_size, hidden_size=s.hidden, word_embed_proj_dim=s.hidden,
                    num_hidden_layers=s.layers, num_attention_heads=s.heads, ffn_dim=4 * s.hidden,
                    max_position_embeddings=s.max_positions, dropout=s.dropout,
                    attention_dropout=s.dropout, **s.special())
    return OPTForCausalLM(cfg)


def _gpt_neo(s: ModelSize) -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    if s.layers % 2:
        raise ValueError("gpt_neo alternates global and local attention: use an even --num-layers")
    cfg = GPTNeoConfig(vocab_size=s.vocab_size, hidden_size=s.hidden, num_layers=s.layers,
                       num_heads=s.heads, attention_types=[[["global", "local"], s.layers // 2]],
                       window_size=64, max_position_embeddings=s.max_positions,
                       embed_dropout=s.dropout, attention_dropout=s.dropout,
                       resid_dropout=s.dropout, **s.special())
    return GPTNeoForCausalLM(cfg)


def _bert(s: ModelSize) -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=s.vocab_size, hidden_size=s.hidden, num_hidden_layers=s.layers,
                     num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                     max_position_embeddings=s.max_positions, hidden_dropout_prob=s.dropout,
                     attention_probs_dropout_prob=s.dropout, pad_token_id=s.pad_id)
    return BertForMaskedLM(cfg)


def _roberta(s: ModelSize) -> nn.Module:
    from transformers import RobertaConfig, RobertaForMaskedLM

    # RoBERTa numbers positions from pad_token_id + 1, so the table needs that many extra rows.
    cfg = RobertaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden,
                        num_hidden_layers=s.layers, num_attention_heads=s.heads,
                        intermediate_size=4 * s.hidden,
                        max_position_embeddings=s.max_positions + (s.pad_id or 0) + 1,
                        hidden_dropout_prob=s.dropout, attention_probs_dropout_prob=s.dropout,
                        **s.special())
    return RobertaForMaskedLM(cfg)


def _albert(s: ModelSize) -> nn.Module:
    from transformers import AlbertConfig, AlbertForMaskedLM

    cfg = AlbertConfig(vocab_size=s.vocab_size, embedding_size=max(s.hidden // 2, 16),
                       hidden_size=s.hidden, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, intermediate_size=4 * s.hidden,
                       max_position_embeddings=s.max_positions, hidden_dropout_prob=s.dropout,
                       attention_probs_dropout_prob=s.dropout, **s.special())
    return AlbertForMaskedLM(cfg)


def _t5(s: ModelSize) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=s.vocab_size, d_model=s.hidden, d_kv=s.hidden // s.heads,
                   d_ff=4 * s.hidden, num_layers=max(s.layers // 2, 1),
                   num_decoder_layers=max(s.layers // 2, 1), num_heads=s.heads,
                   dropout_rate=s.dropout, pad_token_id=s.pad_id, eos_token_id=s.eos_id,
                   decoder_start_token_id=s.pad_id)
    return T5ForConditionalGeneration(cfg)


def _moe_common(s: ModelSize) -> dict:
    """What the MoE models share: sizes, top-k, HF's auxiliary loss in the returned loss, and
    HF's eager expert loop (module docstring)."""
    return dict(vocab_size=s.vocab_size, hidden_size=s.hidden, num_hidden_layers=s.layers,
                num_attention_heads=s.heads,
                num_key_value_heads=s.heads // 2 if s.heads % 2 == 0 else s.heads,
                max_position_embeddings=s.max_positions, attention_dropout=s.dropout,
                num_experts_per_tok=s.experts_per_token, output_router_logits=True,
                experts_implementation="eager", tie_word_embeddings=False, **s.special())


def _mixtral(s: ModelSize) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(num_local_experts=s.experts, intermediate_size=s.hidden,
                        **_moe_common(s))
    return MixtralForCausalLM(cfg)


def _qwen3_moe(s: ModelSize) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(num_experts=s.experts, moe_intermediate_size=_multiple(s.hidden // 2, 8),
                         intermediate_size=_multiple(8 * s.hidden // 3, 16),
                         head_dim=s.hidden // s.heads, norm_topk_prob=True,
                         decoder_sparse_step=1, **_moe_common(s))
    return Qwen3MoeForCausalLM(cfg)


def _deepseek_v3(s: ModelSize) -> nn.Module:
    """DeepSeek-V3: multi-head latent attention, a dense first layer (when there are two or
    more), sigmoid scores with the score-correction bias, group-limited top-k (2 groups, the
    best one per token, when the experts split in two and a group holds the top-k) and one
    shared expert. HF's model adds no auxiliary loss (bias-balanced routing)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    head = s.hidden // s.heads
    common = _moe_common(s)
    del common["output_router_logits"]  # no aux loss to ask for
    grouped = s.experts % 2 == 0 and s.experts_per_token <= s.experts // 2
    cfg = DeepseekV3Config(n_routed_experts=s.experts, n_shared_experts=1,
                           moe_intermediate_size=_multiple(s.hidden // 2, 8),
                           intermediate_size=_multiple(8 * s.hidden // 3, 16),
                           q_lora_rank=s.hidden // 2, kv_lora_rank=s.hidden // 4,
                           qk_rope_head_dim=_multiple(head // 2, 2),
                           qk_nope_head_dim=head - _multiple(head // 2, 2), v_head_dim=head,
                           n_group=2 if grouped else 1, topk_group=1,
                           first_k_dense_replace=min(1, s.layers - 1), **common)
    return DeepseekV3ForCausalLM(cfg)


def _multiple(n: int, k: int) -> int:
    return (n + k - 1) // k * k


MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("gpt2", "causal", _gpt2, "GPT-2 (learned positions, GELU MLP, tied embeddings)"),
    ModelSpec("llama", "causal", _llama, "LLaMA (RoPE, RMSNorm, SwiGLU, grouped-query attention)"),
    ModelSpec("opt", "causal", _opt, "OPT (ReLU MLP, learned positions with offset 2)"),
    ModelSpec("gpt_neo", "causal", _gpt_neo, "GPT-Neo (alternating global/local attention)"),
    ModelSpec("bert", "masked", _bert, "BERT masked LM (15% masking)"),
    ModelSpec("roberta", "masked", _roberta, "RoBERTa masked LM (15% masking)"),
    ModelSpec("albert", "masked", _albert, "ALBERT masked LM (shared layers, factorised embedding)"),
    ModelSpec("t5", "seq2seq", _t5, "T5 encoder-decoder (continue the text)"),
]}
# The mixtures of experts, apart from `MODELS` (the dense registry that the every-layout sweeps
# iterate: tp, FSDP2, pipelines, Tempo, the fused loss): their layouts are the ones expert
# parallelism composes with (one process, DDP, `--ep`), tested in tests/test_train_moe.py.
MOE_MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in [
    ModelSpec("mixtral", "causal", _mixtral, "Mixtral mixture of experts (softmax top-k, "
              "LLaMA attention; HF's aux load-balancing loss in the loss)", moe=True),
    ModelSpec("qwen3_moe", "causal", _qwen3_moe, "Qwen3-MoE mixture of experts (top-k "
              "renormalised, per-head q/k norms; HF's aux load-balancing loss)", moe=True),
    ModelSpec("deepseek_v3", "causal", _deepseek_v3, "DeepSeek-V3 mixture of experts (MLA "
              "attention, sigmoid group-limited routing with the correction bias, a shared "
              "expert, a dense first layer; no aux loss)", moe=True),
]}
REGISTRY: dict[str, ModelSpec] = {**MODELS, **MOE_MODELS}  # every name `--model` takes



def get_model_spec(name: str) -> ModelSpec:
    spec = REGISTRY.get(name.lower().replace("-", "_"))
    if spec is None:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(REGISTRY)}, or pass "
                         "a local HF model directory (config.json) or a config.json file")
    return spec


def shadowed_model(name: str) -> Path | None:
    """The local model directory a registry name also names: `./NAME` holding a config.json
    (what `--model DIR` fine-tunes). None for a name outside the registry (it is a path
    already), or a directory without a config.json (e.g. a run's --out named after its model:
    not a model, so the name is not ambiguous)."""
    if name.lower().replace("-", "_") not in REGISTRY:
        return None
    path = Path(name)
    return path if (path / "config.json").is_file() else None


def check_unambiguous(name: str) -> None:
    """Refuse a `--model` that is both a registry name and a local model directory: the
    registry used to win without a word, training a fresh model where the user meant to
    fine-tune theirs. Neither reading is safe to guess, so both ways out are named."""
    local = shadowed_model(name)
    if local is not None:
        spec = get_model_spec(name)
        raise ValueError(
            f"--model {name} is ambiguous: it names the registry architecture {spec.name!r} "
            f"and also the local model directory ./{local} (it holds a config.json). Pass "
            f"--model ./{local} to fine-tune that directory, or run from another directory "
            f"(or rename ./{local}) to train a fresh {spec.name!r}")


def build_model(name: str, size: ModelSize) -> tuple[nn.Module, ModelSpec]:
    """A freshly initialised model (seed the RNG first for a reproducible init)."""
    spec = get_model_spec(name)
    size.check()
    return spec.build(size), spec
