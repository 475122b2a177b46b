"""KTO's unpaired records, their KL sequences and their rows: the record shapes and their one-line errors, the
rotation of the completions, and rows that hold each example's sequence and its KL sequence side by side."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from shardlm.errors import UserError
from shardlm.preference.data import PairDataset, PairRows
from shardlm.preference.unpaired import TokenizedExample, kl_completions, load_examples, tokenize_example


def write(tmp_path, records: list[dict], name: str = "records.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_unpaired_records_in_order(tmp_path):
    path = write(tmp_path, [{"prompt": "2+2=", "completion": "4", "label": True},
                            {"prompt": [{"role": "user", "content": "hi"}],
                             "completion": [{"role": "assistant", "content": "hello"}], "label": False}])
    first, second = load_examples(path)
    assert (first.prompt, first.completion, first.label, first.conversational) == ("2+2=", "4", True, False)
    assert second.conversational and not second.label and second.where.endswith(":2")


def test_paired_records_are_unpaired_chosen_first(tmp_path):
    """Every chosen answer (desirable) in order, then every rejected one (undesirable), as TRL unpairs a batch: a
    rotation by one then pairs each prompt with another record's answer."""
    path = write(tmp_path, [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)])
    examples = load_examples(path)
    assert [(e.prompt, e.completion, e.label) for e in examples] == (
        [(f"q{i}", f"good {i}", True) for i in range(3)] + [(f"q{i}", f"bad {i}", False) for i in range(3)])


@pytest.mark.parametrize("record, message", [
    ({"prompt": "q", "completion": "a"}, "has no 'label'"),
    ({"prompt": "q", "completion": "a", "label": 1}, "must be true (desirable) or false"),
    ({"prompt": "q", "completion": "", "label": True}, "has no 'completion'"),
    ({"prompt": ["q"], "completion": "a", "label": True}, "must both be strings"),
])
def test_bad_unpaired_records_are_one_line_errors(tmp_path, record, message):
    path = write(tmp_path, [{"prompt": "ok", "completion": "fine", "label": True}, record])
    with pytest.raises(UserError, match=re.escape(message)) as error:
        load_examples(path)
    assert str(error.value).startswith(f"{path}:2:") and "\n" not in str(error.value)


def test_mixed_shapes_are_refused(tmp_path):
    path = write(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b"},
                            {"prompt": "q", "completion": "a", "label": True}])
    with pytest.raises(UserError, match="one shape per run"):
        load_examples(path)


def test_a_paired_loss_on_unpaired_records_names_kto(tmp_path):
    from shardlm.preference.pairs import load_pairs

    with pytest.raises(UserError, match='preference.loss="kto"'):
        load_pairs(write(tmp_path, [{"prompt": "q", "completion": "a", "label": True}]))


def test_the_completions_rotate_by_one_within_each_group():
    """TRL's rotation within batches: example i takes completion i - 1, each group's first its last; a last group of
    one takes the completion before it; a single example has nothing to mismatch."""
    completions = [[i] for i in range(7)]
    assert kl_completions(completions, 3) == [[2], [0], [1], [5], [3], [4], [5]]
    assert kl_completions(completions, 7) == [[6], [0], [1], [2], [3], [4], [5]]
    assert all(kl != own for kl, own in zip(kl_completions(completions, 2), completions))
    with pytest.raises(UserError, match="at least 2 examples"):
        kl_completions([[1]], 4)


class Words:
    """A stand-in template: one token a character, no chat rendering."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_text_completions_end_with_the_end_token():
    from shardlm.preference.unpaired import UnpairedExample

    prompt, completion = tokenize_example(Words(), UnpairedExample("ab", "c", True, "x:1"), "$")
    assert prompt == [ord("a"), ord("b")] and completion == [ord("c"), ord("$")]
    assert tokenize_example(Words(), UnpairedExample("ab", "c$", True, "x:1"), "$")[1] == [ord("c"), ord("$")]


def examples(count: int = 9, seed: int = 0) -> list[TokenizedExample]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, 50, size=int(rng.integers(2, 6))).tolist() for _ in range(count)]
    completions = [rng.integers(50, 99, size=int(rng.integers(1, 8))).tolist() for _ in range(count)]
    kl = kl_completions(completions, 4)
    return [TokenizedExample(p, c, k, bool(i % 3), f"e{i}")
            for i, (p, c, k) in enumerate(zip(prompts, completions, kl))]


@pytest.mark.parametrize("strategy", ["bfd", "pad"])
def test_rows_hold_each_example_and_its_kl_sequence(strategy):
    """Each example's row holds its sequence (prompt + completion, the completion trained) in the row's arrays and
    its KL sequence (prompt + the mismatched completion) in the `kl_` arrays, both under the example's index and
    side 0, positions restarting at each sequence; every example once an epoch; the labels by index."""
    data = PairDataset(PairRows(examples(), 24, pad_id=0, seed=3, strategy=strategy), epochs=1)
    assert data.rows.labels == [e.label for e in data.rows.pairs]
    seen = []
    for index in range(len(data)):
        row = data[index]
        for prefix, answer in (("", "completion"), ("kl_", "kl_completion")):
            for i in sorted(set(row[f"{prefix}pair"].tolist()) - {-1}):
                example = data.rows.pairs[i]
                mask = row[f"{prefix}pair"] == i
                tokens, labels = row[f"{prefix}input_ids"][mask], row[f"{prefix}labels"][mask]
                assert tokens.tolist() == example.prompt + getattr(example, answer)
                assert row[f"{prefix}position_ids"][mask].tolist() == list(range(len(tokens)))
                assert (row[f"{prefix}side"][mask] == 0).all()
                trained = labels[labels != -100].tolist()
                assert trained == getattr(example, answer), (i, prefix)
                if not prefix:
                    seen.append(i)
        assert set(row["pair"].tolist()) - {-1} == set(row["kl_pair"].tolist()) - {-1}
    assert sorted(seen) == list(range(9))
    past = data[len(data)]
    assert (past["kl_pair"] == -1).all() and (past["kl_labels"] == -100).all()


def test_the_reference_fingerprint_covers_the_kl_sequences_and_the_labels():
    """A resumed run reads its saved reference table only for the same examples: another KL completion or another
    label is other data."""
    from dataclasses import replace

    from shardlm.preference.reference import pairs_fingerprint

    def fingerprint(items):
        return pairs_fingerprint(PairDataset(PairRows(items, 24, seed=None)))

    base = examples()
    flipped = [replace(base[0], label=not base[0].label)] + base[1:]
    other_kl = [replace(base[0], kl_completion=base[0].kl_completion + [1])] + base[1:]
    assert len({fingerprint(base), fingerprint(flipped), fingerprint(other_kl)}) == 3
    assert fingerprint(base) == fingerprint(examples())


def test_rows_without_kl_sequences():
    """A loss without the KL term (`apo_zero_unpaired`): examples with no KL completion make rows without `kl_`
    arrays, each example taking its own sequence's length."""
    from dataclasses import replace

    plain = [replace(e, kl_completion=None) for e in examples()]
    data = PairDataset(PairRows(plain, 24, seed=None), epochs=1)
    assert not data.rows.with_kl and all(len(e) == len(e.prompt) + len(e.completion) for e in plain)
    assert not any(key.startswith("kl_") for key in data[0]) and not any(key.startswith("kl_") for key in
                                                                         data[len(data)])
