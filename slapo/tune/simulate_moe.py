"""The cluster simulator's model specs and DeepSeek-V3-shaped layers (`simulate.py` plans them):

- `GPTSpec` (GPT-2-shaped dense presets), `MoESpec` (mixtures of experts, optionally with a
  shared expert and dense first layers), `MLAMoESpec` (DeepSeek-V3's shape) and their presets;
- `MLA`, `MLALayerModel`: multi-head latent attention (DeepSeek-V2/V3) costed analytically in
  place of GPT-2's traced attention, with `LayerModel`'s interface (FLOPs, bytes moved, saved
  bytes per `(batch, tp, seq, cp)`), its parameters and its tp all-reduces;
- `FFNShard`: a SwiGLU MLP split by tp (Megatron: gate and up by columns, down by rows), the
  shared expert beside the routed ones and the dense first layers' MLP.

The analytic costs are for one (tp, cp) rank and one micro-batch in bf16, in the traced
model's conventions (`slapo.tune.op_costs`): GEMMs and attention count FLOPs only (they are
compute-bound at thousands of rows), the other ops count the bytes they read and write,
backward traffic is twice forward's, and attention FLOPs cover the whole s x s score matrix
(no causal halving) over every key of the sequence (a cp rank's queries meet all keys).
"""

from __future__ import annotations

from dataclasses import dataclass

_BF16 = 2


@dataclass(frozen=True)
class GPTSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    vocab: int = 51200  # GPT-2's 50257 padded to a multiple of 1024 (divisible by tp)
    seq: int = 2048

    @property
    def params(self) -> float:
        return self.layers * 12 * self.hidden**2 + (self.vocab + self.seq) * self.hidden

    @property
    def active_params(self) -> float:
        """Parameters one token runs through (the MFU's 6 FLOPs per parameter and token)."""
        return self.params

    @property
    def model_flops_per_token(self) -> float:
        """The MFU's training FLOPs per token: 6 x active parameters + attention's
        3 x (2 x 2 x seq x hidden) per layer (PaLM's 12 L H s: QK^T and PV, whole matrix)."""
        return 6 * self.active_params + 12 * self.layers * self.hidden * self.seq

    @property
    def cp_head_dim(self) -> int:
        """Head dim of the q, k, v, output tensors cp's exchanges move (`attn_shard`)."""
        return self.hidden // self.heads


GPT_MODELS = {
    "gpt-1.3b": GPTSpec("gpt-1.3b", 24, 2048, 16),
    "gpt-2.7b": GPTSpec("gpt-2.7b", 32, 2560, 32),
    "gpt-7b": GPTSpec("gpt-7b", 32, 4096, 32),
}


@dataclass(frozen=True, kw_only=True)
class MoESpec(GPTSpec):
    """A GPT whose FFNs are mixtures of `experts` SwiGLU experts of width `moe_intermediate`,
    each token routed to `top_k` of them, with untied input and output embeddings and rotary
    positions (no position table). Mixtral and Qwen3-MoE have no shared expert and no dense
    layer; DeepSeek-V3 (`MLAMoESpec`) has `shared_experts` (a SwiGLU of width
    shared_experts x moe_intermediate that every token runs through, `FFNShard`) and its first
    `dense_layers` layers have a dense SwiGLU of width `dense_intermediate` instead of experts.

    Per layer (H = hidden, I = moe_intermediate, E = experts, k = top_k):

    - attention share: GPT-2's block without its MLP (traced, `LayerModel`): 4H^2 + 4H weights
      (multi-head, head_dim H/heads), two norms (4H), and in MoE layers the router H x E;
    - experts: E x 3 x H x I weights (gate, up, down), E x 3 x H x I x 2 bytes in bf16;
      forward FLOPs per token k x 3 x 2 x H x I (its k experts' three GEMMs).

    `kv_heads` (GQA) enters only the bytes of cp's attention exchanges, as for dense models;
    the traced attention is multi-head.
    """

    experts: int
    top_k: int
    moe_intermediate: int
    kv_heads: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0  # the first layers, dense (HF's first_k_dense_replace)
    dense_intermediate: int = 0

    @property
    def expert_layer_params(self) -> int:
        """E x 3 x H x I: one layer's experts (gate, up, down projections, no bias)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def attention_params(self) -> int:
        """4H^2 + 4H (qkv and output projections with biases) + 4H (norms)."""
        h = self.hidden
        return 4 * h * h + 8 * h

    @property
    def attention_layer_params(self) -> int:
        """An MoE layer's non-FFN parameters: `attention_params` + H x E (router)."""
        return self.attention_params + self.hidden * self.experts

    @property
    def shared_intermediate(self) -> int:
        return self.shared_experts * self.moe_intermediate

    @property
    def shared_layer_params(self) -> int:
        """3 x H x shared_experts x I: one MoE layer's shared expert."""
        return 3 * self.hidden * self.shared_intermediate

    @property
    def dense_layer_params(self) -> int:
        """A dense layer: `attention_params` + 3 x H x dense_intermediate."""
        return self.attention_params + 3 * self.hidden * self.dense_intermediate

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers

    def _params(self, experts_run: float) -> float:
        moe = self.attention_layer_params + self.shared_layer_params + experts_run
        return (self.dense_layers * self.dense_layer_params + self.moe_layers * moe
                + 2 * self.vocab * self.hidden + self.hidden)

    @property
    def params(self) -> float:
        return self._params(self.expert_layer_params)

    @property
    def active_params(self) -> float:
        """The attention shares, the dense MLPs, the shared and the top-k experts, the embeddings."""
        return self._params(self.expert_layer_params * self.top_k / self.experts)


@dataclass(frozen=True, kw_only=True)
class MLAMoESpec(MoESpec):
    """A DeepSeek-V3-shaped MoE: `MoESpec` with multi-head latent attention (`MLA`, costed by
    the analytic `MLALayerModel` instead of GPT-2's traced attention) and a router of H x E
    weights (the score-correction bias is a buffer, not trained: not counted). Not modelled:
    the multi-token-prediction module (HF's model does not build it either), the
    group-limited routing's cost beyond a softmax router's."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def mla(self) -> MLA:
        return MLA(self.hidden, self.heads, self.q_lora_rank, self.kv_lora_rank,
                   self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)

    @property
    def attention_params(self) -> int:
        """MLA + the two RMSNorms (2H)."""
        return self.mla.params + 2 * self.hidden

    @property
    def model_flops_per_token(self) -> float:
        """6 x active parameters + 3 x 2 x seq x heads x (q/k head dim + v head dim) per layer."""
        m = self.mla
        return (6 * self.active_params
                + 6 * self.layers * self.seq * self.heads * (m.qk_head_dim + m.v_head_dim))

    @property
    def cp_head_dim(self) -> int:
        """(q/k head dim + v head dim) / 2 = 160: q + output and k + v move exactly their bytes
        (Ulysses' receive buffer q + k + v is then 6% under, 480 for 512 per head)."""
        return (self.mla.qk_head_dim + self.v_head_dim) // 2


MOE_MODELS = {
    # Qwen3-30B-A3B: 30.4B parameters here (30.5B: its attention has head_dim 128 and 4 KV heads)
    "qwen3-30b-a3b": MoESpec("qwen3-30b-a3b", 48, 2048, 32, vocab=151936, seq=4096, experts=128,
                             top_k=8, moe_intermediate=768, kv_heads=4),
    # Mixtral-8x7B: 47.5B here (46.7B: its attention has 8 KV heads)
    "mixtral-8x7b": MoESpec("mixtral-8x7b", 32, 4096, 32, vocab=32000, seq=4096, experts=8,
                            top_k=2, moe_intermediate=14336, kv_heads=8),
    # DeepSeek-V3 (transformers' DeepseekV3Config defaults): 671.0B parameters, 37.6B active
    "deepseek-v3": MLAMoESpec("deepseek-v3", 61, 7168, 128, vocab=129280, seq=4096, experts=256,
                              top_k=8, moe_intermediate=2048, shared_experts=1, dense_layers=3,
                              dense_intermediate=18432, q_lora_rank=1536, kv_lora_rank=512,
                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}


@dataclass(frozen=True)
class MLA:
    """The shape of multi-head latent attention (HF's `DeepseekV3Attention`), with
    H = hidden, n = heads, r_q = q_lora_rank, r_kv = kv_lora_rank, d_n = qk_nope_head_dim,
    d_r = qk_rope_head_dim, d_v = v_head_dim:

    - q: x -> q_a_proj (H x r_q) -> RMSNorm(r_q) -> q_b_proj (r_q x n(d_n + d_r));
    - k, v: x -> kv_a_proj_with_mqa (H x (r_kv + d_r)): the latent c_kv and one rotary key
      part k_r shared by all heads; c_kv -> RMSNorm(r_kv) -> kv_b_proj (r_kv x n(d_n + d_v));
    - o_proj (n d_v x H). No biases.

    Under tp the heads split (as Megatron-core splits MLA): q_b, kv_b by columns, o_proj by
    rows; the down projections q_a, kv_a and their norms are replicated (every rank needs the
    whole latents), so their FLOPs repeat on every tp rank.
    """

    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def replicated_params(self) -> int:
        """q_a_proj, kv_a_proj_with_mqa and their norms: H r_q + r_q + H (r_kv + d_r) + r_kv."""
        h, rq, rkv = self.hidden, self.q_lora_rank, self.kv_lora_rank
        return h * rq + rq + h * (rkv + self.qk_rope_head_dim) + rkv

    @property
    def split_params(self) -> int:
        """q_b_proj, kv_b_proj, o_proj: r_q n (d_n + d_r) + r_kv n (d_n + d_v) + n d_v H."""
        n = self.heads
        return (self.q_lora_rank * n * self.qk_head_dim
                + self.kv_lora_rank * n * (self.qk_nope_head_dim + self.v_head_dim)
                + n * self.v_head_dim * self.hidden)

    @property
    def params(self) -> int:
        return self.replicated_params + self.split_params

    def rank_params(self, tp: int) -> float:
        return self.replicated_params + self.split_params / tp


class MLALayerModel:
    """Per-layer costs of an `MLAMoESpec`'s attention share on one (tp, cp) rank: input
    RMSNorm, MLA, the residual add, the post-attention RMSNorm and the residual add after the
    FFN; the FFN (routed experts and router: `ExpertShard`; shared expert, dense MLP:
    `FFNShard`) is not in it. With T = batch x seq / cp local tokens, s = seq, n = heads / tp
    and `MLA`'s names:

    - forward FLOPs: 2T x (the rank's GEMM weights: r_q and r_kv projections whole, the rest
      1/tp) + 2Ts x n(d_n + d_r + d_v) (scores over the q/k head dim d_n + d_r, values over
      d_v); backward: twice the GEMMs, and flash attention's 2Ts x n(3(d_n + d_r) + 2d_v)
      (scores recomputed, dV, dP, dQ, dK);
    - forward bytes (`elementwise`): the four RMSNorms and the rotary embedding as fused
      kernels (read + write), the concatenations that build q and the per-head k, the copy of
      the attention output to o_proj's layout, the two residual adds; backward twice that;
    - saved (`saved_elements`): every GEMM's input (normed x, normed latents, the attention
      output as o_proj reads it), the norms' inputs, SDPA's q, k, v, output and fp32
      log-sum-exp, the post-attention norm's output (the FFN's input, which the router, the
      shared expert and the dispatch share), the norms' fp32 inverse RMS;
    - tp all-reduces: o_proj's output forward (T x H); backward the gradients of the latents
      and of the shared rotary key (T x (r_q + r_kv + d_r)), charged as one call.

    Approximated: kernels are assumed fused where HF runs several ops (RMSNorm's fp32 casts,
    rotary's interleave reshapes), flash attention's repeated K/V reads are not counted, and
    the weights' own traffic is not counted (compute-bound GEMMs). Not traced: these are
    closed forms; `tests/test_tune_simulate.py` checks them against hand arithmetic.
    """

    attention_only = True

    def __init__(self, spec: MLAMoESpec):
        self.spec = spec
        self.mla = spec.mla

    def rank_params(self, tp: int) -> float:
        """MLA (heads split by tp, down projections replicated) and the two layer norms."""
        return self.mla.rank_params(tp) + 2 * self.spec.hidden

    def _gemm_params(self, tp: int) -> float:
        m = self.mla
        return m.rank_params(tp) - m.q_lora_rank - m.kv_lora_rank  # the latents' norms are no GEMM

    def elementwise(self, tp: int) -> float:
        """Forward elements read + written per token by the non-GEMM ops (see the class)."""
        m, h = self.mla, self.spec.hidden
        n, rq, rkv, dr = m.heads / tp, m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim
        dq, dn, dv = m.qk_head_dim, m.qk_nope_head_dim, m.v_head_dim
        norms = 2 * h + 2 * rq + 2 * rkv + 2 * h  # input, q latent, kv latent, post-attention
        rope = 2 * (n * dr + dr)  # q's rotary part per head, the one shared rotary key
        concat = 2 * n * dq + (n * dn + dr + n * dq)  # q = [q_n, q_r]; k = [k_n, k_r per head]
        out_copy = 2 * n * dv
        residuals = 2 * 3 * h
        return norms + rope + concat + out_copy + residuals

    def saved_elements(self, tp: int) -> float:
        """Elements saved per token for backward (fp32 values count as two); see the class."""
        m, h = self.mla, self.spec.hidden
        n, rq, rkv = m.heads / tp, m.q_lora_rank, m.kv_lora_rank
        dq, dv = m.qk_head_dim, m.v_head_dim
        norm_in_out = 2 * h + 2 * rq + 2 * rkv + 2 * h  # each norm's input and (GEMM-input) output
        sdpa = n * (2 * dq + dv + dv) + 2 * n  # q, k, v, output; fp32 log-sum-exp
        o_proj_in = n * dv
        rstd = 2 * 4
        return norm_in_out + sdpa + o_proj_in + rstd

    def __call__(self, name: str, batch: int, tp: int, seq: int | None = None, cp: int = 1) -> float:
        s = self.spec.seq if seq is None else seq
        m = self.mla
        t = batch * s / cp
        gemm = 2 * t * self._gemm_params(tp)
        n = m.heads / tp
        attn_fwd = 2 * t * s * n * (m.qk_head_dim + m.v_head_dim)
        attn_bwd = 2 * t * s * n * (3 * m.qk_head_dim + 2 * m.v_head_dim)
        values = {
            "fwd_flops": gemm + attn_fwd,
            "bwd_flops": 2 * gemm + attn_bwd,
            "fwd_bytes": t * self.elementwise(tp) * _BF16,
            "bwd_bytes": 2 * t * self.elementwise(tp) * _BF16,
            "saved": t * self.saved_elements(tp) * _BF16,
            "input_bytes": t * self.spec.hidden * _BF16,
        }
        return float(values[name])

    def all_reduces(self, batch: int, seq: int | None = None, cp: int = 1) -> tuple[list[float], list[float]]:
        """Payload bytes of the tp all-reduces, (forward, backward); see the class."""
        t = batch * (self.spec.seq if seq is None else seq) / cp
        m = self.mla
        return ([t * self.spec.hidden * _BF16],
                [t * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * _BF16])


@dataclass(frozen=True)
class FFNShard:
    """A SwiGLU MLP of width `intermediate` on one tp rank for `tokens` tokens (bf16): DeepSeek's
    shared expert (every token, beside its routed ones; width shared_experts x
    moe_intermediate, as HF builds it) and its dense first layers' MLP. Megatron's split: gate
    and up by columns, down by rows, so each rank holds and computes 1/tp, and the output is
    all-reduced forward and the input gradient backward (T x H each, when tp > 1). Not split
    by ep: every rank runs it on its own tokens, replicated over dp like the attention.

    With T = tokens, i = intermediate / tp and W = 3Hi the rank's weights: forward FLOPs 2TW,
    backward twice; bytes (as `ExpertShard` counts its SwiGLU) 5Ti x 2 forward (silu reads and
    writes the gate, the product reads gate and up and writes), twice backward; saved
    4Ti x 2 (gate, up, silu(gate), their product: down's input; the MLP's input is the
    attention share's). Adding the shared expert's output to the routed one (3TH x 2 bytes) is
    not counted.
    """

    tokens: float
    hidden: int
    intermediate: int
    tp: int = 1

    @property
    def local_params(self) -> float:
        return 3 * self.hidden * self.intermediate / self.tp

    @property
    def fwd_flops(self) -> float:
        return 2 * self.tokens * self.local_params

    @property
    def bwd_flops(self) -> float:
        return 2 * self.fwd_flops

    @property
    def fwd_bytes(self) -> float:
        return 5 * self.tokens * self.intermediate / self.tp * _BF16

    @property
    def bwd_bytes(self) -> float:
        return 2 * self.fwd_bytes

    @property
    def saved(self) -> float:
        return 4 * self.tokens * self.intermediate / self.tp * _BF16

    @property
    def all_reduce_bytes(self) -> float:
        """One all-reduce's payload (forward: the output; backward: the input gradient)."""
        return self.tokens * self.hidden * _BF16
