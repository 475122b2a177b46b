"""Checks of a loaded run config before any process starts: the layout's and the batch's arithmetic
(`validate`), each parallel dimension's own rules (pipeline, attention heads, context, MoE, data
sharding) and that every input file exists (`check_files`). Each raises `UserError` with one line
naming the key and the fix.
"""

from __future__ import annotations

from pathlib import Path

from shardlm.config import ParallelConfig, RunConfig
from shardlm.errors import UserError
from shardlm.models.config import ModelConfig


def validate(config: RunConfig, world_size: int, check_paths: bool = True) -> int:
    """Check the layout and batch arithmetic for `world_size` ranks (and, with `check_paths`, that
    every input file exists); return the gradient-accumulation steps."""
    m, p, t = config.model, config.parallel, config.train
    positive = {"model.num_layers": m.num_layers, "model.hidden_size": m.hidden_size,
                "model.num_heads": m.num_heads, "model.seq_length": m.seq_length,
                "model.make_vocab_size_divisible_by": m.make_vocab_size_divisible_by, "parallel.tensor": p.tensor,
                "parallel.pipeline": p.pipeline, "parallel.context": p.context,
                "parallel.virtual_stages": p.virtual_stages,
                "train.micro_batch_size": t.micro_batch_size, "train.global_batch_size": t.global_batch_size,
                "train.steps": t.steps}
    for key, value in positive.items():
        if value < 1:
            raise UserError(f"{key}={value} must be at least 1")
    if m.arch not in ("gpt", "bert", "llama"):
        raise UserError(f'model.arch="{m.arch}" is not supported; use "gpt", "bert" or "llama"')
    if m.layernorm_order not in ("pre", "post"):
        raise UserError(f'model.layernorm_order="{m.layernorm_order}" must be "pre" or "post"')
    if m.activation not in ("gelu", "gelu_tanh"):
        raise UserError(f'model.activation="{m.activation}" must be "gelu" or "gelu_tanh"')
    if m.hidden_size % m.num_heads and not (m.arch == "llama" and (m.head_dim or m.attention == "mla")):
        raise UserError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}; "
                        "choose sizes with hidden_size = num_heads x head_dim")
    if m.num_heads % p.tensor:
        raise UserError(f"model.num_heads={m.num_heads} is not divisible by parallel.tensor={p.tensor}; "
                        "use a tensor-parallel size that divides the heads")
    _validate_attention_heads(m)
    from shardlm.models.deepseek_v4 import check_deepseek_v4
    from shardlm.models.mla import check_latent_attention

    if (problem := check_latent_attention(m, p.context)) is not None:
        raise UserError(problem)
    if m.hc_mult and (problem := check_deepseek_v4(m, p.context)) is not None:
        raise UserError(problem)
    from shardlm.models.kimi_delta import check_kimi_delta
    from shardlm.models.linear_attention import check_linear_attention

    for check in (check_kimi_delta, check_linear_attention):
        if (problem := check(m, p.tensor, p.context)) is not None:
            raise UserError(problem)
    if m.arch == "llama":  # Gemma 4's keys (and them on a model that is not Gemma 4's block)
        from shardlm.models.gemma_config import check_gemma, check_gemma_keys

        check_gemma(m, p.tensor) if m.sandwich_norms else check_gemma_keys(m)
    from shardlm.models.mamba import check_mamba

    if (problem := check_mamba(m, p.tensor, p.context)) is not None:
        raise UserError(problem)
    _validate_moe(m, p)
    if m.moe_aux_loss_type not in ("micro_batch", "sequence"):
        raise UserError(f'model.moe_aux_loss_type="{m.moe_aux_loss_type}" must be "micro_batch" or "sequence"')
    if m.mtp_layers:
        mtp_checks = [(m.arch == "llama", 'model.mtp_layers needs model.arch="llama"'),
                      (0 < m.mtp_layers < m.seq_length and m.mtp_loss_weight >= 0,
                       "model.mtp_layers must be in 1..seq_length-1 and model.mtp_loss_weight >= 0")]
        for ok, message in mtp_checks:
            if not ok:
                raise UserError(message)
    if m.ffn_size % p.tensor:
        raise UserError(f"model.ffn_hidden_size={m.ffn_size} is not divisible by parallel.tensor={p.tensor}")
    _validate_context(m, p)
    model_parallel = p.tensor * p.context * p.pipeline
    if world_size % model_parallel:
        dims = [("tensor", p.tensor)] + [(k, v) for k, v in (("context", p.context), ("pipeline", p.pipeline)) if v > 1]
        sizes = f"parallel.tensor={p.tensor}" if len(dims) == 1 else \
            " x ".join(f"parallel.{k}" for k, _ in dims) + " = " + " x ".join(str(v) for _, v in dims)
        raise UserError(f"world size {world_size} is not divisible by {sizes}; "
                        f"launch a multiple of {model_parallel} processes")
    dp = world_size // model_parallel
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        raise UserError(f"train.global_batch_size={t.global_batch_size} is not divisible by "
                        f"train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}; "
                        f"use a multiple of {per_step}")
    if p.expert > 1:  # experts are split over the data x context ranks
        from shardlm.parallel.layout import check_expert_layout

        check_expert_layout(p.expert, dp, p.context)
    validate_pipeline(config, t.global_batch_size // per_step)
    _validate_data_sharding(config, dp)
    checks = [
        (t.precision in ("auto", "fp32", "bf16", "fp16"),
         f'train.precision="{t.precision}" must be "auto", "fp32", "bf16" or "fp16"'),
        (t.param_dtype in ("fp32", "half"), f'train.param_dtype="{t.param_dtype}" must be "fp32" or "half"'),
        (t.param_dtype == "fp32" or t.precision in ("bf16", "fp16"),
         f'train.param_dtype="half" stores parameters in train.precision (here "{t.precision}"); set '
         'train.precision to "bf16" or "fp16"'),
        (t.recompute in ("none", "selective", "full"),
         f'train.recompute="{t.recompute}" must be "none", "selective" or "full"'),
        (t.recompute != "selective" or m.arch in ("gpt", "llama"),
         f'train.recompute="selective" supports model.arch="gpt" and "llama"; use "full" for "{m.arch}"'),
        (not p.sequence_parallel or p.tensor > 1,
         "parallel.sequence_parallel=true needs parallel.tensor > 1 (it splits the sequence over the TP group)"),
        (not p.sequence_parallel or m.arch in ("gpt", "llama"),
         f'parallel.sequence_parallel=true supports model.arch="gpt" and "llama"; turn it off for "{m.arch}"'),
        (not p.sequence_parallel or m.seq_length % p.tensor == 0,
         f"model.seq_length={m.seq_length} is not divisible by parallel.tensor={p.tensor}, which sequence "
         "parallelism needs; choose a sequence length that divides"),
        (t.decay_style in ("cosine", "linear", "constant"),
         f'train.decay_style="{t.decay_style}" must be "cosine", "linear" or "constant"'),
        (t.device in ("auto", "cpu", "cuda"), f'train.device="{t.device}" must be "auto", "cpu" or "cuda"'),
        (t.warmup_steps >= 0 and t.lr > 0, "train.lr must be > 0 and train.warmup_steps >= 0"),
        (0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)"),
        (m.arch == "llama" or (not m.attention_bias and m.rope_fraction == 1),
         'model.attention_bias and model.rope_fraction are Llama-family keys; use model.arch="llama"'),
        (0 < m.rope_fraction <= 1 and int(m.attention_head_dim * m.rope_fraction) % 2 == 0,
         f"model.rope_fraction={m.rope_fraction} must be in (0, 1] and leave an even number of rotary channels"),
        (m.attention_dropout < 1, f"model.attention_dropout={m.attention_dropout} must be < 1"),
        (m.arch == "llama" and m.attention == "mha" or not (m.attention_sinks or m.sliding_window
                                                            or m.attention_output_bias),
         'model.attention_sinks, sliding_window and attention_output_bias need model.arch="llama" with '
         'model.attention="mha"'),
        (m.sliding_window >= 0, f"model.sliding_window={m.sliding_window} must be >= 0 (0: no window)"),
        (not m.layer_types or (len(m.layer_types) == m.num_layers and set(m.layer_types) <= {
            "full_attention", "sliding_attention", "linear_attention"}), f"model.layer_types must list "
         f'{m.num_layers} entries, each "full_attention", "sliding_attention" or "linear_attention"'),
        (m.attention_dropout_p == 0 or not (m.attention_sinks or m.sliding_window),
         "attention dropout is not supported with attention sinks or sliding windows; set model.attention_dropout=0"),
        (m.swiglu_limit >= 0 and m.swiglu_alpha > 0, "model.swiglu_limit must be >= 0 and model.swiglu_alpha > 0"),
        (config.data.tokenizer in ("gpt2", "bert", "json"),
         f'data.tokenizer="{config.data.tokenizer}" must be "gpt2", "bert" or "json"'),
        (bool(config.sft.data) or bool(config.rl.task) or bool(config.data.text_file) != bool(config.data.prefixes),
         "set exactly one of data.text_file and data.prefixes (or sft.data for fine-tuning on chat records)"),
    ]
    if config.sft.data or config.data.document_mask:
        _validate_packed(config)
    if config.lora.rank or config.checkpoint.init_adapter:
        _validate_lora(config)
    if config.preference.loss:
        from shardlm.preference import check_preference

        if (problem := check_preference(config)) is not None:
            raise UserError(problem)
    if config.reward.loss:
        from shardlm.reward import check_reward

        if (problem := check_reward(config)) is not None:
            raise UserError(problem)
    if config.rl.loss:
        from shardlm.rl import check_rl

        if (problem := check_rl(config, world_size)) is not None:
            raise UserError(problem)
    if config.distill.teacher:
        from shardlm.distill import check_distill

        if (problem := check_distill(config, check_paths)) is not None:
            raise UserError(problem)
    _validate_optimizer(t)
    if config.bema.enabled:
        from shardlm.preference import reference_mode

        live = (config.preference.loss and reference_mode(config) == "weights") or (config.rl.loss and config.rl.beta)
        if (problem := config.bema.problem(bool(config.lora.rank), bool(live))) is not None:
            raise UserError(problem)
    if t.qk_clip > 0:
        _validate_qk_clip(config)
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if check_paths:
        check_files(config)
    return t.global_batch_size // per_step


def _validate_optimizer(t) -> None:
    """train.optimizer, Muon's keys and train.qk_clip's value (one line each)."""
    if t.qk_clip < 0:
        raise UserError(f"train.qk_clip={t.qk_clip} must be > 0 (the logit threshold tau; Kimi K2 used 100) or 0 (off)")
    if t.optimizer not in ("adamw", "muon"):
        raise UserError(f'train.optimizer="{t.optimizer}" must be "adamw" or "muon"')
    if t.optimizer != "muon":
        return
    checks = [(t.muon_adjust_lr in ("original", "match_rms_adamw"),
               f'train.muon_adjust_lr="{t.muon_adjust_lr}" must be "original" or "match_rms_adamw"'),
              (t.muon_ns_dtype in ("bf16", "fp32"),
               f'train.muon_ns_dtype="{t.muon_ns_dtype}" must be "bf16" or "fp32"'),
              (t.muon_split in ("parts", "heads", "whole"),
               f'train.muon_split="{t.muon_split}" must be "parts", "heads" or "whole"'),
              (0 <= t.muon_momentum < 1 and t.muon_ns_steps >= 1,
               "train.muon_momentum must be in [0, 1) and train.muon_ns_steps >= 1")]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _validate_qk_clip(config: RunConfig) -> None:
    """What QK-clip (`train.qk_clip` > 0) cannot scale: one line each."""
    m, t = config.model, config.train
    problems = [
        (m.arch == "bert", "a BERT encoder (it clips GPT's and the Llama families' causal attention)"),
        (m.qk_norm, "model.qk_norm: a per-head RMSNorm undoes any scale of the query and key weights, and already "
                    "bounds the logits"),
        (bool(config.lora.rank), "[lora]: the frozen base's query and key weights cannot be scaled"),
    ]
    for bad, what in problems:
        if bad:
            raise UserError(f"train.qk_clip={t.qk_clip} cannot run with {what}: set train.qk_clip = 0")


def _validate_lora(config: RunConfig) -> None:
    """[lora]: its values, and that this model has what it names (one line each; the projections a model has are the
    planner's, `shardlm.plan.lora.check_lora_model`)."""
    from shardlm.lora.apply import check_lora
    from shardlm.plan.lora import check_lora_model

    check_lora(config.lora)
    if not config.lora.rank:
        raise UserError("checkpoint.init_adapter needs lora.rank (or an adapter_config.json that gives r)")
    check_lora_model(config.model, config.lora)
    if config.checkpoint.init_adapter and not config.checkpoint.init_from:
        raise UserError("checkpoint.init_adapter needs checkpoint.init_from: the base model the adapter was "
                        "trained on")


def _validate_packed(config: RunConfig) -> None:
    """[sft] and data.document_mask: rows of packed documents, for the decoder models."""
    from shardlm.sft.packing import OVERFLOW, STRATEGIES

    d, f, m = config.data, config.sft, config.model
    what = "sft.data" if f.data else "data.document_mask=true"
    checks = [
        (m.arch in ("gpt", "llama"), f'{what} supports model.arch="gpt" and "llama", not "{m.arch}"'),
        (not (f.data and (d.text_file or d.prefixes)),
         "sft.data replaces data.text_file and data.prefixes; set only one of them"),
        (f.packing in STRATEGIES,
         f'sft.packing="{f.packing}" must be one of ' + ", ".join(f'"{s}"' for s in STRATEGIES)),
        (f.overflow in OVERFLOW, f'sft.overflow="{f.overflow}" must be "truncate", "split" or "drop"'),
        (f.overflow != "split" or not (config.preference.loss or config.reward.loss),
         'sft.overflow="split" cuts a long conversation into pieces; a preference pair\'s sequences stay whole in one '
         'row: use "truncate" (each cut to its share of the row) or "drop"'),
        (f.fields in ("auto", "dolly", "alpaca"), f'sft.fields="{f.fields}" must be "auto", "dolly" or "alpaca"'),
        (0 <= f.valid_fraction < 1, f"sft.valid_fraction={f.valid_fraction} must be in [0, 1)"),
        (f.loss_type in ("nll", "dft"), f'sft.loss_type="{f.loss_type}" must be "nll" or "dft"'),
        (f.loss_type == "nll" or not (config.preference.loss or config.rl.loss or config.distill.teacher
                                      or config.reward.loss),
         f'sft.loss_type="{f.loss_type}" weighs the SFT loss; a preference, RL, distillation or reward-model run has '
         'its own: leave it at "nll"'),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _validate_data_sharding(config: RunConfig, dp: int) -> None:
    """train.data_sharding: a known value, and for "full" (FSDP2) only the layouts it is tested with."""
    m, p, t = config.model, config.parallel, config.train
    if t.data_sharding not in ("none", "optimizer", "full"):
        raise UserError(f'train.data_sharding="{t.data_sharding}" must be "none", "optimizer" or "full"')
    if t.data_sharding != "full":
        if t.fsdp_shard_size:
            raise UserError(f'train.fsdp_shard_size={t.fsdp_shard_size} needs train.data_sharding="full"; '
                            "remove it or shard fully")
        return
    sharded = dp * p.context
    if t.fsdp_shard_size < 0 or (t.fsdp_shard_size and sharded % t.fsdp_shard_size):
        raise UserError(f"train.fsdp_shard_size={t.fsdp_shard_size} does not divide the data x context size "
                        f"{sharded}; use a divisor of it (or 0 to shard over all {sharded} ranks)")
    checks = [
        (not t.distributed_optimizer, 'train.data_sharding="full" already shards the optimizer state; '
                                      "set train.distributed_optimizer=false"),
        (dp * p.context > 1, 'train.data_sharding="full" needs a data-parallel size above 1 (it shards over DP); '
                             'use "none" on one data-parallel rank'),
        (m.arch in ("gpt", "llama"), f'train.data_sharding="full" supports model.arch="gpt" and "llama"; '
                                     f'use "optimizer" for "{m.arch}"'),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def validate_pipeline(config: RunConfig, micro_batches: int) -> None:
    """The pipeline keys: sizes, schedule, enough layers and micro-batches (UserError naming the key)."""
    from shardlm.parallel.pipeline import SCHEDULES, V_SHAPED, stage_layers, stages_per_rank

    m, p = config.model, config.parallel
    if p.pipeline < 1 or p.virtual_stages < 1:
        raise UserError(f"parallel.pipeline={p.pipeline} and parallel.virtual_stages={p.virtual_stages} must be >= 1")
    if p.pipeline_schedule not in SCHEDULES:
        raise UserError(f'parallel.pipeline_schedule="{p.pipeline_schedule}" must be one of '
                        + ", ".join(f'"{s}"' for s in SCHEDULES))
    schedule = p.pipeline_schedule
    if p.pipeline > 1 and schedule == "interleaved-1f1b" and p.virtual_stages < 2:
        raise UserError('parallel.pipeline_schedule="interleaved-1f1b" needs parallel.virtual_stages >= 2; '
                        'use "1f1b" for one block of layers per rank')
    if schedule in V_SHAPED and p.virtual_stages not in (1, 2):
        raise UserError(f'parallel.pipeline_schedule="{schedule}" always runs 2 stages per rank (a V: stages r and '
                        f"2P - 1 - r); remove parallel.virtual_stages={p.virtual_stages} or set it to 2")
    if p.virtual_stages > 1 and schedule not in ("interleaved-1f1b", "interleaved-zb", *V_SHAPED):
        raise UserError(f"parallel.virtual_stages={p.virtual_stages} needs "
                        'parallel.pipeline_schedule="interleaved-1f1b" or "interleaved-zb"')
    if p.pipeline == 1:
        return
    if m.arch not in ("gpt", "llama"):
        raise UserError(f'parallel.pipeline={p.pipeline} supports model.arch="gpt" and "llama"; use '
                        f'parallel.pipeline=1 for "{m.arch}"')
    per_rank = stages_per_rank(schedule, p.virtual_stages)
    stages = stage_layers(m.num_layers, p.pipeline * per_rank, p.first_stage_layers, p.last_stage_layers)
    if m.hc_mult and m.moe_hash_layers > len(stages[0]):  # DeepSeek-V4's hash layers read the embedded tokens
        raise UserError(f"model.moe_hash_layers={m.moe_hash_layers} route by token ids, which only the first pipeline "
                        f"stage holds, and it has {len(stages[0])} layers; set parallel.first_stage_layers >= "
                        f"{m.moe_hash_layers}")
    for stage in stages:
        if stage and m.index_source(stage[0]) not in (None, stage[0]):  # GLM-5's shared sparse-attention choice
            raise UserError(f"pipeline stage starting at layer {stage[0]} would reuse layer "
                            f"{m.index_source(stage[0])}'s sparse-attention choice (model.index_layer_types) from "
                            "another stage; move the boundary (parallel.first_stage_layers / last_stage_layers) "
                            'to a "full" layer')
    needed = 2 * p.pipeline if schedule == "dualpipev" else p.pipeline
    if schedule != "gpipe" and micro_batches < needed:
        raise UserError(f"{micro_batches} micro-batches per step is fewer than {needed}, which \"{schedule}\" needs "
                        f"at parallel.pipeline={p.pipeline}; raise train.global_batch_size to at least {needed} x "
                        'micro_batch_size x data-parallel size, or use "gpipe"')
    if schedule in ("interleaved-1f1b", "interleaved-zb") and micro_batches % max(1, micro_batches // p.pipeline):
        raise UserError(f"{micro_batches} micro-batches per step must be a multiple of "
                        f"{micro_batches // p.pipeline} for {schedule} at parallel.pipeline={p.pipeline}")


def _validate_attention_heads(m: ModelConfig) -> None:
    """Grouped-query attention and RoPE shapes (llama). Query heads split over TP (checked by the caller);
    KV heads are split when num_kv_heads is a multiple of TP, else replicated, so any TP dividing num_heads works."""
    if m.arch != "llama":
        if m.num_kv_heads or m.tie_embeddings or m.head_dim or m.qk_norm or m.norm_placement != "pre" \
                or m.qk_norm_scope != "head":
            raise UserError("model.num_kv_heads, tie_embeddings, head_dim, qk_norm, qk_norm_scope and norm_placement "
                            f'are llama settings; model.arch="{m.arch}" has none of them (remove them)')
        return
    if m.head_dim < 0:
        raise UserError(f"model.head_dim={m.head_dim} must be >= 0 (0: hidden_size / num_heads)")
    if m.norm_placement not in ("pre", "post") or m.qk_norm_scope not in ("head", "projection"):
        raise UserError(f'model.norm_placement="{m.norm_placement}" must be "pre" or "post", and model.qk_norm_scope='
                        f'"{m.qk_norm_scope}" "head" or "projection"')
    if m.qk_norm_scope == "projection" and not m.qk_norm:
        raise UserError('model.qk_norm_scope="projection" normalizes the query and key projections: it needs '
                        "model.qk_norm = true")
    if m.num_kv_heads < 0 or m.num_heads % m.kv_heads:
        raise UserError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}; "
                        "every key/value head must serve the same number of query heads")
    if m.attention_head_dim % 2 and m.attention != "mla":
        raise UserError(f"head size {m.attention_head_dim} (model.head_dim, or hidden_size / num_heads) is odd; "
                        "rotary embeddings need an even head size")
    if m.rope_theta <= 0:
        raise UserError(f"model.rope_theta={m.rope_theta} must be > 0")


def _validate_context(m: ModelConfig, p: ParallelConfig) -> None:
    """`parallel.context` and `parallel.cp_comm`: the zigzag split's sequence multiple, no attention dropout,
    decoder models only (one-line errors naming the key). MoE models are fine: their routing statistics are
    summed over CP (`shardlm.models.moe`), experts split over DP x CP (`parallel.expert`, checked by the caller)."""
    from shardlm.data.zigzag import check_context_parallel

    if p.cp_comm not in ("ring", "allgather"):
        raise UserError(f'parallel.cp_comm="{p.cp_comm}" must be "ring" or "allgather"')
    if p.context == 1:
        return
    if m.arch not in ("gpt", "llama"):
        raise UserError(f'parallel.context={p.context} supports model.arch="gpt" and "llama"; use '
                        f'parallel.context=1 for "{m.arch}"')
    check_context_parallel(m.seq_length, p.context, p.tensor, p.sequence_parallel, m.attention_dropout_p)


def _validate_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """The MoE keys (`model.moe_*`) and `parallel.expert`: one-line errors naming the key."""
    e = m.moe_num_experts
    if e == 0:
        if p.expert != 1:
            raise UserError(f"parallel.expert={p.expert} needs an MoE model; set model.moe_num_experts or "
                            "parallel.expert=1")
        return
    groups = m.moe_groups
    checks = [
        (m.arch in ("gpt", "llama"), f'model.moe_num_experts needs model.arch="gpt" or "llama", not "{m.arch}"'),
        (e > 0, f"model.moe_num_experts={e} must be >= 0"),
        (1 <= m.moe_top_k <= e, f"model.moe_top_k={m.moe_top_k} must be between 1 and "
                                f"model.moe_num_experts={e}"),
        (p.expert >= 1 and e % p.expert == 0, f"model.moe_num_experts={e} is not divisible by "
                                              f"parallel.expert={p.expert}; use an expert size that divides it"),
        (m.moe_ffn_size % p.tensor == 0, f"model.moe_ffn_hidden_size={m.moe_ffn_size} is not divisible by "
                                         f"parallel.tensor={p.tensor} (experts are split over TP)"),
        (m.moe_shared_experts >= 0 and m.moe_first_dense_layers >= 0 and m.moe_layer_interval >= 1,
         "model.moe_shared_experts and model.moe_first_dense_layers must be >= 0, model.moe_layer_interval >= 1"),
        (m.moe_score in ("softmax", "sigmoid", "sqrtsoftplus"),
         f'model.moe_score="{m.moe_score}" must be "softmax", "sigmoid" or "sqrtsoftplus" (DeepSeek-V4)'),
        (m.moe_group_score in ("auto", "top2_sum", "max"),
         f'model.moe_group_score="{m.moe_group_score}" must be "auto", "top2_sum" or "max"'),
        (m.moe_aux_loss_coeff >= 0 and m.moe_z_loss_coeff >= 0 and m.moe_expert_bias_rate >= 0,
         "model.moe_aux_loss_coeff, model.moe_z_loss_coeff and model.moe_expert_bias_rate must be >= 0"),
        (groups >= 0 and (groups == 0 or e % groups == 0),
         f"model.moe_groups={groups} must divide model.moe_num_experts={e}"),
        (groups == 0 or 1 <= m.moe_topk_groups <= groups,
         f"model.moe_topk_groups={m.moe_topk_groups} must be between 1 and model.moe_groups={groups}"),
        (groups == 0 or m.moe_topk_groups * (e // max(groups, 1)) >= m.moe_top_k,
         f"model.moe_topk_groups={m.moe_topk_groups} groups of {e // max(groups, 1)} experts cannot hold "
         f"model.moe_top_k={m.moe_top_k} experts; raise moe_topk_groups"),
        (m.arch == "llama" or not (m.moe_linear_bias or m.swiglu_limit),
         'model.moe_linear_bias and model.swiglu_limit are for SwiGLU experts; use model.arch="llama"'),
        (p.expert_dispatcher in ("all_to_all", "all_gather"),
         f'parallel.expert_dispatcher="{p.expert_dispatcher}" must be "all_to_all" or "all_gather"'),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def check_files(config: RunConfig) -> None:
    """Every file the run will read exists (cheap; done before any process starts)."""
    from shardlm.paths import shared_data_dir

    d = config.data
    if config.sft.data:
        for path in config.sft.data:
            if not Path(path).is_file() and not (Path(path) / "state.json").is_file():
                raise UserError(f"sft.data: {path} not found; point it at a .jsonl or .parquet file of records, or "
                                "a folder a datasets.Dataset was saved to")
        for key in ("tokenizer", "template"):
            value = getattr(config.sft, key)
            if value and not Path(value).exists():
                raise UserError(f"sft.{key}={value} not found")
        return
    if d.text_file and not Path(d.text_file).is_file():
        raise UserError(f"data.text_file={d.text_file} not found; point it at a UTF-8 text file")
    for prefix in d.prefixes[1::2] if len(d.prefixes) > 1 else d.prefixes:
        for suffix in (".bin", ".idx"):
            if not Path(f"{prefix}{suffix}").is_file():
                raise UserError(f"data.prefixes: {prefix}{suffix} not found; create it with `shardlm preprocess`")
    gpt2 = shared_data_dir() / "vocab" / "gpt2"
    vocab = d.vocab_file or (str(gpt2 / "encoder.json") if d.tokenizer == "gpt2" else "")
    merges = d.merges_file or (str(gpt2 / "vocab.bpe") if d.tokenizer == "gpt2" else "")
    if not vocab:
        raise UserError(f'data.vocab_file must be set for data.tokenizer="{d.tokenizer}"')
    for key, path in (("data.vocab_file", vocab), ("data.merges_file", merges)):
        if path and not Path(path).is_file():
            raise UserError(f"{key}: {path} not found; set {key} (or SHARDLM_DATA for the shared GPT-2 files)")
