"""lm-evaluation-harness adapter: a random GPT-2 converted with `shardlm convert --from-hf` scores,
through the `shardlm` model at TP=1 and TP=2, the same per-request log-likelihoods and task metrics
as the Hugging Face model through the harness's own `hf` backend; `generate_until` returns what
`shardlm generate --greedy` returns, cut at the stop string; the LAMBADA accuracy equals
`shardlm eval lambada --strict`. Offline: every file is local and HF_*_OFFLINE is set."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

from shardlm.cli import main  # noqa: E402

SEQ = 128
HIT_EXAMPLES, MISS_EXAMPLES = 4, 4
GEN_TOKENS = 10
TASKS = ["lambada_openai_local", "wikitext_local"]


def _hf_tokenizer(folder):
    """GPT-2's tokenizer from OpenAI's files (transformers 5 names the arguments vocab/merges)."""
    import inspect

    names = inspect.signature(transformers.GPT2TokenizerFast.__init__).parameters
    keys = ("vocab", "merges") if "vocab" in names else ("vocab_file", "merges_file")
    return transformers.GPT2TokenizerFast(**{keys[0]: str(folder / "encoder.json"),
                                             keys[1]: str(folder / "vocab.bpe")})


def _greedy_word(model, tokenizer, context: str) -> str | None:
    """The word the HF model predicts after `context`, when its top token is a whole ' word'."""
    ids = tokenizer(context)["input_ids"][-SEQ:]
    with torch.no_grad():
        top = int(model(torch.tensor([ids])).logits[0, -1].argmax())
    token = tokenizer.convert_ids_to_tokens(top)
    word = token[1:]
    if token.startswith("Ġ") and word.isalpha() and tokenizer(" " + word)["input_ids"] == [top]:
        return word
    return None


def _lambada_slice(model, tokenizer, source) -> list[str]:
    """LAMBADA passages: HIT_EXAMPLES whose last word is replaced by the model's greedy word, then
    MISS_EXAMPLES unchanged, so the accuracy is neither 0 nor 1."""
    hits, misses = [], []
    for line in source.read_text().splitlines():
        text = json.loads(line)["text"]
        context = " ".join(text.split(" ")[:-1])
        word = _greedy_word(model, tokenizer, context) if len(hits) < HIT_EXAMPLES else None
        if word is not None:
            hits.append(f"{context} {word}")
        elif len(misses) < MISS_EXAMPLES and _greedy_word(model, tokenizer, context) != text.split(" ")[-1]:
            misses.append(text)
        if len(hits) == HIT_EXAMPLES and len(misses) == MISS_EXAMPLES:
            return hits + misses
    raise AssertionError("LAMBADA has too few passages for the probe")


GEN_YAML = """task: gen_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: [{stop}]
  max_gen_toks: {tokens}
  do_sample: false
metric_list:
  - metric: exact_match
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory, data_dir):
    """The HF model and its shardlm conversion, a shared-data folder holding the LAMBADA probe and a
    WikiText slice, a generation task whose stop string cuts greedy output, and the results of the
    `hf` backend, the adapter at TP=1 (in this process) and at TP=2 (`shardlm eval harness`)."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import shardlm.eval.harness  # noqa: F401  (registers "shardlm")
    from shardlm.eval.harness_tasks import render_tasks

    folder = tmp_path_factory.mktemp("harness")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_DATASETS_OFFLINE", "1")
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_CACHE", str(folder / "hf-datasets"))
        env.setenv("SHARDLM_DATA", str(folder / "data"))
        hf_dir = folder / "hf"
        tokenizer = _hf_tokenizer(data_dir / "vocab/gpt2")
        tokenizer.save_pretrained(hf_dir)
        for ours, theirs in (("encoder.json", "vocab.json"), ("vocab.bpe", "merges.txt")):
            (hf_dir / theirs).symlink_to(data_dir / "vocab/gpt2" / ours)  # `convert --from-hf` reads these
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=50257, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3)
        model = transformers.GPT2LMHeadModel(config).eval()
        model.save_pretrained(hf_dir, safe_serialization=True)
        checkpoint = folder / "gpt2.safetensors"
        assert main(["convert", "--from-hf", str(hf_dir), "--output", str(checkpoint)]) == 0

        lambada = folder / "data/lambada/lambada_test.jsonl"
        lambada.parent.mkdir(parents=True)
        texts = _lambada_slice(model, tokenizer, data_dir / "lambada/lambada_test.jsonl")
        lambada.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        wiki = folder / "data/wikitext/wikitext-103/wiki.test.tokens"
        wiki.parent.mkdir(parents=True)
        wiki.write_text("".join((data_dir / "wikitext/wikitext-103/wiki.test.tokens").read_text()
                                .splitlines(keepends=True)[:24]))

        prompts = [" ".join(t.split(" ")[:12]) for t in texts[:3]]
        argv = ["generate", "--checkpoint", str(checkpoint), "--greedy", "--max-new-tokens", str(GEN_TOKENS),
                "--json"] + [a for p in prompts for a in ("--prompt", p)]
        generated = _run_json(argv)["generations"]
        stop = generated[0]["text"][len(generated[0]["text"]) // 2:][:3]  # cuts the first generation
        gen_dir = folder / "gen"
        gen_dir.mkdir()
        (folder / "gen.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": ""}) + "\n" for p in prompts))
        (gen_dir / "gen_local.yaml").write_text(GEN_YAML.format(data=folder / "gen.jsonl", stop=json.dumps(stop),
                                                                tokens=GEN_TOKENS))

        rendered = folder / "rendered"
        render_tasks(folder / "data", rendered)
        manager = TaskManager(include_path=[str(rendered), str(gen_dir)], include_defaults=False)
        common = {"log_samples": True, "bootstrap_iters": 0, "task_manager": manager}
        hf = simple_evaluate(model="hf", model_args={"pretrained": str(hf_dir), "dtype": "float32", "device": "cpu"},
                             tasks=TASKS, batch_size=4, **common)
        tp1 = simple_evaluate(model="shardlm", model_args={"checkpoint": str(checkpoint)},
                              tasks=[*TASKS, "gen_local"], batch_size=4, **common)
        output = folder / "tp2.json"
        assert main(["eval", "harness", "--checkpoint", str(checkpoint), "--tasks", ",".join([*TASKS, "gen_local"]),
                     "--include-path", str(gen_dir), "--tensor-parallel", "2", "--batch-size", "3",
                     "--bootstrap-iters", "0", "--log-samples", "--output", str(output)]) == 0
        tp2 = json.loads(output.read_text())
        lambada_cli = _run_json(["eval", "lambada", "--checkpoint", str(checkpoint), "--data", str(lambada),
                                 "--strict", "--json"])
    return {"hf": hf, "tp1": tp1, "tp2": tp2, "lambada_cli": lambada_cli, "generated": generated,
            "prompts": prompts, "stop": stop, "checkpoint": checkpoint, "texts": texts, "data": folder / "data"}


def _run_json(argv: list[str]) -> dict:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


def _responses(results: dict, task: str) -> dict[int, list]:
    """doc_id -> the model's raw answers to that document's requests."""
    return {s["doc_id"]: [r[0] for r in s["resps"]] for s in results["samples"][task]}


def _assert_same_scores(ours: dict, reference: dict) -> None:
    for task in TASKS:
        mine, theirs = _responses(ours, task), _responses(reference, task)
        assert sorted(mine) == sorted(theirs) and len(mine) > 0
        for doc, answers in theirs.items():
            assert len(mine[doc]) == len(answers), (task, doc, len(mine[doc]), len(answers))
            for got, want in zip(mine[doc], answers):
                if task == "wikitext_local":  # rolling: the summed log-likelihood
                    assert float(got) == pytest.approx(float(want), rel=1e-4)
                else:  # (log-likelihood, greedy)
                    assert float(got[0]) == pytest.approx(float(want[0]), rel=1e-4)
                    assert bool(got[1]) == bool(want[1])
    for task, metrics in (("lambada_openai_local", ("acc,none", "perplexity,none")),
                          ("wikitext_local", ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"))):
        for metric in metrics:
            assert ours["results"][task][metric] == pytest.approx(reference["results"][task][metric], rel=1e-4)


def test_tp1_scores_what_the_hf_backend_scores(world):
    _assert_same_scores(world["tp1"], world["hf"])
    rolling = _responses(world["hf"], "wikitext_local")
    assert len(rolling) == 1 and float(rolling[0][0]) < -1000  # one document over many windows
    assert math.isfinite(world["tp1"]["results"]["wikitext_local"]["word_perplexity,none"])


@pytest.mark.slow
def test_tp2_scores_what_the_hf_backend_scores(world):
    assert world["tp2"]["config"]["tensor_parallel"] == 2
    _assert_same_scores(world["tp2"], world["hf"])


def test_lambada_accuracy_equals_shardlm_eval_lambada(world):
    acc = world["tp1"]["results"]["lambada_openai_local"]["acc,none"]
    assert acc == pytest.approx(HIT_EXAMPLES / (HIT_EXAMPLES + MISS_EXAMPLES))
    cli = world["lambada_cli"]
    assert cli["examples"] == HIT_EXAMPLES + MISS_EXAMPLES
    assert acc == pytest.approx(cli["accuracy"])
    greedy = {doc: answers[0][1] for doc, answers in _responses(world["tp1"], "lambada_openai_local").items()}
    assert [greedy[i] for i in range(len(world["texts"]))] == [True] * HIT_EXAMPLES + [False] * MISS_EXAMPLES


@pytest.mark.parametrize("layout", ["tp1", pytest.param("tp2", marks=pytest.mark.slow)])
def test_generate_until_equals_shardlm_generate_cut_at_the_stop(world, layout):
    samples = sorted(world[layout]["samples"]["gen_local"], key=lambda s: s["doc_id"])
    stop = world["stop"]
    expected = [g["text"].split(stop)[0] for g in world["generated"]]
    assert [s["arguments"]["gen_args_0"]["arg_0"] if isinstance(s["arguments"], dict) else s["arguments"][0][0]
            for s in samples] == world["prompts"]
    assert [s["resps"][0][0] for s in samples] == expected
    assert expected[0] != world["generated"][0]["text"]  # the stop string did cut


def test_bad_input_is_one_line(world, capsys):
    base = ["eval", "harness", "--checkpoint", str(world["checkpoint"])]
    cases = [(["--tasks", "lambada_openai_local", "--nproc-per-node", "2"], "must equal --tensor-parallel"),
             (["--tasks", " , "], "--tasks is empty"),
             (["--tasks", "lambada_openai_local", "--include-path", str(world["data"] / "none")], "is not a folder")]
    for extra, message in cases:
        capsys.readouterr()
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLM_DATA", str(world["data"] / "missing"))
        assert main([*base, "--tasks", "lambada_openai_local"]) == 2
        assert "does not exist" in capsys.readouterr().err
