"""TRL as an external oracle for shardlm's SFT data: same Dolly records, same real Qwen3 tokenizer, one process.

What is compared, and why not more:

- Input ids of `messages` records: TRL's `SFTTrainer` dataset preparation (the original Qwen3 template) and
  shardlm's rendering give the same ids for all 600 records.
- Masks. Qwen3's template has no `{% generation %}` tags, so TRL's `assistant_only_loss=True` does not use
  it: it swaps in its own training template (`trl/chat_templates/qwen3_training.jinja`: tags added, and
  every assistant turn rendered with a think block so the template is prefix-preserving). So:
  * on that training template, shardlm's generation-tag masks equal TRL's `assistant_only_loss` labels
    exactly, for multi-turn conversations;
  * on the original template (shardlm's prefix method), compared with TRL's prompt/completion
    `completion_only_loss` and with single-turn `assistant_only_loss` (whose training template renders a
    single turn with the same ids), the masks agree except for one token per assistant turn: TRL also
    trains the newline the template writes after `<|im_end|>` (its completion runs to the end of the text,
    and the training template's generation block ends after that newline); shardlm trains the reply and
    its end-of-turn token only. The test checks that this newline is the whole difference.
- Packing: `trl.data_utils.pack_dataset(strategy="bfd")` and shardlm's `PackedRows(strategy="bfd",
  seed=None)` give the same rows, documents and order; run through TRL's padding-free collator, the same
  position ids, `cu_seqlens` and labels (TRL's labels are shifted inside the model, shardlm's before, so
  shardlm's `labels[t]` is TRL's `labels[t + 1]`). Where truncation leaves a conversation with no trained
  token, shardlm drops it and TRL packs it anyway (it adds no loss there); the comparison at 512 tokens
  therefore gives TRL the conversations shardlm keeps.
"""

from __future__ import annotations

import json

import pytest
import torch
from trl_oracle import trl_scores_answers_only  # noqa: F401 (TRL scores the labelled positions only)

from shardlm.bench.common import uncached_datasets
from shardlm.sft.packing import PackedRows
from shardlm.sft.records import load_conversations, to_conversation
from shardlm.sft.template import ChatTemplate, tokenize_conversations

from multiproc import import_or_skip

# a missing oracle skips these tests on a developer's machine and fails them under CI (multiproc.import_or_skip)
trl = import_or_skip("trl", reason="trl is not installed (make install installs it with the dev extra)")
datasets = import_or_skip("datasets")
transformers = import_or_skip("transformers")

from trl.data_utils import pack_dataset  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

NEWLINE = 198  # "\n" in the Qwen3 vocabulary


@pytest.fixture(scope="module")
def qwen_dir(data_dir):
    return data_dir / "chat" / "qwen3"


@pytest.fixture(scope="module")
def records(data_dir):
    return [json.loads(line) for line in (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def template(qwen_dir):
    return ChatTemplate.from_dir(qwen_dir)


@pytest.fixture(scope="module")
def conversations(data_dir):
    return load_conversations(data_dir / "chat" / "dolly-15k-first600.jsonl")


@pytest.fixture(scope="module")
def docs(template, conversations):
    return tokenize_conversations(template, conversations)


@pytest.fixture(scope="module")
def trl_prepare(qwen_dir, tmp_path_factory):
    """Run TRL's SFTTrainer dataset preparation on a dataset; returns the prepared dataset and the trainer."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    config = transformers.Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    model = transformers.Qwen3ForCausalLM(config)
    out = tmp_path_factory.mktemp("trl")

    def prepare(rows: dict, **options):
        args = trl.SFTConfig(output_dir=str(out), report_to="none", use_cpu=True, max_length=None, **options)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(rows),
                                 processing_class=tokenizer)
        prepared = trainer.train_dataset
        return [dict(zip(prepared.column_names, values)) for values in zip(*prepared.to_dict().values())], trainer

    with uncached_datasets():  # map would otherwise hash the 11 MB tokenizer for every call
        yield prepare


def _trained(labels):
    return [int(x != -100) for x in labels]


def _with_newline_after_each_run(doc):
    """shardlm's mask plus the token after each trained run, which must be the template's newline."""
    mask = list(doc.loss_mask)
    for t in range(len(mask) - 1):
        if doc.loss_mask[t] and not doc.loss_mask[t + 1]:
            assert doc.input_ids[t + 1] == NEWLINE
            mask[t + 1] = 1
    assert not doc.loss_mask[-1]
    return mask


def test_messages_input_ids_match_trl(trl_prepare, conversations, docs):
    prepared, _ = trl_prepare({"messages": [c.messages for c in conversations]})
    assert len(prepared) == len(docs)
    for row, doc in zip(prepared, docs):
        assert row["input_ids"] == doc.input_ids, doc.where


def test_prompt_completion_mask_matches_trl_but_for_the_newline(trl_prepare, template, conversations, docs):
    prompts = [c.messages[:1] for c in conversations]
    completions = [c.messages[1:] for c in conversations]
    prepared, trainer = trl_prepare({"prompt": prompts, "completion": completions})
    assert trainer.completion_only_loss
    for row, prompt, completion, doc in zip(prepared, prompts, completions, docs):
        ours = template.tokenize(to_conversation({"prompt": prompt, "completion": completion}, doc.where))
        assert row["input_ids"] == ours.input_ids == doc.input_ids
        assert ours.loss_mask == doc.loss_mask
        assert _trained(row["labels"]) == _with_newline_after_each_run(ours), doc.where


def test_assistant_only_loss_matches_on_trls_training_template(trl_prepare, qwen_dir, conversations, docs):
    pairs = [conversations[i].messages + conversations[i + 1].messages for i in range(0, 200, 2)]
    prepared, trainer = trl_prepare({"messages": pairs}, assistant_only_loss=True)
    assert trainer.chat_template == trl.chat_template_utils.qwen3_training_chat_template
    tagged = ChatTemplate.from_dir(qwen_dir, template=trainer.chat_template)
    assert tagged.mask_method == "generation-tags"
    for row, messages in zip(prepared, pairs):
        ours = tagged.tokenize(messages)
        assert row["input_ids"] == ours.input_ids
        assert _trained(row["labels"]) == ours.loss_mask
        assert sum(ours.loss_mask) > 0
    # a single turn renders the same ids on both templates; the masks differ by the newline only
    single, _ = trl_prepare({"messages": [c.messages for c in conversations]}, assistant_only_loss=True)
    for row, doc in zip(single, docs):
        assert row["input_ids"] == doc.input_ids
        assert _trained(row["labels"]) == _with_newline_after_each_run(doc), doc.where


@pytest.mark.parametrize("seq_length", [2048, 512])
def test_bfd_packing_matches_trl(docs, seq_length):
    pad_id = 151643
    ours = PackedRows(docs, seq_length, "bfd", pad_id=pad_id, seed=None)
    kept = [i for i, d in enumerate(docs) if any(d.loss_mask[1:seq_length])]
    assert (len(kept) == len(docs)) == (seq_length == 2048)
    unshifted = {"input_ids": [docs[i].input_ids for i in kept],
                 "labels": [[x if m else -100 for x, m in zip(docs[i].input_ids, docs[i].loss_mask)] for i in kept],
                 "document": [[i] * len(docs[i].input_ids) for i in kept]}  # packed along, to name each document
    theirs = pack_dataset(datasets.Dataset.from_dict(unshifted), seq_length, strategy="bfd").to_list()
    rows = ours.rows(0)
    assert len(rows) == len(theirs)
    collator = DataCollatorForLanguageModeling(pad_token_id=pad_id, padding_free=True)
    for row, packed in zip(rows, theirs):
        n = row.num_tokens
        starts = [0, *torch.tensor(packed["seq_lengths"]).cumsum(0).tolist()[:-1]]
        assert [packed["document"][a] for a in starts] == row.documents
        assert row.input_ids[:n].tolist() == packed["input_ids"]
        lengths = row.cu_seqlens[1:len(row.documents) + 1].diff(prepend=torch.tensor([0]))
        assert lengths.tolist() == packed["seq_lengths"]
        batch = collator([packed])
        assert row.position_ids[:n].tolist() == batch["position_ids"][0].tolist()
        assert row.cu_seqlens[:len(row.documents) + 1].tolist() == batch["cu_seq_lens_q"].tolist()
        assert row.labels[:n - 1].tolist() == batch["labels"][0, 1:].tolist()
        assert row.labels[n - 1] == -100 and set(row.labels[n:].tolist()) <= {-100}

