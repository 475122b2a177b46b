"""One generation round's sequences packed into the step's rows, with everything the loss reads per token.

Each sequence (prompt + completion) is a document of a row (per-document positions and attention, as SFT and DPO
pack), packed best-fit-decreasing by length (`sft.packing`: "pad" puts one sequence a row) into exactly
`train.global_batch_size` rows of model.seq_length tokens on every rank alike, before the rows are dealt out to
micro-batches and data-parallel ranks; a sequence never splits. A row (`StepRows[i]`) is a dict of (T,) arrays:

- `input_ids`, `position_ids` (restarting at every sequence), `labels` (the next token where it is a completion's
  and sampled by the policy, -100 elsewhere: the prompt, tool results (`shardlm.rl.agent`), the last token,
  padding), `sequence` (the sequence's index in the round, -1 on padding), `row` (the row's index);
- per completion token, at the position that predicts it: `advantage` (its sequence's), `weight` (its share of the
  loss of the global batch: the loss type's normalizer, below), `token_weight` (1 / the batch's completion tokens:
  token means such as KL and entropy), `sequence_weight` (1 / (its sequence's tokens x sequences): GSPO's means
  over sequences), `sample_logp` (the rollout's log-probability), `old_logp` and `ref_logp` (filled by the scoring
  passes: the policy before the round's updates, the reference); RLOO and GMPO with masked truncation also
  `masked_share` (1 / (its sequence's tokens x sequences) on a masked sequence: TRL's RLOO and GMPO count its
  loss -A, its ratio exp(0) over no tokens, in the step's mean, a constant without gradient).

A round of rl.generation_batch_size sequences feeds S = `steps_per_generation` optimizer steps: its sequences are
shuffled (`split_round`, seeded by train.seed and the round) and split into S equal parts, step s's packed into rows
s x global_batch_size ... (s + 1) x global_batch_size - 1, so the trainer's sample counter (row i % rows) takes the
steps in turn, rl.num_iterations times over.

The weights make each step's loss its global batch's under every layout, never a mean of per-micro-batch means.
With m the completion mask (0 on a masked truncated completion, whose sequence still counts, as in TRL), n_j a
sequence's tokens (the policy's: tool results never count), N the step's sequences and L rl.max_completion_length:

    grpo, sapo, rloo, gmpo, a2po   sum_j (sum_t m l) / max(n_j, 1) / N   per-sequence means, then their mean
                                                             (rloo, gmpo, a2po: l is the sequence's loss at every token)
    luspo           sum (m l) / N                            per-sequence sums (each times its length), their mean
    dr_grpo         sum (m l) / (N L)                        a constant normalizer
    bnpo            sum (m l) / max(sum m, 1)                token mean over the step's global batch
    dapo, cispo, vespo   sum (m l) / (max(sum_round m, 1) / S)   the round's token mean, split over its steps (TRL's
                                                             normalizer over the generation batch; S = 1: bnpo's)
"""

from __future__ import annotations

import numpy as np

from shardlm.errors import UserError
from shardlm.rl.rollout import Rollout
from shardlm.sft.packing import IGNORE_INDEX, plan_bins, shift_labels

FLOAT_FIELDS = ("advantage", "weight", "token_weight", "sequence_weight", "sample_logp", "old_logp", "ref_logp")


class StepRows:
    """The rows of one generation round (module docstring); `rows[i]` for any i (the trainer's sample counter runs
    on: row i % rows)."""

    def __init__(self, rollouts: list[Rollout], advantages: np.ndarray, loss: str, max_completion_length: int,
                 mask_truncated: bool, num_rows: int, seq_length: int, pad_id: int, packing: str = "bfd",
                 step_of: np.ndarray | None = None):
        """`num_rows` rows a step; `step_of` (N,): each sequence's step of the round (`split_round`; None: one
        step)."""
        lengths = [len(r.prompt) + len(r.completion) for r in rollouts]
        if max(lengths) > seq_length:
            raise UserError(f"a sequence of {max(lengths)} tokens does not fit model.seq_length={seq_length}")
        step_of = np.zeros(len(rollouts), dtype=np.int64) if step_of is None else np.asarray(step_of)
        steps = int(step_of.max()) + 1
        mask = [0.0 if (r.truncated and mask_truncated) else 1.0 for r in rollouts]
        tokens = np.array([r.policy_tokens * m for r, m in zip(rollouts, mask)])  # (tool results untrained)
        members = [np.flatnonzero(step_of == s) for s in range(steps)]
        round_tokens = max(tokens.sum(), 1.0) / steps  # dapo, cispo, vespo: the round's, a step's share
        self.num_sequences, self.num_tokens = len(rollouts), float(tokens.sum())
        self.fields = {k: np.zeros((steps * num_rows, seq_length), dtype=np.int64)
                       for k in ("input_ids", "position_ids", "labels", "sequence", "row")}
        self.fields |= {k: np.zeros((steps * num_rows, seq_length), dtype=np.float64) for k in FLOAT_FIELDS}
        self.fields["labels"][:] = IGNORE_INDEX
        self.fields["sequence"][:] = -1
        self.fields["input_ids"][:] = pad_id
        self.fields["row"][:] = np.arange(steps * num_rows)[:, None]
        self.fields["position_ids"][:] = np.arange(seq_length)  # padding: positions of its own
        if loss in ("rloo", "gmpo") and mask_truncated:  # TRL's count a masked sequence's constant -A in the mean
            self.fields["masked_share"] = np.zeros((steps * num_rows, seq_length), dtype=np.float64)
        for s, own in enumerate(members):
            bins = plan_bins([lengths[j] for j in own], seq_length, packing)
            if len(bins) > num_rows:
                raise UserError(f"a step's {len(own)} sequences need {len(bins)} rows of {seq_length} tokens but a "
                                f"step has train.global_batch_size={num_rows}; raise it or lower rl.prompts_per_step")
            count, total = len(own), max(tokens[own].sum(), 1.0)
            per_sequence_losses = ("grpo", "sapo", "rloo", "gmpo", "a2po")  # (None: each sequence's own mean)
            normalizer = None if loss in per_sequence_losses else {
                "luspo": count, "dr_grpo": count * max_completion_length, "bnpo": total}.get(loss, round_tokens)
            for row, packed in enumerate(bins, start=s * num_rows):
                start = 0
                for j in sorted(own[i] for i in packed):
                    per_sequence = mask[j] / (max(tokens[j], 1.0) * count)
                    self._place(row, start, j, rollouts[j], advantages[j],
                                per_sequence if normalizer is None else mask[j] / normalizer, mask[j] / total,
                                per_sequence, (1 - mask[j]) / (max(rollouts[j].policy_tokens, 1) * count))
                    start += lengths[j]
                self.fields["position_ids"][row, start:] = np.arange(seq_length - start)

    def _place(self, row: int, start: int, j: int, rollout: Rollout, advantage: float, weight: float,
               token_weight: float, sequence_weight: float, masked_share: float) -> None:
        ids = rollout.prompt + rollout.completion
        n, p = len(ids), len(rollout.prompt)
        where = slice(start, start + n)
        f = self.fields
        f["input_ids"][row, where] = ids
        f["position_ids"][row, where] = np.arange(n)
        policy = [1] * len(rollout.completion) if rollout.mask is None else rollout.mask
        f["labels"][row, where] = shift_labels(ids, [0] * p + policy)
        f["sequence"][row, where] = j
        keep = np.flatnonzero(policy)  # the policy's own tokens (not the tool results')
        trained = start + p - 1 + keep  # the positions that predict them
        f["advantage"][row, trained] = advantage
        f["weight"][row, trained] = weight
        f["token_weight"][row, trained] = token_weight
        f["sequence_weight"][row, trained] = sequence_weight
        f["sample_logp"][row, trained] = np.asarray(rollout.logps, dtype=np.float64)[keep]
        if "masked_share" in f:
            f["masked_share"][row, trained] = masked_share

    @classmethod
    def from_fields(cls, fields: dict[str, np.ndarray]) -> StepRows:
        """Rows saved by a checkpoint in the middle of a round (`RLRun.save_round`)."""
        rows = cls.__new__(cls)
        rows.fields = dict(fields)
        rows.num_sequences = int(fields["sequence"].max()) + 1
        rows.num_tokens = float((fields["token_weight"] > 0).sum())
        return rows

    def __len__(self) -> int:
        return self.fields["row"].shape[0]

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = index % len(self)
        return {k: v[row] for k, v in self.fields.items()}

    def set_advantages(self, advantages: np.ndarray) -> None:
        """Give each completion token its sequence's advantage of `advantages` (N,) (RLOO's: known only after the
        scoring passes)."""
        f = self.fields
        trained = f["labels"] != IGNORE_INDEX
        f["advantage"][trained] = advantages[f["sequence"][trained]]

    def store(self, name: str, rows: np.ndarray, values: np.ndarray) -> None:
        """Write (b, T) per-position values (`old_logp` or `ref_logp`) of the rows numbered `rows` (b,)."""
        self.fields[name][rows] = values


def split_round(num_sequences: int, steps: int, seed: int, round_index: int) -> np.ndarray:
    """(N,) each sequence's step of a round split into `steps`: the round's order shuffled by (seed, round) and cut
    into equal contiguous parts (TRL shuffles its generation batch before splitting it); all 0 for one step."""
    step_of = np.zeros(num_sequences, dtype=np.int64)
    if steps > 1:
        order = np.random.default_rng([seed, 13, round_index]).permutation(num_sequences)
        step_of[order] = np.arange(num_sequences) // (num_sequences // steps)
    return step_of
