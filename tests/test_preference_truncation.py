"""Preference pairs longer than a row are truncated as TRL truncates them (`sft.overflow = "truncate"`).

The model and Dolly pairs of `tests/test_preference_trl.py` (conversational records, rendered by the chat template
on both sides), but the 4 first pairs whose two sequences are each longer than half a row of 128 tokens (and whose
prompt takes less than 48 of them): shardlm cuts each sequence to 64 tokens, keeping its start, and TRL's
`DPOTrainer` with `max_length=64` and `truncation_mode="keep_start"` cuts each of its sequences the same way.
Sigmoid DPO, the reference precomputed on shardlm's side, TRL's reference model run in each step on the cut
sequences: each of 3 steps' loss, rewards and margin and the first gradient norm agree within the DPO comparison's
bounds (`assert_follows`). Under `sft.overflow = "drop"` the same records are a one-line error (every pair dropped).
"""

from __future__ import annotations

import json

import pytest
import test_preference_trl as base
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from multiproc import import_or_skip

trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")

from shardlm.errors import UserError  # noqa: E402
from shardlm.preference.data import PairRows, fit  # noqa: E402
from shardlm.preference.dolly import dolly_pairs  # noqa: E402
from shardlm.preference.pairs import TokenizedPair  # noqa: E402
from shardlm.preference.unpaired import TokenizedExample  # noqa: E402
from shardlm.sft.template import ChatTemplate  # noqa: E402

setup = base.setup
SHARE = base.SEQ // 2
"""Each sequence's share of a row, TRL's max_length."""


@pytest.fixture(scope="module")
def long_pairs(setup, data_dir):
    template = ChatTemplate.from_dir(setup["hf"])
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()

    def tokens(pair, side):
        return len(template.encode(template.render(pair["prompt"] + pair[side])))

    pairs = [p for p in dolly_pairs(lines[:200]) if len(template.encode(template.render(
        p["prompt"], add_generation_prompt=True))) < 48 and min(tokens(p, "chosen"), tokens(p, "rejected")) > SHARE]
    pairs = pairs[:base.PAIRS]
    assert len(pairs) == base.PAIRS
    path = setup["root"] / "long_pairs.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    return {"pairs": pairs, "path": path}


def test_truncated_pairs_follow_trls_max_length(setup, long_pairs):
    theirs = base.trl_logs(trl.DPOTrainer, base.dpo_args(setup, "trl_truncated", max_length=SHARE,
                                                         truncation_mode="keep_start"),
                           long_pairs["pairs"], setup["hf"])
    ours = base.shardlm_metrics(setup, long_pairs["path"], "shardlm_truncated",
                                ["preference.loss=\"sigmoid\"", f"preference.beta={base.BETA}"])
    base.assert_follows(ours["steps"], theirs["steps"], base.BETA)
    assert ours["trainer"].train_data.rows.stats.truncated == base.PAIRS


def test_dropping_them_is_a_one_line_error(setup, long_pairs):
    with pytest.raises(UserError, match="every preference pair is longer than model.seq_length=128"):
        base.shardlm_metrics(setup, long_pairs["path"], "shardlm_dropped",
                             ["preference.loss=\"sigmoid\"", "sft.overflow=\"drop\""])


def test_each_sequence_is_cut_to_its_share_of_the_row():
    """`fit`: a pair with a gold answer in a row of 60 tokens gets 20 a sequence (the prompt's 10 and 10 of each
    answer, a shorter answer kept whole); a KTO example's sequence and KL sequence the whole row each; a prompt longer
    than its share drops the pair; a pair that fits is left alone. `PairRows` counts them."""
    pair = TokenizedPair([1] * 10, [2] * 50, [3] * 5, "a", gold=[4] * 40)
    cut = fit(pair, 60)
    assert (cut.prompt, cut.chosen, cut.rejected, cut.gold) == ([1] * 10, [2] * 10, [3] * 5, [4] * 10)
    assert len(cut) <= 60 and fit(pair, len(pair)) is pair
    assert fit(TokenizedPair([1] * 25, [2] * 50, [3] * 5, "b", gold=[4] * 4), 60) is None
    example = TokenizedExample([1] * 10, [2] * 70, [3] * 20, True, "c")
    cut = fit(example, 50)
    assert (cut.completion, cut.kl_completion) == ([2] * 40, [3] * 20)
    rows = PairRows([pair, TokenizedPair([1] * 35, [2] * 50, [3] * 5, "b"), TokenizedPair([1], [2], [3], "d")], 60)
    assert (rows.stats.truncated, rows.stats.dropped, len(rows.kept)) == (1, 1, 2)
    dropped = PairRows([pair, TokenizedPair([1], [2], [3], "d")], 60, overflow="drop")
    assert (dropped.stats.truncated, dropped.stats.dropped, dropped.kept) == (0, 1, [1])
