"""SFT data: records, chat-template rendering and loss masks, packing, per-document attention.

The reference renderer is transformers' `apply_chat_template` with the same tokenizer directory (the real
Qwen3 tokenizer in shared data); expected masks are derived from the records' own text.
"""

from __future__ import annotations

import json
import unicodedata

import pytest
import torch

from shardlm.errors import UserError
from shardlm.models.documents import block_causal_mask, document_causal_attention, reference_document_attention
from shardlm.sft.packing import IGNORE_INDEX, PackedRows, check_targets, collate, plan_bins, shift_labels
from shardlm.sft.records import ALPACA, Conversation, InstructionFields, load_conversations, to_conversation
from shardlm.sft.template import ChatTemplate, TokenizedConversation, tokenize_conversations

THINK = "<think>\n\n</think>\n\n"
END = "<|im_end|>"
# A ChatML template with generation tags (the end-of-turn token inside, the newline after it outside).
TAGGED = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chat_dir(data_dir):
    return data_dir / "chat"


@pytest.fixture(scope="module")
def template(chat_dir):
    return ChatTemplate.from_dir(chat_dir / "qwen3")


@pytest.fixture(scope="module")
def hf_tokenizer(chat_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(chat_dir / "qwen3"))


@pytest.fixture(scope="module")
def dolly(chat_dir):
    return [json.loads(line) for line in (chat_dir / "dolly-15k-first600.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def conversations(chat_dir):
    return load_conversations(chat_dir / "dolly-15k-first600.jsonl")


@pytest.fixture(scope="module")
def docs(template, conversations):
    return tokenize_conversations(template, conversations)


def _runs(mask):
    """[start, end) runs of ones."""
    runs, start = [], None
    for t, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- records


def test_dolly_records_become_one_user_and_one_assistant_turn(conversations, dolly):
    assert len(conversations) == 600
    for conv, record in zip(conversations, dolly):
        user = record["instruction"] + (f"\n\n{record['context']}" if record["context"] else "")
        assistant = {"role": "assistant", "content": record["response"]}
        assert conv.messages == [{"role": "user", "content": user}, assistant]
        assert conv.train_from == 0
    assert conversations[4].where.endswith("dolly-15k-first600.jsonl:5")


def test_record_shapes_and_instruction_mapping():
    where = "x.jsonl:1"
    pc = to_conversation({"prompt": "Hi", "completion": "Hello"}, where)
    assert pc.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert pc.train_from == 1
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    record = {"prompt": turns, "completion": [{"role": "assistant", "content": "d"}]}
    conv = to_conversation(record, where, system_prompt="S")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.train_from == 4
    alpaca = to_conversation({"instruction": "Add", "input": "1 and 2", "output": "3"}, where)
    assert alpaca.messages[0]["content"] == "Add\n\n1 and 2"
    no_input = to_conversation({"instruction": "Add", "input": "", "output": "3"}, where, ALPACA)
    assert no_input.messages[0]["content"] == "Add"
    custom = InstructionFields(prompt=("q",), answer="a", system="sys")
    conv = to_conversation({"q": "Why?", "a": "Because.", "sys": "Be brief."}, where, custom)
    assert conv.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"},
                             {"role": "assistant", "content": "Because."}]


def test_parquet_records_read_like_jsonl(tmp_path, dolly):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    pq.write_table(pa.Table.from_pylist(dolly[:5]), tmp_path / "d.parquet")
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dolly[:5]))
    from_parquet = load_conversations(tmp_path / "d.parquet")
    assert [c.messages for c in from_parquet] == [c.messages for c in load_conversations(tmp_path / "d.jsonl")]
    assert from_parquet[2].where.endswith("d.parquet:row 3")


def _one_line_error(call, *needles):
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


@pytest.mark.parametrize("record, needles", [
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}, ["no assistant turn"]),
    ({"messages": [{"role": "assistant", "content": "a"}]}, ["roles out of order", "message 0"]),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "u"}]},
     ["roles out of order", "message 1", "after a user turn"]),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                   {"role": "system", "content": "s"}]}, ["roles out of order", "message 2"]),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "bot", "content": "a"}]}, ["role 'bot'"]),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}, ["no string 'content'"]),
    ({"prompt": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "completion": []},
     ["completion has no assistant turn"]),
    ({"text": "just text"}, ["neither 'messages'", "keys: text"]),
])
def test_bad_records_fail_with_one_line(record, needles):
    _one_line_error(lambda: to_conversation(record, "f.jsonl:7"), "f.jsonl:7", *needles)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n\n{"prompt": "a", "completion": \n')
    _one_line_error(lambda: load_conversations(path), f"{path}:3", "not valid JSON")
    path.write_text('["a list"]\n')
    _one_line_error(lambda: load_conversations(path), f"{path}:1", "JSON object")


# ---------------------------------------------------------------- rendering and masks


def test_qwen3_renders_and_tokenizes_like_transformers(template, hf_tokenizer, conversations, docs):
    assert not any(x in template.source for x in ("{% generation", "{%- generation"))
    for conv, doc in zip(conversations, docs):
        reference = hf_tokenizer.apply_chat_template(conv.messages, tokenize=True, return_dict=True)["input_ids"]
        assert doc.input_ids == list(reference), conv.where
    messages = [{"role": "system", "content": "Be kind."}, *conversations[0].messages,
                {"role": "user", "content": conversations[1].messages[0]["content"]}]
    for kwargs in ({}, {"enable_thinking": False}):
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert template.render(messages, add_generation_prompt=True, **kwargs) == expected


def test_a_runs_template_kwargs_reach_sft_preference_and_rl_prompts(chat_dir, hf_tokenizer, conversations, dolly):
    """`sft.chat_template_kwargs` (Qwen3's enable_thinking = false): the run's template (`run_template`, which SFT,
    preference and RL build theirs with) renders every conversation as transformers' `apply_chat_template(...,
    enable_thinking=False)`: an SFT conversation's ids (its empty think block now in the prompt, untrained), a
    preference pair's prompt and an RL prompt's ids; without the kwargs the think block is trained and the
    prompts differ."""
    from shardlm.config import SFTConfig
    from shardlm.preference.pairs import PreferencePair, tokenize_pair
    from shardlm.rl.prompts import to_prompt
    from shardlm.sft.dataset import run_template

    template, plain = (run_template(SFTConfig(tokenizer=str(chat_dir / "qwen3"), chat_template_kwargs=kwargs), "")
                       for kwargs in ({"enable_thinking": False}, {}))
    messages = conversations[0].messages
    hf = {"tokenize": True, "return_dict": True, "enable_thinking": False}
    doc, without = (tokenize_conversations(t, conversations[:1])[0] for t in (template, plain))
    # (a last turn renders its empty think block either way; without the kwargs it is trained)
    assert doc.input_ids == list(hf_tokenizer.apply_chat_template(messages, **hf)["input_ids"]) == without.input_ids
    reply = unicodedata.normalize("NFC", dolly[0]["response"].lstrip("\n") + END)
    for tokens, trained in ((doc, reply), (without, unicodedata.normalize("NFC", THINK) + reply)):
        (start, end), = _runs(tokens.loss_mask)
        assert _decode(hf_tokenizer, tokens.input_ids[start:end]) == trained
    prompt = list(hf_tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True, **hf)["input_ids"])
    assert to_prompt(template, {"prompt": messages[:1]}, "rl").ids == prompt
    assert to_prompt(plain, {"prompt": messages[:1]}, "rl").ids != prompt
    rejected = [{"role": "assistant", "content": "No."}]
    pair = tokenize_pair(template, PreferencePair(messages[:1], [messages[1]], rejected, "pair"), END)
    assert pair.prompt == prompt


def test_qwen3_mask_is_found_by_prefix_and_covers_the_reply_and_end_token(template, hf_tokenizer, dolly, docs):
    """Qwen3's template has no generation tags, so the mask comes from prefix comparison. For a single turn the
    template puts an empty think block before the reply; it is part of the trained reply (the model learns to
    answer in non-thinking mode). The newline after <|im_end|> is not trained."""
    assert template.mask_method == "prefix" and template.end_of_turn == END
    for record, doc in zip(dolly, docs):
        (start, end), = _runs(doc.loss_mask)
        expected = unicodedata.normalize("NFC", THINK + record["response"].lstrip("\n") + END)
        assert _decode(hf_tokenizer, doc.input_ids[start:end]) == expected, doc.where
        assert _decode(hf_tokenizer, doc.input_ids[end:]) == "\n"


def test_multi_turn_mask_and_what_qwen3_does_with_earlier_reasoning(template, hf_tokenizer, dolly):
    """Qwen3 drops the reasoning of assistant turns before the last user turn (both `reasoning_content` and an
    inline <think> block) and renders them without a think block; the last turn gets its think block."""
    a, b, c = dolly[1], dolly[2], dolly[3]
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": a["instruction"]},
        {"role": "assistant", "content": a["response"], "reasoning_content": "FIRST-REASONING"},
        {"role": "user", "content": b["instruction"]},
        {"role": "assistant", "content": "<think>\nSECOND-REASONING\n</think>\n\n" + b["response"]},
        {"role": "user", "content": c["instruction"]},
        {"role": "assistant", "content": c["response"], "reasoning_content": "LAST-REASONING"},
    ]
    doc = template.tokenize(Conversation(messages, "multi"))
    reference = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert doc.input_ids == list(reference)
    text = _decode(hf_tokenizer, doc.input_ids)
    assert "FIRST-REASONING" not in text and "SECOND-REASONING" not in text and "LAST-REASONING" in text
    pieces = [_decode(hf_tokenizer, doc.input_ids[s:e]) for s, e in _runs(doc.loss_mask)]
    assert pieces == [a["response"] + END, b["response"] + END,
                      "<think>\nLAST-REASONING\n</think>\n\n" + c["response"] + END]
    # enable_thinking=False puts the empty think block into the prompt, so it is not trained; in a multi-turn
    # conversation that prompt is not a prefix of the earlier turns (rendered without it): a one-line error
    single = template.tokenize([*messages[:2], {"role": "assistant", "content": a["response"]}], enable_thinking=False)
    assert [_decode(hf_tokenizer, single.input_ids[s:e]) for s, e in _runs(single.loss_mask)] == [a["response"] + END]
    _one_line_error(lambda: template.tokenize(messages, enable_thinking=False), "differently", "generation")
    # as prompt/completion only the completion is trained
    completion = template.tokenize(Conversation(messages, "pc", train_from=6))
    assert completion.input_ids == doc.input_ids
    assert [_decode(hf_tokenizer, completion.input_ids[s:e]) for s, e in _runs(completion.loss_mask)] == pieces[2:]


def test_a_token_across_the_prompt_boundary_is_trained(template, hf_tokenizer):
    """A reply that starts with a newline (kept by Qwen3 in turns before the last user turn) merges with the
    prompt's last newline into one token: the ids of the prompt alone are then no prefix of the conversation's,
    but its text is, and the merged token is trained."""
    messages = [{"role": "user", "content": "Name a fish."}, {"role": "assistant", "content": "\nTope"},
                {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Cod"}]
    doc = template.tokenize(messages)
    reference = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert doc.input_ids == list(reference)
    prompt = hf_tokenizer.apply_chat_template(messages[:1], tokenize=True, return_dict=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"])
    assert doc.input_ids[:len(prompt)] != prompt  # token prefix comparison would fail here
    (s1, e1), (s2, e2) = _runs(doc.loss_mask)
    assert s1 == len(prompt) - 1 and _decode(hf_tokenizer, doc.input_ids[s1:e1]) == "\n\nTope" + END
    assert _decode(hf_tokenizer, doc.input_ids[s2:e2]) == THINK + "Cod" + END


def test_template_from_chat_template_jinja(chat_dir, tmp_path, hf_tokenizer):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").symlink_to(chat_dir / "qwen3" / "tokenizer.json")
    config = json.loads((chat_dir / "qwen3" / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(TAGGED)
    loaded = ChatTemplate.from_dir(folder)
    assert loaded.source == TAGGED and loaded.mask_method == "generation-tags"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert loaded.render(messages) == hf_tokenizer.apply_chat_template(messages, chat_template=TAGGED, tokenize=False)


def test_generation_tags_mask_matches_transformers(chat_dir, hf_tokenizer, conversations):
    tagged = ChatTemplate.from_dir(chat_dir / "qwen3", template=TAGGED)
    assert tagged.mask_method == "generation-tags"
    chats = [conversations[i].messages + conversations[i + 1].messages for i in range(0, 40, 2)]
    for messages in chats:
        doc = tagged.tokenize(messages)
        reference = hf_tokenizer.apply_chat_template(messages, chat_template=TAGGED, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True)
        assert doc.input_ids == list(reference["input_ids"])
        assert doc.loss_mask == list(reference["assistant_masks"])
        assert [_decode(hf_tokenizer, doc.input_ids[s:e]) for s, e in _runs(doc.loss_mask)] == [
            unicodedata.normalize("NFC", messages[1]["content"]) + END,
            unicodedata.normalize("NFC", messages[3]["content"]) + END]
    pc = tagged.tokenize(Conversation(chats[0], "pc", train_from=3))
    assert len(_runs(pc.loss_mask)) == 1 and _runs(pc.loss_mask)[0] == _runs(tagged.tokenize(chats[0]).loss_mask)[1]


def test_template_errors_are_one_line(chat_dir, template, tmp_path):
    qwen = chat_dir / "qwen3"
    messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]

    def with_source(source):
        return ChatTemplate(template.tokenizer, source, template.special_tokens)

    _one_line_error(lambda: with_source("{{ ''.__class__.__mro__ }}").render(messages), "failed to render", "unsafe")
    _one_line_error(lambda: with_source("{{ messages.pop() }}").render(messages), "failed to render")
    _one_line_error(lambda: with_source("{% if %}"), "does not compile")
    raising = with_source("{{ raise_exception('only user turns, please') }}")
    _one_line_error(lambda: raising.render(messages), "only user turns, please")
    # not prefix-stable: the prompt alone renders differently from the same turns in the full conversation
    unstable = with_source("{% for m in messages %}{{ m.content }}{% if loop.last %}"
                                     "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}!{% endif %}")
    _one_line_error(lambda: unstable.tokenize(messages), "differently", "generation")
    no_template = tmp_path / "tok"
    no_template.mkdir()
    (no_template / "tokenizer.json").symlink_to(qwen / "tokenizer.json")
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (no_template / "tokenizer_config.json").write_text(json.dumps(config))
    _one_line_error(lambda: ChatTemplate.from_dir(no_template), "no chat template")
    # a template that renders no assistant token: nothing to train on
    silent = with_source("{% for m in messages %}{% if m.role == 'user' %}{% generation %}"
                                   "{% endgeneration %}{{ m.content }}{% endif %}{% endfor %}")
    _one_line_error(lambda: silent.tokenize(Conversation(messages, "f.jsonl:2")), "f.jsonl:2", "no assistant token")


# ---------------------------------------------------------------- packing


def test_shift_labels_by_hand():
    assert shift_labels([10, 11, 12, 13, 14], [0, 0, 1, 1, 0]) == [-100, 12, 13, -100, -100]
    assert shift_labels([7], [1]) == [-100]


def test_bfd_plan_by_hand():
    # lengths 4, 2, 3, 1 in rows of 4: 4 alone; 3 opens a row; 2 opens a row; 1 fits best beside 3 (room 1)
    assert plan_bins([4, 2, 3, 1], 4, "bfd") == [[0], [2, 3], [1]]
    assert plan_bins([2, 2, 3, 1, 2], 4, "bfd") == [[2, 3], [0, 1], [4]]
    assert plan_bins([4, 2, 3, 1], 4, "greedy") == [[0], [1], [2, 3]]
    assert plan_bins([4, 2, 3, 1], 4, "pad") == [[0], [1], [2], [3]]


@pytest.mark.parametrize("strategy", ["bfd", "greedy", "pad"])
def test_packed_rows_keep_each_document_intact(docs, strategy):
    seq_length, pad_id = 512, 151643
    packed = PackedRows(docs, seq_length, strategy, pad_id=pad_id, seed=7)
    rows = packed.rows(0)
    seen = []
    for row in rows:
        offsets = row.cu_seqlens.tolist()
        assert row.cu_seqlens.dtype == torch.int32 and offsets[0] == 0 and offsets[-1] == seq_length
        assert row.input_ids.shape == row.labels.shape == row.position_ids.shape == (seq_length,)
        assert row.labels.dtype == torch.long
        for j, (a, e) in enumerate(zip(offsets, offsets[1:])):
            assert row.position_ids[a:e].tolist() == list(range(e - a))
            if j == len(row.documents):  # the padding tail
                assert set(row.input_ids[a:e].tolist()) == {pad_id} and set(row.labels[a:e].tolist()) == {-100}
                continue
            doc = docs[row.documents[j]]
            ids, mask = doc.input_ids[:seq_length], doc.loss_mask[:seq_length]
            assert row.input_ids[a:e].tolist() == ids
            expected = [ids[t + 1] if mask[t + 1] else -100 for t in range(len(ids) - 1)] + [-100]
            assert row.labels[a:e].tolist() == expected
        seen += row.documents
    too_long = [i for i, d in enumerate(docs) if len(d.input_ids) > seq_length]
    lost = [i for i in too_long if not any(docs[i].loss_mask[1:seq_length])]
    assert sorted(seen) == [i for i in range(len(docs)) if i not in lost]
    stats = packed.stats
    assert (stats.rows, stats.dropped, stats.truncated) == (len(rows), len(lost), len(too_long) - len(lost))
    real = sum(min(len(d.input_ids), seq_length) for i, d in enumerate(docs) if i not in lost)
    assert stats.efficiency == pytest.approx(real / (len(rows) * seq_length))
    assert stats.targets == sum(int((r.labels != -100).sum()) for r in rows)
    if strategy == "pad":
        assert len(rows) == len(seen)


def test_bfd_is_denser_than_greedy_and_drop_counts(docs):
    bfd = PackedRows(docs, 512, "bfd", seed=0).stats
    greedy = PackedRows(docs, 512, "greedy", seed=0).stats
    assert bfd.rows < greedy.rows and bfd.efficiency > 0.95 > greedy.efficiency
    dropped = PackedRows(docs, 512, "bfd", overflow="drop", seed=0).stats
    assert dropped.dropped == sum(len(d.input_ids) > 512 for d in docs) and dropped.truncated == 0
    assert "rows" in bfd.summary() and "dropped" in bfd.summary()


def test_packing_order_is_seeded_and_resumable(docs):
    subset = docs[:60]
    first = PackedRows(subset, 256, "bfd", seed=1)
    again = PackedRows(subset, 256, "bfd", seed=1)
    other = PackedRows(subset, 256, "bfd", seed=2)
    assert first.plan(0) == again.plan(0) and first.plan(0) != other.plan(0) and first.plan(0) != first.plan(1)
    per_epoch = len(first.plan(0))
    stream = iter(first)
    seen = [next(stream) for _ in range(per_epoch + 3)]
    assert first.state_dict() == {"epoch": 1, "index": 3}
    assert [r.documents for r in seen[:per_epoch]] == first.plan(0)
    state = first.state_dict()
    expected = [next(stream).documents for _ in range(per_epoch)]  # runs into epoch 2
    resumed = PackedRows(subset, 256, "bfd", seed=1)
    resumed.load_state_dict(state)
    got = iter(resumed)
    assert [next(got).documents for _ in range(per_epoch)] == expected
    in_order = PackedRows(subset, 4096, "greedy", seed=None)
    assert [i for b in in_order.plan(0) for i in b] == list(range(60)) == [i for b in in_order.plan(3) for i in b]


def test_collate_and_empty_batch_is_an_error(docs):
    rows = PackedRows(docs[:20], 256, "bfd", seed=0).rows()
    batch = collate(rows[:2])
    assert batch["input_ids"].shape == batch["labels"].shape == batch["position_ids"].shape == (2, 256)
    assert len(batch["cu_seqlens"]) == 2 and check_targets(batch["labels"]) > 0
    _one_line_error(lambda: check_targets(torch.full((2, 8), IGNORE_INDEX), "micro-batch 3"), "micro-batch 3",
                    "no assistant token")
    _one_line_error(lambda: PackedRows([TokenizedConversation([1, 2, 3], [0, 0, 1])], 2), "no conversation")
    _one_line_error(lambda: PackedRows(docs[:2], 64, "best"), "strategy 'best'")


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_document_attention_matches_dense_block_causal(kv_heads):
    torch.manual_seed(0)
    batch, heads, length, dim = 3, 4, 48, 8
    q = torch.randn(batch, heads, length, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    cu = [torch.tensor(x, dtype=torch.int32) for x in ([0, 5, 20, 48], [0, 48], [0, 5, 20, 48])]
    out = document_causal_attention(q, k, v, cu)
    ref = reference_document_attention(q, k, v, cu)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # one document's output depends on its own keys only, and a row with one document is plain causal attention
    k2 = k.detach().clone()
    k2[:, :, :5] += torch.randn_like(k2[:, :, :5])
    changed = document_causal_attention(q, k2, v, cu)
    torch.testing.assert_close(changed[::2, :, 5:], out[::2, :, 5:])  # rows 0 and 2: documents from 5 on
    assert not torch.allclose(changed[0, :, :5], out[0, :, :5]) and not torch.allclose(changed[1], out[1])
    rep = heads // kv_heads
    plain = torch.nn.functional.scaled_dot_product_attention(
        q[1:2], k[1:2].repeat_interleave(rep, 1), v[1:2].repeat_interleave(rep, 1), is_causal=True)
    torch.testing.assert_close(out[1:2], plain, atol=1e-6, rtol=1e-6)
    shared = document_causal_attention(q, k, v, [cu[0]] * batch)
    torch.testing.assert_close(shared[0], out[0])


def test_block_causal_mask_by_hand():
    mask = block_causal_mask([[0, 2, 3]], 3)[0, 0]
    assert mask.tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    with pytest.raises(ValueError):
        document_causal_attention(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2),
                                  [[0, 2]])
