"""What Mixture-of-Experts layers and expert parallelism add to the plan (shardlm's `models.moe`).

- activated parameters: the weights one token uses, i.e. every parameter less, in each MoE layer, the
  E - k routed experts it does not visit (what `plan.flops.flops_per_token` charges per token);
- the activations one MoE layer saves for one micro-batch on one rank (`moe_layer_activation_bytes`),
  with dropless routing assumed uniform: each rank's experts receive b s k rows in expectation,
  whatever the expert-parallel size E (a skewed router loads some ranks more: not modelled);
- the all-to-all bytes of one MoE layer (`all_to_all_bytes`): each rank sends the (token, slot) rows
  of the experts held elsewhere, (E - 1) / E of its b s k rows, at dispatch and again at combine.

Parameters and their state per rank are `parameters.parameter_count` (experts / E) and `memory.state_memory`
(expert state sharded over the DP x CP / E expert-DP ranks: EP folds over DP x CP); the all-to-all time is
`timing.all_to_all_seconds`. Under context parallelism the planner passes the model at a CP rank's T / C
tokens, so the activations and all-to-all bytes here are those of the tokens the rank routes.
"""

from __future__ import annotations

from shardlm.models.config import ModelConfig
from shardlm.plan.memory import NumericFormat, layer_activation_bytes
from shardlm.plan.parameters import parameter_count


def moe_layer_count(cfg: ModelConfig) -> int:
    """Layers whose MLP is an MoE layer (`cfg.is_moe_layer`)."""
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))


def expert_parameters(cfg: ModelConfig) -> int:
    """Elements of one routed expert: gate, up and down (Llama's SwiGLU) or fc and proj (GPT), f_e x h each, and with
    `moe_linear_bias` (gpt-oss) the gate/up and down biases. Nemotron-H's experts (`layer_pattern`) are ReLU^2 MLPs:
    up and down only."""
    gated = cfg.arch == "llama" and not cfg.layer_pattern
    biases = ((2 if gated else 1) * cfg.moe_ffn_size + cfg.hidden_size) if cfg.moe_linear_bias else 0
    return (3 if gated else 2) * cfg.moe_ffn_size * cfg.hidden_size + biases


def activated_parameter_count(cfg: ModelConfig) -> int:
    """Parameters one token uses (TP = 1, vocabulary padded as shardlm pads it): the whole model less
    the E - k routed experts each MoE layer skips. The router and the shared experts count in full."""
    total = parameter_count(cfg, 1).total
    skipped = cfg.moe_num_experts - cfg.moe_top_k
    return total - moe_layer_count(cfg) * skipped * expert_parameters(cfg) if cfg.moe_num_experts else total


def _mlp_activation_bytes(cfg: ModelConfig, width: int, tp: int, tokens: int, experts: int,
                          fmt: NumericFormat, saves_input: bool = True) -> int:
    """What a dense MLP of `width` (or each of `experts` expert MLPs) saves for `tokens` rows on one TP
    rank: its input in the GEMM dtype (unless `saves_input` is False), the hidden activations (SwiGLU:
    gate, silu(gate), up, product; GeLU: fc and GeLU outputs; width / tp each) and the autocast half
    copies of its weights."""
    gated = cfg.arch == "llama"
    hidden = tokens * (4 if gated else 2) * (width // tp) * fmt.matmul_bytes
    weights = fmt.weight_cast_bytes * experts * (3 if gated else 2) * (width // tp) * cfg.hidden_size
    return tokens * cfg.hidden_size * fmt.matmul_bytes * saves_input + hidden + weights


def moe_layer_activation_bytes(cfg: ModelConfig, tp: int, ep: int, micro_batch: int, fmt: NumericFormat,
                               sequence_parallel: bool = False, backend: str = "cuda") -> int:
    """Bytes autograd saves in one transformer layer with an MoE MLP, for one micro-batch on one rank
    (N = b s tokens, k = top_k, E experts over `ep` ranks, f_e the expert width, t = tp): the dense
    layer (`memory.layer_activation_bytes`) without its MLP, plus
      router, per token it routes: its fp32 input (h), gate logits and scores (2 E), the log-sum-exp of
          the z-loss (1), the top-k indices (int64) and, with norm_topk_prob, the unnormalised weights
          and their sum (k + 1), all fp32;
      experts, per (token, slot) row: the received row and the expert output the combine weighs (2 h,
          GEMM dtype), the hidden activations (k f_e / t per token), the dispatch and combine
          permutations (2 int64), the row's weight; and the half copies of the E / ep local experts;
      shared experts: a dense MLP of their width (`shared_ffn_size`; its input is the router's unless autocast
          casts it); with `moe_shared_expert_gate` (Qwen3-Next) its output and the gate's sigmoid (h + 1), and under
          autocast the gate's own cast of the input and of its (1, h) weight;
      per layer: the aux loss's expert counts and token count (E + 1 fp32), each grouped GEMM's offsets
          (E / ep int32).
    Under sequence parallelism the router sees the rank's N / t tokens; the experts see all N (the MoE
    layer all-gathers the sequence before dispatching). Measured against autograd on the CPU in
    `tests/test_plan_moe.py`."""
    h, k, tokens = cfg.hidden_size, cfg.moe_top_k, micro_batch * cfg.seq_length
    dense_mlp = _mlp_activation_bytes(cfg, cfg.ffn_size, tp, tokens, 1, fmt)
    attention = layer_activation_bytes(cfg, tp, micro_batch, fmt, backend) - dense_mlp
    router_tokens = tokens // tp if sequence_parallel and tp > 1 else tokens
    normalised = 4 * (k + 1) if cfg.moe_norm_topk_prob else 0
    router = router_tokens * (4 * h + 2 * 4 * cfg.moe_num_experts + 4 + 8 * k + normalised)
    rows = tokens * k
    experts = (_mlp_activation_bytes(cfg, cfg.moe_ffn_size, tp, rows, cfg.moe_num_experts // ep, fmt)
               + rows * (h * fmt.matmul_bytes + 2 * 8 + fmt.matmul_bytes))
    shared = (_mlp_activation_bytes(cfg, cfg.shared_ffn_size, tp, tokens, 1, fmt,
                                    saves_input=fmt.matmul_bytes != 4) if cfg.moe_shared_experts else 0)
    if cfg.moe_shared_experts and cfg.moe_shared_expert_gate:
        cast = tokens * h * fmt.matmul_bytes if fmt.matmul_bytes != 4 else 0
        shared += tokens * (h + 1) * fmt.matmul_bytes + cast + fmt.weight_cast_bytes * h
    gemms = 3 if cfg.arch == "llama" else 2
    small = 4 * (cfg.moe_num_experts + 1) + gemms * 4 * (cfg.moe_num_experts // ep)
    return attention + router + experts + shared + small


def all_to_all_bytes(cfg: ModelConfig, micro_batch: int, ep: int, fmt: NumericFormat) -> tuple[float, float]:
    """(dispatch, combine) bytes one rank sends in one MoE layer's forward for one micro-batch:
    b s k rows of h elements, (E - 1) / E of them to other ranks (uniform routing). Dispatch sends the
    layer's input rows (residual dtype: the norm output), combine the expert outputs (GEMM dtype); the
    backward sends the gradients of the same tensors the other way, in the same dtypes. Every TP rank
    of an EP group exchanges the whole sequence (it runs the same tokens through its expert slices)."""
    rows = micro_batch * cfg.seq_length * cfg.moe_top_k * cfg.hidden_size * (ep - 1) / ep
    return rows * fmt.residual_bytes, rows * fmt.matmul_bytes
