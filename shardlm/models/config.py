"""Model shape and regularization, shared by GPT, BERT and Llama, and how a model's layers talk over their groups."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelOptions:
    """How a model's layers move data over the groups of its `ParallelContext`, and the precision of its output
    layer: build arguments, chosen by the run (`parallel.expert_dispatcher`, `parallel.cp_comm`,
    `train.cast_lm_head_to_fp32`); the context holds only the groups."""

    expert_dispatcher: str = "all_to_all"
    """How MoE layers move tokens over the expert-parallel group: "all_to_all" or "all_gather"
    (`shardlm.parallel.experts`)."""
    context_exchange: str = "ring"
    """How attention moves keys and values over the context-parallel group: "ring" or "allgather"
    (`shardlm.parallel.ring_attention`)."""
    lm_head_fp32: bool = False
    """The output layer in fp32 under autocast (`DecoderLM.fp32_head`)."""


@dataclass
class ModelConfig:
    """The `[model]` section of a run config."""

    arch: str = "gpt"
    """Architecture: "gpt" (causal LM), "bert" (masked LM + sentence order) or "llama" (RoPE, RMSNorm, SwiGLU, GQA)."""
    num_layers: int = 2
    """Transformer layers (l)."""
    hidden_size: int = 64
    """Hidden size (h); must divide by num_heads."""
    num_heads: int = 4
    """Attention heads; must divide by parallel.tensor."""
    num_kv_heads: int = 0
    """Llama: key/value heads of grouped-query attention (must divide num_heads); 0 means num_heads."""
    seq_length: int = 64
    """Sequence length (s): positions the model learns, and the training window."""
    vocab_size: int = 0
    """Real vocabulary size; 0 takes it from the tokenizer."""
    ffn_hidden_size: int = 0
    """MLP width; 0 means 4 x hidden_size (llama: 8h/3 rounded up to a multiple of 256)."""
    activation: str = "gelu"
    """MLP activation: "gelu" (exact erf) or "gelu_tanh" (the tanh approximation of OpenAI's GPT-2)."""
    dropout: float = 0.1
    """Dropout on embeddings and on both residual branches."""
    attention_dropout: float = -1.0
    """Dropout on attention probabilities; negative means the same as dropout."""
    layernorm_epsilon: float = 1e-5
    """LayerNorm epsilon (llama: RMSNorm epsilon)."""
    init_std: float = 0.02
    """Std of the normal initialization; the two residual projections use init_std / sqrt(2 l)."""
    layernorm_order: str = "pre"
    """BERT only: "pre" (the paper's rearranged order, as GPT-2) or "post" (original BERT)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times parallel.tensor (padding is masked out)."""
    rope_theta: float = 10000.0
    """Llama: base of the rotary position embedding's frequencies."""
    tie_embeddings: bool = False
    """Llama: use the input embedding as the output layer (GPT and BERT always tie it)."""
    head_dim: int = 0
    """Llama: channels per attention head; 0 means hidden_size / num_heads (Qwen3 sets it, e.g. 128 at h = 2048)."""
    qk_norm: bool = False
    """Llama: RMSNorm over each head's query and key before RoPE (Qwen3's q_norm and k_norm)."""
    qk_norm_scope: str = "head"
    """Llama with qk_norm: "head" (one RMSNorm per head, Qwen3) or "projection" (one RMSNorm over all heads' queries
    and one over all keys, OLMo 2 and 3)."""
    norm_placement: str = "pre"
    """Llama: "pre" (each block normalizes the input of attention and MLP) or "post" (OLMo 2 and 3: it normalizes their
    outputs before the residual add)."""
    attention_bias: bool = False
    """Llama: biases on the q, k and v projections (GLM-4.5's attention_bias; the output projection has none)."""
    rope_fraction: float = 1.0
    """Llama: share of each head's channels that RoPE rotates, the first ones (GLM-4.5's partial_rotary_factor 0.5)."""
    attention_output_bias: bool = False
    """Llama: a bias on the attention output projection too (gpt-oss; GLM-4.5 has none)."""
    attention_sinks: bool = False
    """Llama: a learned logit per head that joins every softmax row as one more key without a value (gpt-oss's
    sinks): softmax over [scores, sink], the sink's share dropped."""
    sliding_window: int = 0
    """Llama: on sliding-window layers a query attends to the last `sliding_window` tokens, itself included; 0: none."""
    layer_types: list = field(default_factory=list)
    """Llama: per layer "full_attention", "sliding_attention" (gpt-oss alternates them, starting with a sliding
    one) or "linear_attention" (Gated DeltaNet: Qwen3-Next and Qwen3.5 have three before each full one), one entry
    per layer; empty: every layer slides when sliding_window is set."""
    linear_num_key_heads: int = 0
    """Linear attention (Gated DeltaNet): query/key heads."""
    linear_num_value_heads: int = 0
    """Linear attention: value heads (a multiple of the key heads; each key head serves that many in turn)."""
    linear_key_head_dim: int = 0
    """Linear attention: channels per query/key head (the state is key x value channels per value head)."""
    linear_value_head_dim: int = 0
    """Linear attention: channels per value head."""
    linear_conv_kernel: int = 4
    """Linear attention: width of the short causal convolution over q, k and v."""
    hf_linear_projections: str = "separate"
    """Linear attention: how Hugging Face stores its input projections, for export: "separate" (Qwen3.5's
    in_proj_qkv, _z, _b, _a) or "grouped" (Qwen3-Next's in_proj_qkvz and in_proj_ba, per key head)."""
    linear_attention_rule: str = "gated_delta"
    """Linear attention: "gated_delta" (Gated DeltaNet: Qwen3-Next, Qwen3.5) or "kimi_delta" (Kimi Delta Attention:
    Kimi Linear; a decay per key channel from a low-rank gate, a low-rank sigmoid output gate; as many key as value
    heads, of as many channels)."""
    layer_pattern: str = ""
    """Llama: Nemotron-H's hybrid_override_pattern, one character per layer, each block one mixer: "M" Mamba-2, "*"
    attention without positions, "-" a ReLU^2 MLP, "E" an MoE layer of ReLU^2 experts (the moe_* keys; Nemotron 3)
    (docs/linear-attention.md); empty: Llama's blocks."""
    mamba_num_heads: int = 0
    """Mamba-2 layers: heads (H), split over parallel.tensor with the groups."""
    mamba_head_dim: int = 0
    """Mamba-2: channels per head (P); the layer's inner width is H x P."""
    mamba_state_size: int = 0
    """Mamba-2: state channels per group (N); each head's state is P x N."""
    mamba_groups: int = 0
    """Mamba-2: groups sharing B and C (and the gated norm's statistics), H / groups heads each; divisible by
    parallel.tensor."""
    mamba_conv_kernel: int = 4
    """Mamba-2: width of the causal depthwise convolution over x, B and C."""
    mamba_conv_bias: bool = True
    """Mamba-2: a bias on that convolution (Nemotron-H's use_conv_bias)."""
    mamba_chunk_size: int = 128
    """Mamba-2: tokens per chunk of the chunked scan (Nemotron-H's chunk_size; the result does not depend on it
    beyond rounding, the speed does)."""
    attention_output_gate: bool = False
    """Llama: a sigmoid gate on each attention head's output, from a second half of the q projection (Qwen3-Next)."""
    norm_zero_centered: bool = False
    """Llama: RMSNorms scale by 1 + weight, the weight starting at 0 (Qwen3-Next and Qwen3.5's block, final
    and q/k norms)."""
    attention: str = "mha"
    """Llama: "mha" (multi-head / grouped-query attention) or "mla" (DeepSeek-V3's multi-head latent attention)."""
    q_lora_rank: int = 0
    """MLA: rank of the query's low-rank path (q_a -> RMSNorm -> q_b); 0 uses one q projection."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed key/value latent."""
    qk_nope_head_dim: int = 0
    """MLA: per-head query/key channels without rotary embedding."""
    qk_rope_head_dim: int = 0
    """MLA: per-head query/key channels with rotary embedding (the key's are shared by all heads)."""
    v_head_dim: int = 0
    """MLA: per-head value channels."""
    mla_nope: bool = False
    """MLA: no rotary embedding (Kimi Linear's full-attention layers): the qk_rope_head_dim channels of the queries and
    of the shared key pass unrotated."""
    index_topk: int = 0
    """MLA with DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5; docs/sparse-attention.md): each query attends to
    the index_topk earlier keys of its document that its lightning indexer scores highest; 0: every key (dense)."""
    index_heads: int = 0
    """Sparse attention: the indexer's query heads (index_n_heads)."""
    index_head_dim: int = 0
    """Sparse attention: the indexer's channels per head, its first qk_rope_head_dim ones rotated (index_head_dim)."""
    index_layer_types: list = field(default_factory=list)
    """Sparse attention: per layer "full" (runs its own indexer) or "shared" (attends to the keys the last full
    layer chose: GLM-5's indexer_types); empty: every layer is "full"."""
    index_stage: str = "sparse"
    """Sparse attention: "sparse" (top-k attention; the indexer learns from its own loss, the rest from the
    language-model loss) or "warmup" (DeepSeek's dense warm-up: dense attention, only the indexers trained)."""
    index_loss_coeff: float = 1.0
    """Sparse attention: weight of the indexer's loss, the KL divergence from the main attention's head-summed
    distribution to the indexer's, per token (0: the indexer is not trained). Covers DeepSeek-V4's CSA indexer too
    (over its chosen compressed entries; frozen at 0)."""
    query_scale_beta: float = 0.0
    """MLA: Llama 4's long-context query scaling (Mistral 4's llama_4_scaling_beta): queries at position p multiplied by
    1 + beta x log(1 + floor(p / query_scale_positions)); 0 turns it off."""
    query_scale_positions: int = 0
    """MLA: the positions of one step of that scaling (Mistral 4's original_max_position_embeddings)."""
    rope_yarn_factor: float = 0.0
    """YaRN context extension factor of the rotary embedding (rope_scaling type "yarn"); 0 turns it off."""
    rope_yarn_original_positions: int = 0
    """YaRN: the pretraining context length (original_max_position_embeddings)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations bounding the extrapolated (unscaled) frequencies."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations bounding the interpolated (scaled) frequencies."""
    rope_yarn_mscale: float = 1.0
    """YaRN: mscale of the cos/sin factor mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: mscale_all_dim; when set, the softmax scale is multiplied by mscale(factor, mscale_all_dim)^2."""
    moe_num_experts: int = 0
    """Mixture-of-Experts (GPT and Llama): routed experts per MoE layer; 0 keeps every MLP dense (docs/moe.md)."""
    moe_top_k: int = 2
    """MoE: experts each token is routed to."""
    moe_ffn_hidden_size: int = 0
    """MoE: width of each expert's MLP; 0 means ffn_hidden_size (as computed for the dense MLP)."""
    moe_shared_experts: int = 0
    """MoE: always-on experts (DeepSeek), run as one dense MLP of width moe_shared_experts x the expert width."""
    moe_shared_ffn_hidden_size: int = 0
    """MoE: total width of the shared experts' MLP; 0 means moe_shared_experts x the expert width."""
    moe_shared_expert_gate: bool = False
    """MoE: scale the shared experts' output by sigmoid(w . x), a learned gate per token (Qwen3-Next, Qwen3.5)."""
    moe_first_dense_layers: int = 0
    """MoE: the first k layers keep a dense MLP (DeepSeek's first_k_dense_replace)."""
    moe_layer_interval: int = 1
    """MoE: after the first dense layers, every k-th layer is an MoE layer (1: all of them)."""
    moe_score: str = "softmax"
    """MoE router score of the fp32 gate logits: "softmax" (Qwen3), "sigmoid" (DeepSeek-V3), "sqrtsoftplus" (V4)."""
    moe_norm_topk_prob: bool = True
    """MoE: divide the top-k scores of a token by their sum (Mixtral and Qwen3 do; norm_topk_prob)."""
    moe_routed_scaling: float = 1.0
    """MoE: factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor)."""
    moe_groups: int = 0
    """MoE group-limited routing (DeepSeek-V3 n_group): experts in this many groups; 0 turns it off."""
    moe_topk_groups: int = 0
    """MoE group-limited routing: a token picks its experts from its best topk_group groups only."""
    moe_group_score: str = "auto"
    """MoE group-limited routing: a group's score is the sum of its two best experts' ("top2_sum": DeepSeek-V3,
    Mistral 4) or its best expert's ("max": DeepSeek-V2); "auto": top2_sum with sigmoid scores, max with softmax."""
    moe_aux_loss_coeff: float = 0.0
    """MoE: coefficient of the switch load-balancing loss E x sum_e f_e P_e over each micro-batch's tokens."""
    moe_aux_loss_type: str = "micro_batch"
    """MoE: the load-balancing loss over each micro-batch's tokens ("micro_batch"), or per sequence averaged over
    the sequences ("sequence": DeepSeek-V3's complementary sequence-wise loss, counts from the top-k of the
    unbiased scores)."""
    moe_router_bias: bool = False
    """MoE: a bias on the router's gate logits (gpt-oss)."""
    moe_linear_bias: bool = False
    """MoE: biases on each expert's gate/up and down projections (gpt-oss)."""
    swiglu_limit: float = 0.0
    """MoE experts: when > 0, gpt-oss's clamped SwiGLU: gate clamped above at the limit, up to [-limit, limit],
    out = (up + 1) x gate x sigmoid(swiglu_alpha x gate)."""
    swiglu_alpha: float = 1.702
    """MoE experts: the sigmoid's slope in gpt-oss's clamped SwiGLU."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range to whole channels (transformers' truncate; gpt-oss sets it false)."""
    rope_yarn_attention_factor: float = 0.0
    """YaRN: the cos/sin factor as a checkpoint states it (rope_scaling's attention_factor); 0 derives it from the
    factor and the mscales."""
    rope_llama3_factor: float = 0.0
    """Llama 3.1's rope scaling (rope_scaling type "llama3"): frequencies whose wavelength exceeds the original
    positions / low_freq_factor are divided by this factor, those below original / high_freq_factor kept, the ones
    between blended; 0 turns it off."""
    rope_llama3_low_freq_factor: float = 1.0
    """Llama 3.1's rope scaling: low_freq_factor."""
    rope_llama3_high_freq_factor: float = 4.0
    """Llama 3.1's rope scaling: high_freq_factor."""
    rope_llama3_original_positions: int = 8192
    """Llama 3.1's rope scaling: the pretraining context length (original_max_position_embeddings)."""
    rope_yarn_layers: str = "all"
    """YaRN: the layers whose rotary it scales, "all" or "full" (OLMo 3's long-context checkpoints: the full-attention
    layers; the sliding-window ones keep the unscaled rotary)."""
    moe_z_loss_coeff: float = 0.0
    """MoE: coefficient of the router z-loss, the mean of logsumexp(gate logits)^2."""
    moe_expert_bias_rate: float = 0.0
    """MoE aux-loss-free balancing (DeepSeek-V3): expert bias step per optimizer step; 0 uses no bias."""
    moe_expert_bias: bool = False
    """MoE: keep an expert bias at moe_expert_bias_rate = 0 too (a DeepSeek-V3 checkpoint's e_score_correction_bias)."""
    mtp_layers: int = 0
    """Llama: multi-token prediction depths (DeepSeek-V3's and V4's num_nextn_predict_layers); depth k predicts k+1
    ahead."""
    mtp_loss_weight: float = 0.1
    """Weight of the mean multi-token-prediction loss over the depths, added to the next-token loss."""
    sandwich_norms: bool = False
    """Llama: Gemma 4's block (`shardlm.models.gemma`, docs/gemma4.md): norms before and after attention and MLP, a
    fixed scalar on each layer's output; the other Gemma keys below need it."""
    embedding_scale: bool = False
    """Llama: multiply the word embeddings by sqrt(hidden_size) (Gemma; the tied output layer uses them unscaled)."""
    attention_scale: float = 0.0
    """Llama: the softmax scale of q k^T; 0 means 1 / sqrt(head_dim) (Gemma 4: 1, its q and k RMS-normalized)."""
    value_norm: bool = False
    """Llama: an RMSNorm without weight over each head's values (Gemma 4's v_norm)."""
    attention_k_eq_v: bool = False
    """Llama: full-attention layers have no v projection, their values are the k projection's output before k_norm
    and RoPE (Gemma 4's attention_k_eq_v)."""
    global_head_dim: int = 0
    """Llama: channels per head of the full-attention layers; 0 means head_dim (Gemma 4's global_head_dim)."""
    global_kv_heads: int = 0
    """Llama: key/value heads of the full-attention layers; 0 means num_kv_heads (Gemma 4's
    num_global_key_value_heads)."""
    global_rope_theta: float = 0.0
    """Llama: rotary base of the full-attention layers; 0 means rope_theta (the sliding layers' base)."""
    global_rope_fraction: float = 1.0
    """Llama: Gemma 4's proportional RoPE on the full-attention layers: the first fraction x head_dim / 2 frequencies
    theta^(-2i / head_dim) rotate (channel i with i + head_dim / 2), the rest stay still; 1: the whole head."""
    kv_shared_layers: int = 0
    """Llama: the last k layers compute no keys and values: each attends to those of the last earlier layer of its
    kind (sliding or full) that computes them (Gemma 4's num_kv_shared_layers)."""
    kv_shared_double_mlp: bool = False
    """Llama: the key/value-sharing layers' MLPs are twice ffn_hidden_size wide (Gemma 4's use_double_wide_mlp)."""
    per_layer_input_size: int = 0
    """Llama: Gemma 4's per-layer inputs: each layer adds a gated projection of its own slice (this wide) of a second
    embedding of the tokens plus a projection of the word embeddings (hidden_size_per_layer_input); 0: none."""
    per_layer_vocab_size: int = 0
    """Llama: rows of the per-layer embedding table; 0 means vocab_size (vocab_size_per_layer_input)."""
    final_logit_softcap: float = 0.0
    """Llama: logits become cap x tanh(logits / cap) (Gemma's final_logit_softcapping); 0: none."""
    moe_beside_mlp: bool = False
    """Llama with experts: Gemma 4's MoE block, run beside each layer's dense MLP on the same input (its own norms
    before and after, the two outputs summed) and routed by Gemma 4's router (an RMS-normalized input scaled per
    channel, softmax, the top-k renormalized and scaled per expert)."""
    hc_mult: int = 0
    """Llama: DeepSeek-V4's model (shardlm.models.deepseek_v4): this many hyper-connection residual streams; 0: none."""
    hc_sinkhorn_iters: int = 20
    """DeepSeek-V4: Sinkhorn-Knopp iterations making each layer's stream mixing doubly stochastic."""
    hc_eps: float = 1e-6
    """DeepSeek-V4: the floor added to the hyper-connections' weights and Sinkhorn sums."""
    compress_ratios: list = field(default_factory=list)
    """DeepSeek-V4: tokens per compressed entry per layer (then per mtp depth; a depth not listed: 0); 0: window
    only, smallest with index_topk: CSA, else HCA."""
    output_groups: int = 0
    """DeepSeek-V4: head groups of the grouped output projection (o_groups), each projected to output_rank."""
    output_rank: int = 0
    """DeepSeek-V4: channels each head group is projected to before the output projection (o_lora_rank)."""
    moe_hash_layers: int = 0
    """MoE: the first k layers route each token by a fixed token -> experts table (DeepSeek-V4's hash_moe)."""
    swiglu_clip: float = 0.0
    """SwiGLU experts: when > 0, silu(min(gate, clip)) x clamp(up, -clip, clip) (DeepSeek-V4's swiglu_limit)."""

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size or self.arch != "llama":
            return self.ffn_hidden_size or 4 * self.hidden_size
        return -(-8 * self.hidden_size // (3 * 256)) * 256  # SwiGLU's 2/3 of 4h, rounded up as Llama does

    @property
    def moe_ffn_size(self) -> int:
        """Width of one routed expert's MLP."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) has an MoE layer in place of its dense MLP (with `layer_pattern`: its
        "E" layers)."""
        if self.layer_pattern:
            return self.moe_num_experts > 0 and self.layer_pattern[index:index + 1] == "E"
        first = self.moe_first_dense_layers
        return self.moe_num_experts > 0 and index >= first and (index - first) % self.moe_layer_interval == 0

    def is_sliding_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) attends within the sliding window."""
        if not self.sliding_window:
            return False
        return not self.layer_types or self.layer_types[index % len(self.layer_types)] == "sliding_attention"

    def is_linear_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a linear-attention (Gated DeltaNet) layer (never a multi-token
        prediction depth's, index >= num_layers: Qwen3-Next's is a full-attention layer)."""
        if index >= self.num_layers or not self.layer_types:
            return False
        return self.layer_types[index % len(self.layer_types)] == "linear_attention"

    def index_source(self, index: int) -> int | None:
        """The layer whose indexer chooses layer `index`'s keys under sparse attention: itself ("full"), the
        last full layer before it ("shared"), or None without sparse attention (an MTP depth runs its own)."""
        if not self.index_topk:
            return None
        kinds = self.index_layer_types
        if index >= self.num_layers or not kinds:
            return index
        while index > 0 and kinds[index] == "shared":
            index -= 1
        return index

    @property
    def shared_ffn_size(self) -> int:
        """Width of the MoE layers' shared-expert MLP."""
        return self.moe_shared_ffn_hidden_size or self.moe_shared_experts * self.moe_ffn_size

    @property
    def attention_head_dim(self) -> int:
        """Channels per attention head: head_dim, or hidden_size / num_heads when it is 0."""
        return self.head_dim or self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads when it is 0 (plain multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    @property
    def attention_dropout_p(self) -> float:
        return self.dropout if self.attention_dropout < 0 else self.attention_dropout

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """vocab_size rounded up to a multiple of make_vocab_size_divisible_by x tensor_parallel."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple
