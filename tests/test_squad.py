"""SQuAD 1.1 / 2.0 data: the official metrics on hand-computed cases, the reader's checks, answers aligned
from characters to tokens and back, windows that cover every context token, and n-best decoding with
the no-answer score (`test_squad_finetune.py`: fine-tuning, the command, and TP=2 / DP=2).

The data is the shared sample of the official SQuAD 2.0 dev file (5 articles, 1,407 questions);
training uses articles 0-3 and evaluation article 4 (Victoria (Australia)), as no training split
is available offline. The model is a tiny BERT (2 layers, hidden 64, the real WordPiece vocabulary).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from finetune_helpers import bert_vocab, untrained_bert_checkpoint

from shardlm.cli import main
from shardlm.errors import UserError
from shardlm.finetune.squad_data import SquadAnswer, SquadExample, read_squad
from shardlm.finetune.squad_decode import DecodeSettings, decode_answers
from shardlm.finetune.squad_features import (
    NO_OFFSET,
    SquadFeatures,
    char_span_to_tokens,
    context_windows,
    encode_squad,
    max_context_windows,
    tokenize_with_offsets,
)
from shardlm.finetune.squad_metrics import (
    exact_match,
    f1_score,
    normalize_answer,
    question_scores,
    squad_scores,
)

SEQ = 128
TRAIN_ARTICLES, DEV_ARTICLES = "0:4", "4:"


@pytest.fixture(scope="module")
def squad_file(data_dir):
    return data_dir / "squad/dev-v2.0-first5.json"


@pytest.fixture(scope="module")
def vocab(data_dir):
    return bert_vocab(data_dir)


@pytest.fixture(scope="module")
def tokenizer(vocab):
    from shardlm.data.tokenizers import build_tokenizer

    return build_tokenizer("bert", vocab)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, vocab):
    """An untrained tiny BERT saved as a shardlm checkpoint whose config names the BERT vocabulary."""
    return untrained_bert_checkpoint(tmp_path_factory.mktemp("squad_bert"), vocab, hidden_size=64, seq_length=SEQ)


def example(qid: str, *answers: str, context: str = "") -> SquadExample:
    return SquadExample(qid, "?", context, tuple(SquadAnswer(a, 0) for a in answers))


# ------------------------------------------------------------------------------------- metrics

def test_normalization_lowercases_and_drops_punctuation_articles_and_extra_spaces():
    assert normalize_answer("The  Quick, brown\tfox!") == "quick brown fox"
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("Theater and anthem") == "theater and anthem"  # whole words only
    assert normalize_answer("U.S.A.") == "usa" and normalize_answer("don't") == "dont"
    assert normalize_answer("the-end") == "theend"  # punctuation goes before articles are looked for
    assert normalize_answer("“Quoted”") == "“quoted”"  # only ASCII punctuation is removed
    assert normalize_answer("The") == "" and normalize_answer("") == ""


def test_exact_match_and_f1_by_hand():
    assert exact_match("the Denver Broncos!", "Denver Broncos") == 1
    assert exact_match("Broncos", "Denver Broncos") == 0
    # "cat sat on mat" vs "cat on mat": 3 shared words, precision 3/4, recall 1 -> 2 * 0.75 / 1.75
    assert f1_score("the cat sat on the mat", "a cat on a mat") == pytest.approx(6 / 7)
    # a bag of words: "cat" counts once, precision 1/3, recall 1 -> 0.5
    assert f1_score("cat cat cat", "cat") == pytest.approx(0.5)
    assert f1_score("dog", "cat") == 0.0
    # empty texts: v2.0 scores two empty answers 1, v1.1 scores any empty text 0
    assert f1_score("", "") == 1.0 and f1_score("the", "") == 1.0 and f1_score("", "cat") == 0.0
    assert f1_score("", "", version="1.1") == 0.0


def test_a_question_scores_the_best_of_its_references():
    question = example("q", "Denver Broncos", "the Broncos", "Broncos team")
    assert question_scores(question, "broncos", "2.0") == (1, 1.0)
    # "denver" against the three: F1 2/3, 0, 0 -> 2/3
    assert question_scores(question, "Denver", "2.0") == (0, pytest.approx(2 / 3))
    # a reference that normalizes to nothing: v1.1 keeps it (an empty prediction matches it exactly),
    # v2.0 drops it, leaving only the empty answer of an unanswerable question
    only_article = example("a", "The")
    assert question_scores(only_article, "", "1.1") == (1, 0.0)
    assert question_scores(only_article, "", "2.0") == (1, 1.0)


def test_v2_scores_no_answer_questions_breakdowns_and_the_best_threshold():
    questions = [example("q1", "Denver Broncos", "Broncos"), example("q2", "1990"),
                 example("q3"), example("q4")]  # q3, q4: unanswerable
    predictions = {"q1": "the Broncos", "q2": "in 1990 season", "q3": "", "q4": "Paris"}
    # per question (EM, F1): q1 (1, 1), q2 (0, 1/3 precision x 1 recall -> 0.5), q3 (1, 1), q4 (0, 0)
    plain = squad_scores(questions, predictions, "2.0")
    assert plain == {"exact": 50.0, "f1": 62.5, "total": 4, "HasAns_exact": 50.0, "HasAns_f1": 75.0,
                     "HasAns_total": 2, "NoAns_exact": 50.0, "NoAns_f1": 50.0, "NoAns_total": 2}
    # q4's odds 1.5 exceed the default threshold 1.0: counted as "no answer", right for q4.
    # Best threshold: start with no answer everywhere (2 of 4 right), then answer in order of odds:
    # q2 (-3): +0.5 F1 / +0 EM, q1 (-2): +1 -> 3.5 F1 / 3 EM (the best), q4 (1.5): -1 ("Paris"), q3 (3): 0
    odds = {"q1": -2.0, "q2": -3.0, "q3": 3.0, "q4": 1.5}
    scored = squad_scores(questions, predictions, "2.0", odds)
    assert scored == {"exact": 75.0, "f1": 87.5, "total": 4, "HasAns_exact": 50.0, "HasAns_f1": 75.0,
                      "HasAns_total": 2, "NoAns_exact": 100.0, "NoAns_f1": 100.0, "NoAns_total": 2,
                      "best_exact": 75.0, "best_exact_thresh": -2.0, "best_f1": 87.5, "best_f1_thresh": -2.0}
    assert squad_scores(questions[:2], predictions, "1.1") == {"exact_match": 50.0, "f1": 75.0}
    assert squad_scores(questions[:2], {"q1": "Broncos"}, "1.1") == {"exact_match": 50.0, "f1": 50.0}  # q2 missing


# ---------------------------------------------------------------------------------------- reader

def test_reader_reads_the_shared_sample(squad_file):
    v2 = read_squad(squad_file, "2.0")
    assert len(v2) == 1407 and sum(e.is_impossible for e in v2) == 702
    v1 = read_squad(squad_file, "1.1")
    assert len(v1) == 705 and not any(e.is_impossible for e in v1)
    assert all(e.context[a.start:a.start + len(a.text)] == a.text for e in v1 for a in e.answers)
    held_out = read_squad(squad_file, "2.0", DEV_ARTICLES)
    assert len(held_out) == 247 and {e.title for e in held_out} == {"Victoria_(Australia)"}
    assert len(read_squad(squad_file, "2.0", TRAIN_ARTICLES)) == 1407 - 247


def write_squad(path, mutate) -> str:
    record = {"version": "v2.0", "data": [{"title": "T", "paragraphs": [{"context": "Paris is in France.", "qas": [
        {"id": "q1", "question": "Where is Paris?", "answers": [{"text": "France", "answer_start": 12}],
         "is_impossible": False}]}]}]}
    mutate(record["data"][0]["paragraphs"][0]["qas"][0])
    path.write_text(json.dumps(record))
    return str(path)


def test_bad_files_are_one_line_errors_naming_the_question(tmp_path):
    def shifted(qa):
        qa["answers"][0]["answer_start"] = 11

    with pytest.raises(UserError, match=r"question q1: answer_start=11 does not point at the answer 'France'"):
        read_squad(write_squad(tmp_path / "a.json", shifted), "2.0")
    with pytest.raises(UserError, match=r"question q1 has no 'question'"):
        read_squad(write_squad(tmp_path / "b.json", lambda qa: qa.pop("question")), "2.0")
    with pytest.raises(UserError, match=r"question q1 is_impossible but has 1 answers"):
        read_squad(write_squad(tmp_path / "c.json", lambda qa: qa.update(is_impossible=True)), "2.0")
    with pytest.raises(UserError, match=r"question q1 has no answers"):
        read_squad(write_squad(tmp_path / "d.json", lambda qa: qa.update(answers=[])), "1.1")
    with pytest.raises(UserError, match=r"--train-articles='7:' selects no article"):
        read_squad(write_squad(tmp_path / "e.json", lambda qa: None), "2.0", "7:")


def test_data_is_a_train_file_with_dev_or_a_folder_of_the_official_names(tmp_path):
    from shardlm.finetune.squad_data import squad_files

    (tmp_path / "train-v2.0.json").write_text("{}")
    assert squad_files(tmp_path, None, "2.0") == (tmp_path / "train-v2.0.json", tmp_path / "dev-v2.0.json")
    other = tmp_path / "other.json"
    assert squad_files(tmp_path, str(other), "1.1") == (tmp_path / "train-v1.1.json", other)
    train = tmp_path / "train-v2.0.json"
    assert squad_files(train, str(tmp_path / "dev.json"), "2.0") == (train, tmp_path / "dev.json")
    with pytest.raises(UserError, match="pass the dev file with --dev"):
        squad_files(train, None, "2.0")


def test_cli_refuses_a_bad_file_in_one_line(checkpoint, tmp_path, capsys):
    def shifted(qa):
        qa["answers"][0]["answer_start"] = 3

    bad = write_squad(tmp_path / "train.json", shifted)
    assert main(["finetune", "squad", "--checkpoint", str(checkpoint), "--data", bad, "--dev", bad,
                 "--version", "2.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "question q1: answer_start=3" in err
    assert main(["finetune", "squad", "--checkpoint", str(checkpoint), "--data", bad]) == 2
    assert "pass the dev file with --dev" in capsys.readouterr().err
    assert main(["finetune", "squad", "--checkpoint", str(checkpoint), "--data", bad, "--doc-stride", "0"]) == 2
    assert "--doc-stride=0 must be at least 1" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ alignment

# Answers that end inside a word: the tokens covering them give the whole word back.
ALIGNMENT_EXCEPTIONS = [("57060a1175f01819005e78d3", "rich", "richest"),
                        ("570d2f5bfed7b91900d45cd3", "Victoria Constitution Act 185", "Victoria Constitution Act 1855"),
                        ("570d4329fed7b91900d45dd9", "gold rush", "gold rushes"),
                        ("570d4329fed7b91900d45dd9", "gold rush", "gold rushes")]


def test_gold_spans_map_to_tokens_and_back_to_the_gold_text(squad_file, tokenizer):
    examples = read_squad(squad_file, "1.1")
    contexts = sorted({e.context for e in examples})
    offsets = {c: o for c, (_, o) in zip(contexts, tokenize_with_offsets(tokenizer, contexts))}
    answers, mismatches = 0, []
    for e in examples:
        for answer in e.answers:
            answers += 1
            first, last = char_span_to_tokens(offsets[e.context], answer.start, answer.start + len(answer.text))
            back = e.context[offsets[e.context][first][0]:offsets[e.context][last][1]]
            if normalize_answer(back) != normalize_answer(answer.text):
                mismatches.append((e.id, answer.text, back))
    assert answers == 2106
    assert mismatches == ALIGNMENT_EXCEPTIONS  # 4 of 2,106: 99.8% round trip
    assert len(mismatches) <= 0.01 * answers


def test_windows_cover_every_context_token_with_the_stride(squad_file, tokenizer):
    assert context_windows(10, 4, 3) == [(0, 4), (3, 4), (6, 4)]
    assert context_windows(3, 4, 2) == [(0, 3)]
    # most context: min(left, right) + 0.01 x length; token 2 of [(0, 4), (2, 4)]: 1.04 in window 0, 0.04 in 1
    assert max_context_windows([(0, 4), (2, 4)], 6).tolist() == [0, 0, 0, 1, 1, 1]
    assert max_context_windows([(0, 5), (2, 3)], 5).tolist() == [0, 0, 0, 0, 0]  # token 3: 1.05 beats 1.03
    examples = read_squad(squad_file, "2.0")
    seq, stride, max_query = 64, 16, 24
    features = encode_squad(examples, tokenizer, seq, stride, max_query, training=True)
    contexts = sorted({e.context for e in examples})
    token_offsets = {c: o for c, (_, o) in zip(contexts, tokenize_with_offsets(tokenizer, contexts))}
    windows_of = [[] for _ in examples]
    for f, owner in enumerate(features.example_index.tolist()):
        windows_of[owner].append(f)
    for i, e in enumerate(examples):
        question = tokenizer.encode(e.question)[:max_query]
        covered, scored = [], []
        for f in windows_of[i]:
            tokens = features.data.tokens[f]
            context = features.offsets[f, :, 0] != NO_OFFSET
            assert tokens[:len(question) + 2].tolist() == [tokenizer.cls, *question, tokenizer.sep]
            assert tokens[np.flatnonzero(context).max() + 1] == tokenizer.sep
            covered += [tuple(o) for o in features.offsets[f][context]]
            scored += [tuple(o) for o in features.offsets[f][features.max_context[f]]]
            start, end = features.data.labels[f]
            if e.is_impossible or (start, end) == (0, 0):
                continue
            text = e.context[features.offsets[f, start, 0]:features.offsets[f, end, 1]]
            assert normalize_answer(text) == normalize_answer(e.answers[0].text) or e.id in dict(
                (x[0], x) for x in ALIGNMENT_EXCEPTIONS)
        every = [tuple(o) for o in token_offsets[e.context]]
        assert sorted(set(covered)) == sorted(every)  # every context token is in some window
        assert sorted(scored) == sorted(every)  # and is scored in exactly one
        assert len(windows_of[i]) == max(1, -(-(len(every) - (seq - 3 - len(question))) // stride) + 1)
    labels = features.data.labels
    assert (labels[[examples[o].is_impossible for o in features.example_index]] == 0).all()
    answerable = {o for f, o in enumerate(features.example_index) if labels[f, 0] > 0}
    assert len(answerable) >= 0.99 * 705  # nearly every answer fits whole in some 40-token window


# -------------------------------------------------------------------------------------- decoding

def test_decoding_takes_the_best_valid_span_and_compares_it_with_no_answer():
    context = "alpha beta gamma delta"
    offsets = np.full((8, 2), NO_OFFSET, dtype=np.int32)  # [CLS] q [SEP] alpha beta gamma delta [SEP]
    offsets[3:7] = [(0, 5), (6, 10), (11, 16), (17, 22)]
    max_context = np.zeros(8, dtype=bool)
    max_context[3:7] = True
    max_context[4] = False  # "beta" is scored in another window
    features = SquadFeatures(None, np.array([0]), offsets[None], max_context[None])
    logits = np.zeros((1, 8, 2), dtype=np.float32)
    logits[0, :, 0] = [1.0, 9.0, 0, 2.0, 8.0, 3.0, 0, 0]  # starts: q token 9 (invalid), beta 8 (not max context)
    logits[0, :, 1] = [1.5, 0, 0, 0, 0, 4.0, 2.5, 0]  # ends: gamma 4, delta 2.5
    questions = [SquadExample("q", "?", context, ())]
    predictions, odds = decode_answers(questions, features, logits, DecodeSettings("1.1"))
    assert predictions == {"q": "gamma"} and odds == {}  # start gamma 3 + end gamma 4 beats alpha..gamma 2 + 4
    assert decode_answers(questions, features, logits, DecodeSettings("1.1", n_best=1))[0] == {"q": ""}
    # 2.0: null score 1 + 1.5 = 2.5 against the best span 7: odds -4.5
    predictions, odds = decode_answers(questions, features, logits, DecodeSettings("2.0"))
    assert predictions == {"q": "gamma"} and odds == {"q": pytest.approx(-4.5)}
    predictions, _ = decode_answers(questions, features, logits, DecodeSettings("2.0", null_threshold=-5.0))
    assert predictions == {"q": ""}
    logits[0, 5, 0] = -10.0  # gamma hardly starts: alpha..gamma (2 + 4) is best, but 3 tokens long
    assert decode_answers(questions, features, logits, DecodeSettings("1.1"))[0] == {"q": "alpha beta gamma"}
    short = DecodeSettings("1.1", max_answer_length=2)  # then delta..delta (0 + 2.5) beats alpha..beta (2 + 0)
    assert decode_answers(questions, features, logits, short)[0] == {"q": "delta"}
