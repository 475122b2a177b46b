"""The training loop: micro-batches, data-parallel gradient reduction, clipping, AdamW, fp16 scaling.

Order of one step on every rank:
  1. for each micro-batch: forward under autocast (bf16/fp16) or fp32, loss / accumulation steps,
     backward; DDP all-reduces gradient buckets over the DP group during the last micro-batch's
     backward (overlapped with it), `no_sync` before that. With pipeline stages, the micro-batches go
     through the pipeline schedule instead (`shardlm.training.pipeline`), which then sums the tied
     embedding's gradients over the first and last stage;
  2. `reduce_gradients`: sequence-parallel parameters' gradients summed over TP; where DDP is not
     used (pipeline stages, the master-weight optimizer) gradients averaged over DP, by one
     all-reduce or the distributed optimizer's reduce-scatter; with `train.data_sharding = "full"`
     (`shardlm.training.fsdp`) FSDP2 gathers each layer's parameters and reduce-scatters its gradients
     inside forward and backward, and the norm and the update run on this rank's shards;
  3. fp16: unscale and check for inf/NaN (all-reduce MAX over TP and PP, and DP when sharded); an
     overflow skips 4-5;
  4. clip the global gradient norm (one all-reduce of a scalar over TP, and over DP / PP when needed);
  5. set the scheduled LR and step AdamW on this rank's parameter shards (or its range of the fp32
     master weights, then copy them back into the parameters).
With `train.param_dtype = "fp32"` the parameters are the fp32 master weights and autocast runs the
matmuls in half precision; with "half" they are bf16/fp16 and `shardlm.training.master_weights`
keeps fp32 gradients, master weights and moments.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from shardlm.config import RunConfig
from shardlm.errors import UserError
from shardlm.models import training_loss
from shardlm.parallel import ParallelContext
from shardlm.plan.flops import flops_per_step
from shardlm.training.cpu_precision import resolve_precision
from shardlm.training.data import (
    add_multi_token_targets,
    context_parallel_part,
    is_packed,
    micro_batches,
    packed_parts,
    token_parts,
)
from shardlm.training.gradients import (
    all_reduce_gradients,
    is_split_expert,
    reduce_expert_gradients,
    sum_sequence_parallel_gradients,
)
from shardlm.training.indexer import indexer_metrics, set_indexer_loss_scale
from shardlm.training.loss_scaler import DynamicLossScaler
from shardlm.training.moe import finish_step, set_aux_loss_scale
from shardlm.training.optim import clip_grad_norm, learning_rate
from shardlm.training.parallelize import HALF, parallelize
from shardlm.training.qk_clip import clip_qk, track_max_logits
from shardlm.training.reference import sync_section

# Dense peak TFLOP/s per GPU for MFU (bf16/fp16 tensor cores; V100: fp16).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "V100": 125.0, "L40S": 362.0, "A10": 125.0}


def device_peak_tflops(device: torch.device) -> float | None:
    """Peak TFLOP/s of this GPU model when known; None on CPU or unknown devices."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def model_flops_utilization(tflops_per_device: float, peak: float | None) -> tuple[float | None, str | None]:
    """(MFU, None) against this device's `peak` TFLOP/s (None without a known peak), or (None, why) when the
    measurement is above 100%: then the FLOP count or the peak is wrong (a parallel setting silently off,
    a token counted twice), and a number would mislead, so the run says so instead of logging it."""
    if not peak:
        return None, None
    mfu = tflops_per_device / peak
    if mfu > 1:
        return None, (f"measured MFU {mfu:.0%} is above 100% of the {peak:g} TFLOP/s peak: the FLOP count or "
                      "the peak is wrong")
    return mfu, None


class Trainer:
    """Owns the model, optimizer, scaler and step counter of one rank. The model, its pipeline stages and
    its data-parallel wrapper or sharded optimizer come from `shardlm.training.parallelize`."""

    def __init__(self, config: RunConfig, ctx: ParallelContext, train_data, valid_data=None):
        self.config, self.ctx = config, ctx
        self.train_data, self.valid_data = train_data, valid_data
        t = config.train
        resolve_precision(t, ctx.device)  # "auto" -> bf16 or fp32 for this device (run.py has said which)
        ctx.seed(t.seed)
        self.accumulation = t.global_batch_size // (t.micro_batch_size * ctx.dp_size)
        if config.parallel.context != ctx.cp_size:  # a setting silently dropped would train another layout
            raise UserError(f"parallel.context={config.parallel.context} but the process groups have "
                            f"{ctx.cp_size} context-parallel rank(s); build them with context_parallel="
                            f"{config.parallel.context}")
        self.moe = config.model.moe_num_experts > 0
        self.sparse_attention = config.model.index_topk > 0
        parts = parallelize(config, ctx, self.accumulation)
        self.model, self.pipeline, self.params = parts.model, parts.pipeline, parts.params
        self.optimizer = parts.optimizer
        self.ddp, self.master, self.fsdp = parts.ddp, parts.master, parts.fsdp
        self.loss = training_loss(config.model.arch)
        online_dpo = config.rl.loss == "online_dpo"  # the policy's own pairs, DPO's loss (`shardlm.rl.online_dpo`)
        self.preference = bool(config.preference.loss) or online_dpo
        if self.preference:  # DPO and relatives: a loss of whole pairs (`shardlm.preference.loss`)
            from shardlm.preference.loss import PreferenceLoss
            from shardlm.rl.online_dpo import preference_config

            self.loss = PreferenceLoss(preference_config(config.rl) if online_dpo else config.preference, ctx,
                                       self.model)
            self.loss.set_labels({"train": train_data, "valid": valid_data})  # KTO's unpaired examples
            if self.pipeline is not None:
                self.pipeline.sequence_loss = self.loss.of_token_losses
        self.reward = bool(config.reward.loss)
        if self.reward:  # a reward model: the Bradley-Terry loss of its pairs' scores (`shardlm.reward.loss`)
            from shardlm.reward.loss import RewardLoss

            self.loss = RewardLoss(config.reward, ctx, self.model)
            self.loss.set_margins({"train": train_data, "valid": valid_data})
            if self.pipeline is not None:
                self.pipeline.hidden_loss = self.loss.of_hidden
        self.rl = bool(config.rl.loss) and not online_dpo
        if self.rl:  # GRPO and its variants: a loss of the round's sequences (`shardlm.rl.loss`)
            from shardlm.rl import round_steps
            from shardlm.rl.loss import RLLoss

            self.loss = RLLoss(config.rl, ctx, self.model, round_steps=round_steps(config))
            if self.pipeline is not None:
                self.pipeline.sequence_loss = self.loss.of_token_losses
        self.teacher = None
        if config.distill.teacher:  # distillation: a frozen teacher at this layout (`shardlm.distill`)
            from shardlm.distill.loss import DistillLoss
            from shardlm.distill.teacher import load_teacher

            self.teacher = load_teacher(config, ctx)
            self.loss = DistillLoss(config.distill, ctx, self.model, self.teacher)
            if self.pipeline is not None:
                self.pipeline.hidden_loss = self.loss.of_hidden
        # what the optimizer updates: the parameters, or the master weights' segments
        self.update_params = self.master.segments if self.master else self.fsdp.shards if self.fsdp else self.params
        self.sharded_over_dp = bool(self.master and self.master.shard) or self.fsdp is not None
        if t.qk_clip > 0:  # MuonClip: each head's largest logit tracked, its q and k scaled after the step
            track_max_logits(self.model)
        self.scaler = None
        if t.precision == "fp16":
            self.scaler = DynamicLossScaler(t.initial_loss_scale, t.loss_scale_window, t.hysteresis,
                                            t.min_loss_scale)
        self.decay_steps = t.decay_steps or max(1, t.steps - t.warmup_steps)
        self.step = 0
        self.skipped_steps = 0
        self.consumed_samples = 0
        # a run's reference weights that TR-DPO's syncs move after its steps (`shardlm.training.reference`) and its
        # checkpoints keep; set by the run when [rl] or [preference] asks for sync_ref_model
        self.synced_reference = None
        self.bema = None  # [bema]: the weights' BEMA copies (`shardlm.training.bema`), set once the weights are loaded
        self.sync = sync_section(config)
        self.flops_per_step = flops_per_step(config.model, t.global_batch_size)

    def num_parameters(self) -> int:
        """Parameters of the whole model (all TP shards and pipeline stages; the tied embedding once)."""
        count = torch.tensor(float(self.model.num_parameters()), dtype=torch.float64)
        if self.pipeline is not None:
            tied = sum(p.numel() for p in self.params if getattr(p, "pipeline_tied_copy", False))
            count -= tied * self.ctx.tp_size
            self.ctx.pp.all_reduce(count)
        return int(count.item())

    def reduce_gradients(self) -> None:
        """After the backward of every micro-batch: sequence-parallel gradients summed over TP, then
        gradients averaged over DP where DDP did not already (pipeline stages, master weights)."""
        sum_sequence_parallel_gradients(self.update_params if self.fsdp else self.params, self.ctx)
        if self.fsdp is not None:  # already reduce-scattered over DP by FSDP in the backward
            return
        if self.master is not None:
            self.master.reduce_gradients()
            return
        if self.ddp is None:
            all_reduce_gradients([p.grad for p in self.params if p.grad is not None
                                  and not is_split_expert(p, self.ctx)], self.ctx)
        reduce_expert_gradients(self.params, self.ctx)

    def autocast(self):
        precision = self.config.train.precision
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.ctx.device.type, dtype=HALF[precision])

    def lr(self, step: int) -> float:
        t = self.config.train
        return learning_rate(step, t.lr, t.min_lr, t.warmup_steps, self.decay_steps, t.decay_style)

    def train_step(self) -> dict:
        """One optimizer step over the global batch; returns this step's metrics (same on every rank)."""
        t, ctx = self.config.train, self.ctx
        start = time.perf_counter()
        self.model.train()
        forward = self.ddp or self.model
        batches = self.local_part(micro_batches(self.train_data, self.consumed_samples, t.global_batch_size,
                                                t.micro_batch_size, ctx.dp_rank, ctx.dp_size, ctx.device))
        scale = self.scaler.scale if self.scaler else 1.0
        loss_sum = torch.zeros((), device=ctx.device)
        if self.moe:  # the MoE losses' gradients get the micro-batch loss's factor
            set_aux_loss_scale(self.model, ctx, scale, len(batches))
        if self.sparse_attention:  # so do the sparse-attention indexers' losses
            set_indexer_loss_scale(self.model, ctx, scale, len(batches))
        if self.pipeline is not None:
            with self.autocast():
                self.pipeline_reference(batches)
                loss_sum = self.pipeline.forward_backward(batches, scale)
            self.release_teacher()
        if (self.preference or self.rl) and self.pipeline is None:
            with self.autocast():  # KTO: the global batch's KL estimate; RL: its entropy quantile
                self.loss.prepare(forward, batches)
        for i, batch in enumerate(batches if self.pipeline is None else ()):
            last = i == len(batches) - 1
            sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
            if self.fsdp is not None:
                self.fsdp.set_micro_batch(last)
            with sync:
                with self.autocast():
                    loss = self.loss(forward, batch)
                loss_sum += loss.detach()
                (loss * (scale / len(batches))).backward()
        self.reduce_gradients()
        ctx.dp_cp.all_reduce(loss_sum)  # CP ranks' mean losses over equally many tokens: their mean is the batch's
        loss_value = loss_sum.item() / (len(batches) * ctx.dp_cp.size)

        updated, over_dp = self.update_params, self.sharded_over_dp
        overflow = self.scaler.unscale_and_check(updated, ctx, over_dp) if self.scaler else False
        grad_norm = float("nan")
        lr = self.lr(self.step)
        if not overflow:
            grad_norm = clip_grad_norm(updated, t.clip_grad, ctx, over_dp,
                                       self.fsdp.shard_group if self.fsdp else None).item()
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        if self.scaler:
            self.scaler.update(overflow)
        step_metrics = {}
        if t.qk_clip > 0:
            step_metrics["max_logit"] = clip_qk(self.model, ctx, t.qk_clip, self.master)
        if self.config.model.mtp_layers:  # the depths' mean loss over the global batch (logged, not in "loss")
            mtp_sum = (torch.stack([b["mtp_loss"] for b in batches]).sum() if self.pipeline is None
                       else self.pipeline.mtp_loss_sum.clone())  # under PP: the last stage's, on every rank
            ctx.dp_cp.all_reduce(mtp_sum)
            step_metrics["mtp_loss"] = mtp_sum.item() / (len(batches) * ctx.dp_cp.size)
        if self.preference or self.rl or self.reward or self.teacher is not None:  # rewards, margin and accuracy
            step_metrics |= self.loss.take_metrics()  # over the pairs; KL, entropy, clip ratios; IW-OPD's weights
        if self.moe:  # aux loss and expert loads of the step; expert biases move after the step (not in a LoRA
            # run, whose router, biases included, is the frozen base's)
            step_metrics |= finish_step(self.model, ctx, len(batches), self.config.parallel.sequence_parallel,
                                        update_bias=not overflow and not self.config.lora.rank)
        if self.sparse_attention:  # the indexers' KL divergence to the attention
            step_metrics |= indexer_metrics(self.model, ctx, len(batches))
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.consumed_samples += t.global_batch_size
        if self.bema is not None:
            self.bema.on_step_end(self.step)
        if self.sync is not None and self.synced_reference is not None and \
                self.step % self.sync.ref_model_sync_steps == 0:  # TR-DPO
            self.synced_reference.mix(self.sync.ref_model_mixup_alpha)
        elapsed = time.perf_counter() - start
        tokens = t.global_batch_size * self.config.model.seq_length
        tflops = self.flops_per_step / elapsed / 1e12  # every token once: the global batch's FLOPs
        mfu, mfu_error = model_flops_utilization(tflops / ctx.world_size, device_peak_tflops(ctx.device))
        return {
            "step": self.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
            "loss_scale": scale, "skipped": overflow, "step_time_s": elapsed,
            "tokens_per_sec": tokens / elapsed, "tflops": tflops,
            "tflops_per_device": tflops / ctx.world_size,
            "mfu": mfu, **({"mfu_error": mfu_error} if mfu_error else {}), **step_metrics,
        }

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean validation loss over up to `train.eval_iters` micro-batches per DP rank; None without data.
        SFT rows (a dataset with `pads_past_end`): the mean over the trained tokens of the whole held-out set
        when `eval_iters` covers it (the last micro-batches filled with empty rows), the same at every layout."""
        if self.valid_data is None:
            return None
        t, ctx = self.config.train, self.ctx
        per_iter = t.micro_batch_size * ctx.dp_size
        available = len(self.valid_data)
        if getattr(self.valid_data, "pads_past_end", False):  # SFT: whole micro-batches (and rounds of the
            # pipeline's schedule) of rows, empty ones last
            available = -(-available // (per_iter * ctx.pp_size)) * per_iter * ctx.pp_size
        iters = min(t.eval_iters, available // per_iter)
        if iters == 0:
            return None
        self.model.eval()
        total = torch.zeros((), device=ctx.device)
        batches = self.local_part([micro_batches(self.valid_data, it * per_iter, per_iter, t.micro_batch_size,
                                                 ctx.dp_rank, ctx.dp_size, ctx.device)[0] for it in range(iters)],
                                  "valid")
        with self.autocast():
            if self.pipeline is not None:
                self.pipeline_reference(batches)
                total += self.pipeline.evaluate(batches).float()
                self.release_teacher()
            else:
                if self.preference:
                    self.loss.prepare(self.model, batches)  # KTO: the held-out examples' KL estimate
                for batch in batches:
                    total += self.loss(self.model, batch).float()
        ctx.dp_cp.all_reduce(total)
        if self.fsdp is not None:  # a forward without backward leaves FSDP's roots gathered: free them
            from shardlm.training.fsdp import reshard

            reshard([self.model] + (self.pipeline.stage_modules if self.pipeline is not None else []))
        self.model.train()
        return total.item() / (iters * ctx.dp_cp.size)

    def pipeline_reference(self, batches: list) -> None:
        """Under pipeline stages, a preference run's reference log-probabilities (its weights, or the LoRA base):
        one forward pass of the micro-batches through the stages before their step or evaluation; KTO's KL
        sequences' passes and an RL step's entropy pass too."""
        if self.teacher is not None:  # distillation: the teacher's hidden states, through its own stages
            self.loss.teacher_pass(batches)
        if self.preference and self.loss.needs_reference_pass(batches):
            self.pipeline.reference_pass(batches, self.loss.record_reference, self.loss.reference_context())
        if self.preference or self.rl:
            self.loss.prepare_stages(self.pipeline, batches)

    def release_teacher(self) -> None:
        """Under pipeline stages, a distillation teacher sharded by FSDP: free its root's end pieces, gathered for the
        step's pipelined pass (`distill.teacher.pipelined_hidden`), once the schedule's losses have used them."""
        if self.teacher is not None:
            from shardlm.distill.teacher import release_teacher

            release_teacher(self.teacher)

    def local_part(self, batches: list, split: str = "train") -> list:
        """This rank's share of each micro-batch: the batch itself, or under context parallelism the
        (inputs, targets) of its zigzag chunks (`context_parallel_part`); packed rows become `packed_parts`
        (inputs, targets, documents and the global token count's divisor); preference pairs `preference_parts`
        with the `split`'s precomputed reference; an RL round's rows `rl_parts`."""
        m = self.config.model
        if self.rl:
            from shardlm.rl.loss import rl_parts

            return rl_parts(batches, self.ctx)
        if self.reward:
            from shardlm.reward.loss import reward_parts

            return self.loss.attach_margins(reward_parts(batches, self.ctx), split)
        if self.preference:
            from shardlm.preference.loss import preference_parts

            return self.loss.attach_reference(preference_parts(batches, self.ctx,
                                                               ld_alpha=self.config.preference.ld_alpha), split)
        dft = self.config.sft.loss_type == "dft"
        if m.mtp_layers:  # the rolled targets of every depth come from the whole rows, before the CP split
            parts = packed_parts(batches, self.ctx, dft) if is_packed(batches[0]) else token_parts(
                [context_parallel_part(b, self.ctx.cp_size, self.ctx.cp_rank) if self.ctx.cp_size > 1 else b
                 for b in batches], self.ctx)
            return add_multi_token_targets(batches, parts, self.ctx, m.mtp_layers, m.mtp_loss_weight)
        if is_packed(batches[0]):
            return packed_parts(batches, self.ctx, dft)
        if self.ctx.cp_size == 1:
            return batches
        return [context_parallel_part(batch, self.ctx.cp_size, self.ctx.cp_rank) for batch in batches]


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 700.0))
