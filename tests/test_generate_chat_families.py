"""`shardlm generate --chat` and SFT's loss mask with each family's chat template, against transformers.

The shared data holds Qwen3's tokenizer only (tests/test_generate_chat.py), so each case here builds a small
byte-level BPE tokenizer in the test (trained on a few sentences with the `tokenizers` library) with the family's
special tokens, and one of these templates:

- Gemma 4 and Nemotron 3: the models' own templates as TRL ships them (`trl/chat_templates/gemma4.jinja`,
  `nemotron_3_nano.jinja`, copies of the published ones, from the installed package, no network);
- Mistral Small 4, OLMo 3, MiniMax-M2: short templates written here in each family's published turn format (Mistral's
  `[INST] ... [/INST] ... </s>`, OLMo's `<|im_start|>role ... <|im_end|>`, MiniMax's `]~b]role ... [e~[`).

Each case saves a tiny random model of its family (or a Qwen3 where the family's own is tested elsewhere) with that
tokenizer, with the output rows of the stop tokens set so that only the end-of-turn token ends the reply, after a few
tokens (`ends_a_reply`). What must hold:
- the rendered text and its ids equal `apply_chat_template(..., add_generation_prompt=True)`;
- `shardlm generate --chat` reads the directory in place and answers token for token as transformers' greedy
  `generate` with the directory's generation_config.json eos ids, the end-of-turn token excluded. Gemma 4 ends a
  turn with `<turn|>` while its eos_token is `<eos>`: only generation_config.json's list stops it;
- SFT's prefix mask trains exactly each assistant reply and its end-of-turn token.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardlm.cli import main
from shardlm.errors import UserError
from shardlm.sft.template import ChatTemplate

NEW_TOKENS = 10
CONVERSATION = [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}]
TRAINED = [*CONVERSATION, {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "And grass?"},
           {"role": "assistant", "content": "Green."}]

TEMPLATES = {
    "mistral4": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}"
                "[/SYSTEM_PROMPT]{% elif m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]{% else %}"
                "{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
    "olmo3": "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
    "minimax_m2": "{% for m in messages %}{% if m['role'] == 'system' %}]~!b[]~b]system\n{{ m['content'] }}[e~[\n"
                  "{% else %}]~b]{{ 'ai' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}[e~[\n"
                  "{% endif %}{% endfor %}{% if add_generation_prompt %}]~b]ai\n{% endif %}",
}
FAMILIES = {  # family: (special tokens, bos, eos_token, generation_config eos tokens, end of turn)
    "gemma4": (["<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>"], "<bos>", "<eos>", ["<eos>", "<turn|>"], "<turn|>"),
    "nemotron_3": (["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"], "<s>", "<|im_end|>",
                   ["<|im_end|>", "</s>"], "<|im_end|>"),
    "mistral4": (["<s>", "</s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], "<s>", "</s>", ["</s>"],
                 "</s>"),
    "olmo3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", ["<|im_end|>", "<|endoftext|>"],
              "<|im_end|>"),
    "minimax_m2": (["]~!b[", "]~b]", "[e~["], "]~!b[", "[e~[", ["[e~["], "[e~["),
}
TRL_TEMPLATES = {"gemma4": "gemma4.jinja", "nemotron_3": "nemotron_3_nano.jinja"}
TRAINING_TEMPLATES = {"nemotron_3": "nemotron_3_nano_training.jinja"}


def template_source(family: str, training: bool = False) -> str:
    """The family's template: TRL's copy of the published one (or of its training variant), else the one above."""
    if family in TRL_TEMPLATES:
        import trl

        name = (TRAINING_TEMPLATES if training else TRL_TEMPLATES)[family]
        return (Path(trl.__file__).parent / "chat_templates" / name).read_text(encoding="utf-8")
    return TEMPLATES[family]


def write_tokenizer(out: Path, family: str) -> None:
    """A byte-level BPE over a few sentences with the family's special tokens first, its tokenizer_config.json (the
    template, bos and eos) and generation_config.json (the eos ids transformers' `generate` stops at)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials, bos, eos, stops, _ = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = [m["content"] for m in TRAINED] * 4 + ["system user assistant model ai answer", "the quick brown fox"]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template_source(family),
              "eos_token": eos, "bos_token": bos, "pad_token": specials[2] if family == "gemma4" else eos}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    ids = [tokenizer.token_to_id(t) for t in stops]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))


def family_model(family: str, vocab: int):
    """A tiny random model of the family with an untied output layer (Qwen3 for the templates whose family has its
    own tests of decoding)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "olmo3":
        config = tf.Olmo3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                sliding_window=8, pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return tf.Olmo3ForCausalLM(config)
    if family == "minimax_m2":
        config = tf.MiniMaxM2Config(vocab_size=vocab, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                    num_experts_per_tok=2, max_position_embeddings=128, rope_theta=500.0,
                                    pad_token_id=None, bos_token_id=None, eos_token_id=None)
        return tf.MiniMaxM2ForCausalLM(config)
    if family == "mistral4":
        config = tf.Mistral4Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                   n_routed_experts=4, n_shared_experts=1, n_group=1, topk_group=1,
                                   num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
                                   v_head_dim=12, qk_nope_head_dim=16, first_k_dense_replace=1,
                                   max_position_embeddings=128, tie_word_embeddings=False)
        return tf.Mistral4ForCausalLM(config)
    config = tf.Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                            tie_word_embeddings=False)
    return tf.Qwen3ForCausalLM(config)


def greedy(model, ids: list[int], eos) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


def ends_a_reply(model, ids: list[int], end: int) -> list[int]:
    """Set the output row of `end` to 1.3 times the row of the token greedy decoding picks at a step from the third
    on where that token is new and its logit positive, so that `end` wins there (or a step or two before); return
    the greedy reply, which then ends with `end` after 1 or more tokens."""
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    chosen = out.sequences[0, len(ids):].tolist()
    for step in range(2, NEW_TOKENS - 1):
        if out.logits[step][0, chosen[step]] > 0 and chosen[step] not in chosen[:step]:
            model.lm_head.weight[end] = 1.3 * model.lm_head.weight[chosen[step]]
            reply = greedy(model, ids, end)
            if reply[-1] == end and len(reply) >= 2:
                return reply
    raise AssertionError("no step makes the end-of-turn token end the reply")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """The family's directory (tokenizer and model), transformers' prompt ids and greedy reply."""
    from transformers import AutoTokenizer

    name = request.param
    hf = tmp_path_factory.mktemp(name) / "hf"
    write_tokenizer(hf, name)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    end = tokenizer.convert_tokens_to_ids(FAMILIES[name][4])
    stops = json.loads((hf / "generation_config.json").read_text())["eos_token_id"]
    model = family_model(name, len(tokenizer)).eval()
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(30.0)  # tokens decide the continuation (no single token repeated)
        model.lm_head.weight.mul_(20.0)  # peaked choices: no near ties between fp32 implementations
        model.lm_head.weight[stops] = 0.0  # logit 0: below the best of 300 random ones, no stop yet
        reply = ends_a_reply(model, ids, end)
    model.save_pretrained(hf)
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))  # save_pretrained rewrote it
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    return {"name": name, "hf": hf, "tokenizer": tokenizer, "ids": ids, "text": text, "end": end,
            "reply": reply, "stops": stops, "class": type(model)}


def test_the_template_renders_as_transformers(family):
    template = ChatTemplate.from_dir(family["hf"])
    text = template.render(CONVERSATION, add_generation_prompt=True)
    assert text == family["text"]
    assert template.encode(text) == family["ids"]


def test_chat_reply_equals_transformers_greedy_and_stops_at_end_of_turn(family, capsys):
    reply = greedy_with_stops(family)
    assert reply[-1] == family["end"] and 2 <= len(reply) < NEW_TOKENS, reply
    code = main(["generate", "--checkpoint", str(family["hf"]), "--chat", "--messages", str(messages(family)),
                 "--greedy", "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--json"])
    assert code == 0
    (ours,) = json.loads(capsys.readouterr().out)["generations"]
    assert ours["prompt_tokens"] == family["ids"]
    assert ours["tokens"] == reply[:-1] and ours["finish_reason"] == "end_of_turn", (ours, reply)


def greedy_with_stops(family) -> list[int]:
    """transformers' greedy reply from the saved directory, stopped at generation_config.json's eos ids."""
    model = family["class"].from_pretrained(family["hf"]).eval()  # Mistral 4 is not in AutoModelForCausalLM's map
    assert model.generation_config.eos_token_id == family["stops"]
    return greedy(model, family["ids"], family["stops"])


def messages(family) -> Path:
    path = family["hf"].parent / "messages.json"
    path.write_text(json.dumps(CONVERSATION))
    return path


def test_the_sft_mask_trains_each_reply_and_its_end_of_turn(family):
    """Nemotron 3's own template renders a past reply differently once the conversation goes on (its reasoning
    dropped): the prefix mask refuses it in one line, and TRL's training variant of it (generation tags) trains
    the replies (`sft.template`), the mask transformers' `return_assistant_tokens_mask` gives."""
    template = ChatTemplate.from_dir(family["hf"])
    if family["name"] in TRAINING_TEMPLATES:
        with pytest.raises(UserError, match="generation") as error:
            template.tokenize(TRAINED)
        assert "\n" not in str(error.value)
        source = template_source(family["name"], training=True)
        template = ChatTemplate.from_dir(family["hf"], template=source)
        marked = family["tokenizer"].apply_chat_template(TRAINED, chat_template=source, tokenize=True, return_dict=True,
                                                         return_assistant_tokens_mask=True)
        assert template.tokenize(TRAINED).loss_mask == marked["assistant_masks"]
    tokenized = template.tokenize(TRAINED)
    trained = [i for i, m in zip(tokenized.input_ids, tokenized.loss_mask) if m]
    end = FAMILIES[family["name"]][4]
    text = family["tokenizer"].decode(trained, skip_special_tokens=False)
    reply = "<think></think>{}" if family["name"] == "nemotron_3" else "{}"  # its replies open an empty reasoning
    assert text.replace("\n", "") == reply.format(f"Blue.{end}") + reply.format(f"Green.{end}"), text


@pytest.mark.parametrize("content,message", [("{", "is not a JSON object"), ('{"eos_token_id": ["</s>"]}',
                                                                              "is not a token id")])
def test_a_bad_generation_config_is_a_one_line_error(tmp_path, content, message):
    write_tokenizer(tmp_path / "hf", "olmo3")
    (tmp_path / "hf" / "generation_config.json").write_text(content)
    with pytest.raises(UserError, match=message) as error:
        ChatTemplate.from_dir(tmp_path / "hf")
    assert "\n" not in str(error.value)
