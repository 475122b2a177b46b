"""`shardlm generate --chat / --messages`: a conversation rendered with the chat template, answered greedily,
stopped at end-of-turn, token for token as transformers' `generate`.

A random one-layer `Qwen3ForCausalLM` with the real 151936-row vocabulary is saved beside the shared Qwen3
tokenizer files (tokenizer.json, tokenizer_config.json with the chat template). Its `<|im_end|>` output row
is set to 1.3 times the row of the token greedy decoding picks fifth, so that the reply ends with
end-of-turn after a few tokens. `shardlm generate` reads the HF directory in place and answers one
`--prompt` (a user turn) and one `--messages` file (system + user) in one batch, with
`--template-var enable_thinking=false`: the prompt ids equal `apply_chat_template(...,
add_generation_prompt=True, enable_thinking=False)` and the reply equals transformers' greedy `generate`
with `<|im_end|>` as its eos token, that token excluded.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from shardlm.cli import main

NEW_TOKENS = 12
USER = "Name a colour."
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2 + 2?"}]


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, enable_thinking=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def greedy(model, ids: list[int], eos: int | None) -> list[int]:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                             do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, data_dir):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("chat")
    hf = root / "hf"
    hf.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, hf / name)
    tokenizer = AutoTokenizer.from_pretrained(hf)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # peaked choices: no near ties between fp32 implementations
        fifth = greedy(model, chat_ids(tokenizer, MESSAGES), None)[4]
        model.lm_head.weight[end] = 1.3 * model.lm_head.weight[fifth]
    model.save_pretrained(hf)
    conversations = [[{"role": "user", "content": USER}], MESSAGES]
    prompts = [chat_ids(tokenizer, c) for c in conversations]
    replies = [greedy(model, ids, end) for ids in prompts]
    messages = root / "messages.json"
    messages.write_text(json.dumps(MESSAGES))
    return {"hf": hf, "prompts": prompts, "replies": replies, "end": end, "messages": messages}


def test_chat_reply_equals_transformers_greedy_and_stops_at_end_of_turn(chat_model, capsys):
    replies = chat_model["replies"]
    assert replies[1][-1] == chat_model["end"] and 2 <= len(replies[1]) < NEW_TOKENS, replies
    code = main(["generate", "--checkpoint", str(chat_model["hf"]), "--prompt", USER, "--chat", "--messages",
                 str(chat_model["messages"]), "--template-var", "enable_thinking=false", "--greedy",
                 "--max-new-tokens", str(NEW_TOKENS), "--device", "cpu", "--json"])
    assert code == 0
    generations = json.loads(capsys.readouterr().out)["generations"]
    for ours, prompt, reply in zip(generations, chat_model["prompts"], replies, strict=True):
        assert ours["prompt_tokens"] == prompt
        stopped = reply[-1] == chat_model["end"]
        assert ours["tokens"] == (reply[:-1] if stopped else reply)
        assert ours["finish_reason"] == ("end_of_turn" if stopped else "length")


@pytest.mark.parametrize("content,message", [
    (None, "messages file not found"),
    ("[{]", "is not valid JSON"),
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]', "ends with an assistant turn"),
    ('[{"role": "robot", "content": "hi"}]', "message 0 is not a"),
])
def test_bad_messages_are_one_line_errors(chat_model, tmp_path, capsys, content, message):
    path = tmp_path / "m.json"
    if content is not None:
        path.write_text(content)
    code = main(["generate", "--checkpoint", str(chat_model["hf"]), "--messages", str(path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
