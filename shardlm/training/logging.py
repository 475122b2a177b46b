"""Run logging on rank 0: console lines, a progress bar with ETA, metrics.jsonl, TensorBoard, a PNG.

`metrics.jsonl` holds one JSON object per logged step (at least step, loss, lr, grad_norm,
tokens_per_sec) and one per validation (`{"step", "val_loss", "val_ppl"}`; an RL run's held-out rewards,
`{"step", "val_reward", ...}`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm


class RunLogger:
    """Writes a run's metrics. Every method is a no-op on ranks other than the main one."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, interval: int = 10,
                 progress: bool = True, tensorboard: bool = True, perplexity: bool = True):
        self.enabled, self.interval, self.run_dir = enabled, max(1, interval), run_dir
        self.perplexity = perplexity  # whether the validation loss is a token cross-entropy (a perplexity's log)
        self.history: list[dict] = []
        self.bar = self.writer = self.file = None
        self.progress, self.total_steps = progress, total_steps
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: the JSON log is enough
                SummaryWriter = None
            if SummaryWriter is not None:
                self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def resumed_at(self, step: int) -> None:
        """Move the progress bar to a resumed run's step (before the first step there is none yet: it is made then,
        starting at the step's number)."""
        if self.bar:
            self.bar.update(step - self.bar.n)

    def print(self, message: str) -> None:
        if self.enabled:
            (self.bar.write if self.bar else print)(message)

    def step(self, metrics: dict, total_steps: int) -> None:
        if not self.enabled:
            return
        step = metrics["step"]
        if self.progress and self.bar is None:
            # the bar starts with this process's first step, so that its rate and time left count the steps only,
            # not the setup before them (a reference pass, a checkpoint read): its clock set back by the step's time
            self.bar = tqdm(total=self.total_steps, initial=step - 1, desc="train", unit="step", dynamic_ncols=True)
            self.bar.start_t = self.bar.last_print_t = self.bar.start_t - metrics.get("step_time_s", 0.0)
        if self.bar:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
        if step % self.interval and step != total_steps and step != 1:
            return
        self._write(metrics)
        mfu = f" | mfu {metrics['mfu'] * 100:.1f}%" if metrics.get("mfu") else ""
        if metrics.get("mfu_error"):  # an impossible MFU is named, not printed as a number
            mfu = f" | {metrics['mfu_error']}"
        skipped = " | step skipped (fp16 overflow)" if metrics.get("skipped") else ""
        scale = f" | loss scale {metrics['loss_scale']:.0f}" if metrics["loss_scale"] != 1.0 else ""
        moe = ""
        if "moe_aux_loss" in metrics:  # MoE: balancing losses and the least / most loaded expert vs uniform
            moe = (f" | aux loss {metrics['moe_aux_loss']:.4g} | expert load {metrics['expert_load_min']:.2f}"
                   f"-{metrics['expert_load_max']:.2f}")
        if "reward_margin" in metrics:  # preference optimization: the rewards' margin and accuracy over the pairs
            moe += f" | reward margin {metrics['reward_margin']:.4g}"
            moe += (f" | accuracy {metrics['reward_accuracy']:.2f}" if "reward_accuracy" in metrics
                    else f" | kl {metrics['kl']:.4g}")  # KTO: the step's KL reference point instead
        if "min_reward" in metrics:  # a reward model: its scores' margin and accuracy over the pairs (TRL's names)
            moe += f" | margin {metrics['margin']:.4g} | accuracy {metrics['accuracy']:.2f}"
        if "frac_reward_zero_std" in metrics:  # RL: the round's reward, the KL to the reference, the mismatch
            moe += f" | reward {metrics['reward']:.3f} (std {metrics['reward_std']:.3f})"
            if "kl" in metrics:
                moe += f" | kl {metrics['kl']:.4g}"
            moe += (f" | entropy {metrics['entropy']:.3f} | completion {metrics['completions/mean_length']:.1f} "
                    "tokens")
            if "logprob_diff_max" in metrics:
                moe += f" | logprob diff {metrics['logprob_diff_max']:.2g}"
        if "mtp_loss" in metrics:  # multi-token prediction: the depths' mean loss (in the gradient, not in "loss")
            moe += f" | mtp loss {metrics['mtp_loss']:.4f}"
        if "indexer_kl" in metrics:  # sparse attention: the indexers' divergence from the attention
            moe += f" | indexer kl {metrics['indexer_kl']:.4g}"
        if "max_logit" in metrics:  # QK-clip: the step's largest attention logit, before the clip
            moe += f" | max logit {metrics['max_logit']:.3g}"
        self.print(f"step {step:>6}/{total_steps} | loss {metrics['loss']:.4f} | lr {metrics['lr']:.3e} | "
                   f"grad norm {metrics['grad_norm']:.3f}{scale}{moe} | {metrics['tokens_per_sec']:.0f} tokens/s | "
                   f"{metrics['tflops_per_device']:.3f} TFLOP/s/device{mfu}{skipped}")
        if self.writer:
            for key in ("loss", "lr", "grad_norm", "loss_scale", "tokens_per_sec", "tflops_per_device",
                        "moe_aux_loss", "expert_load_min", "expert_load_max", "rewards_chosen", "rewards_rejected",
                        "reward_margin", "reward_accuracy", "accuracy", "margin", "max_logit", "indexer_kl",
                        "mtp_loss", *RL_KEYS):
                value = metrics.get(key)
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(f"train/{key}", value, step)

    def validation(self, step: int, loss: float, extra: dict | None = None) -> None:
        """The validation loss, with further held-out figures (`extra`: a reward model's val_accuracy and val_margin,
        the BEMA weights' val_bema_loss)."""
        if not self.enabled:
            return
        extra = extra or {}
        if not self.perplexity:  # a preference, RL or distillation loss: exp of it is no perplexity
            self._write({"step": step, "val_loss": loss, **extra})
            self.print(f"validation at step {step}: loss {loss:.4f}"
                       + "".join(f" | {k[4:]} {v:.4f}" for k, v in extra.items()))
            if self.writer:
                self.writer.add_scalar("valid/loss", loss, step)
                for key, value in extra.items():
                    self.writer.add_scalar(f"valid/{key[4:]}", value, step)
            return
        ppl = math.exp(min(loss, 700.0))
        self._write({"step": step, "val_loss": loss, "val_ppl": ppl, **extra})
        self.print(f"validation at step {step}: loss {loss:.4f} | perplexity {ppl:.2f}"
                   + "".join(f" | {k[4:]} {v:.4f}" for k, v in extra.items()))
        if self.writer:
            self.writer.add_scalar("valid/loss", loss, step)
            self.writer.add_scalar("valid/ppl", ppl, step)
            for key, value in extra.items():
                self.writer.add_scalar(f"valid/{key[4:]}", value, step)

    def rl_validation(self, step: int, metrics: dict) -> None:
        """An RL run's held-out rewards (`RLRun.evaluate`: val_reward, val_rewards/<function>/mean, ...)."""
        if not self.enabled:
            return
        self._write({"step": step, **metrics})
        self.print(f"validation at step {step}: held-out reward {metrics['val_reward']:.4f} (std "
                   f"{metrics['val_reward_std']:.4f}) | completion length {metrics['val_completions/mean_length']:.1f}")
        if self.writer:
            for key in ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio"):
                value = metrics.get(f"val_{key}")
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(f"valid/{key}", value, step)

    def _write(self, record: dict) -> None:
        self.history.append(record)
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self, plot: bool = True) -> Path | None:
        """Close the files; write loss_curve.png from the whole metrics.jsonl when `plot`."""
        if not self.enabled:
            return None
        if self.bar:
            self.bar.close()
        if self.writer:
            self.writer.close()
        self.file.close()
        return plot_loss_curve(self.run_dir / "metrics.jsonl", self.run_dir / "loss_curve.png") if plot else None


RL_KEYS = ("reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "cispo_clip_ratio", "vespo/phi_seq_mean",
           "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio", "logprob_diff_max",
           "generation_s")
"""What an RL run logs to TensorBoard (metrics.jsonl has every metric, as TRL names them)."""


def run_figure(records: list[dict], title: str):
    """The run's figure from metrics.jsonl records: training (and validation) loss against step; for MoE runs
    a second panel below with what shows routing collapse, the least and most loaded expert's share of its
    layer's routed slots (1 = uniform; the extremes over all layers) and the balancing (aux + z) loss; for
    preference runs a panel with the reward margin and the accuracy (chosen rewarded above rejected); for RL runs
    a panel with the mean reward of each round's completions (and the held-out prompts') and their mean length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key):
        return [(r["step"], r[key]) for r in records if key in r and r[key] is not None and math.isfinite(r[key])]

    train, valid = series("loss"), series("val_loss")
    scored = bool(series("min_reward"))  # a reward model's run: TRL's names for its margin and accuracy
    moe, margin = series("expert_load_min"), series("margin" if scored else "reward_margin")
    correct = series("accuracy" if scored else "reward_accuracy")
    reward = series("reward") if not margin else []
    panels = 1 + bool(moe) + bool(margin) + bool(reward)
    fig, axes = plt.subplots(panels, 1, figsize=(7, 4 + 2.5 * (panels - 1)), sharex=True, squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="validation loss")
    indexer = series("indexer_kl")
    if indexer:  # sparse attention: the indexers' divergence from the attention, on its own scale
        kl = ax.twinx()
        kl.plot(*zip(*indexer), color="tab:purple", lw=0.8, label="indexer KL (right)")
        kl.set_ylabel("indexer KL (nats/token)")
        kl.legend(loc="upper center", fontsize="small")
    per = "pair" if correct else "example"  # KTO: unpaired examples
    ax.set_ylabel("Bradley-Terry loss (per pair)" if scored else f"preference loss (per {per})" if margin
                  else "RL loss" if reward else "cross-entropy (nats/token)")
    ax.set_title(f"shardlm: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    if moe:
        load = axes[1][0]
        load.plot(*zip(*moe), label="least loaded expert")
        load.plot(*zip(*series("expert_load_max")), label="most loaded expert")
        load.axhline(1.0, color="grey", lw=0.8, ls="--")
        load.set_ylabel("expert load / uniform")
        load.grid(alpha=0.3)
        aux = load.twinx()
        aux.plot(*zip(*series("moe_aux_loss")), color="tab:red", lw=0.8, label="balancing loss (right)")
        aux.set_ylabel("aux + z loss")
        lines = load.get_lines()[:2] + aux.get_lines()
        load.legend(lines, [line.get_label() for line in lines], fontsize="small")
    if margin:
        rewards = axes[-1][0]
        rewards.plot(*zip(*margin), label="reward margin (chosen - rejected)")
        rewards.axhline(0.0, color="grey", lw=0.8, ls="--")
        rewards.set_ylabel("reward margin")
        rewards.grid(alpha=0.3)
        accuracy = rewards.twinx()
        if correct:
            accuracy.plot(*zip(*correct), color="tab:green", lw=0.8, label="accuracy (right)")
            accuracy.set_ylim(-0.05, 1.05)
            accuracy.set_ylabel("accuracy")
        else:  # KTO: the KL reference point z0
            accuracy.plot(*zip(*series("kl")), color="tab:green", lw=0.8, label="KL estimate z0 (right)")
            accuracy.set_ylabel("KL (nats)")
        lines = rewards.get_lines()[:1] + accuracy.get_lines()
        rewards.legend(lines, [line.get_label() for line in lines], fontsize="small")
    if reward:
        panel = axes[-1][0]
        panel.plot(*zip(*reward), color="tab:green", label="mean reward")
        if series("val_reward"):
            panel.plot(*zip(*series("val_reward")), "o-", color="tab:olive", label="held-out reward")
        panel.set_ylabel("reward")
        panel.grid(alpha=0.3)
        length = panel.twinx()
        length.plot(*zip(*series("completions/mean_length")), color="tab:grey", lw=0.8,
                    label="completion length (right)")
        length.set_ylabel("tokens")
        lines = panel.get_lines() + length.get_lines()
        panel.legend(lines, [line.get_label() for line in lines], fontsize="small")
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    return fig


def plot_loss_curve(metrics_file: Path, out: Path) -> Path:
    """`run_figure` of a metrics.jsonl, written atomically as a PNG."""
    import matplotlib.pyplot as plt

    from shardlm.checkpoint.files import write_atomically

    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    fig = run_figure(records, str(metrics_file.parent))
    write_atomically(out, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return out
