"""Runs start from MoE expert adapters, peft's and shardlm's, at one process, EP=2 and TP=2.

The base: a random two-layer Qwen3-MoE from transformers (4 experts, top-2, every layer MoE, norm weights spread,
sharp routers), as in `test_lora_peft`. Adapters on q/k/v/o and on every expert (peft's `target_parameters` on
transformers' fused gate_up_proj and down_proj), every factor non-zero, written two ways:
- by peft: `get_peft_model` with r=4, lora_alpha=12, rsLoRA, factors drawn at random, `save_pretrained`;
- by shardlm: a run with `lora.targets = ["q", "k", "v", "o", "experts"]` (r=4, alpha=8), B drawn at random and
  one step trained, then `shardlm convert --to-peft`;
each in both orders of `target_parameters`: peft writes that list through a set, so a file holds either order
(by the hash seed), and peft loads both alike (checked here: bitwise the same logits).

Checks (fp32):
- a run from each of the four adapters, [lora] left at its defaults (`checkpoint.init_adapter` sets it): its first
  loss equals peft's loss with that adapter within 1e-5, at one process, EP=2 (DP=2) and TP=2 with SP; at one
  process its logits equal peft's within 1e-5. The adapters count: peft's loss without them, or without the
  experts' alone, is more than 10 times that off (measured: 2.9e-4 for peft's adapter without its experts'; a
  loss near log(96) moves little), its logits more than 1e-2. The adapters the runs loaded, gathered at EP=2 and
  TP=2, are bitwise one process's, and both orders load bitwise the same parameters everywhere (`read_peft` too;
  suffix names as "experts.down_proj", which peft matches, as well). Lists naming one of the two tensors, or
  another, are one line.
- [lora] from configs/sft-lora-qwen3.toml (rank 16, alpha 32, dropout 0.05, "all-linear"): the adapter's r,
  lora_alpha, lora_dropout, use_rslora and targets win, in one line naming them and the config's values they
  replaced; targets or modules_to_save set to others are one line naming the override that fits, and that
  override, passed as written, starts. Per-module ranks or alphas (rank_pattern, alpha_pattern) are one line.
- the command line, as a user runs it: `shardlm train configs/sft-lora-qwen3.toml` on a chat Qwen3-MoE with
  experts adapted, `shardlm convert --to-peft`, and `shardlm train configs/sft-lora-qwen3.toml
  checkpoint.init_adapter=...` with the config's own rank, alpha and dropout: the second run starts, says once
  which keys it took from the adapter, and trains the same number of parameters as the first.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import partial
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from llama_reference import spread_norm_weights
from test_lora_peft import SEQ, TOKENS, VOCAB, batches
from test_moe_parallel import full_parameters

from shardlm.checkpoint import save_checkpoint
from shardlm.checkpoint.init import init_weights, open_source, resolve_init
from shardlm.checkpoint.peft import load_adapter, read_peft, resolve_adapter
from shardlm.checkpoint.peft_experts import EXPERT_PARAMETERS
from shardlm.cli import main
from shardlm.config import from_dict, load_config
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer
from shardlm.validation import validate

from agreement import rel
from multiproc import check_result, needs, run_checks, run_workers

# peft is imported where it is used: the ranks this module spawns unpickle its functions, and importing peft
# (transformers with it) would cost each of them seconds
pytestmark = needs(find_spec("peft") is not None, "peft, the LoRA oracle (the dev extra installs it)")

TOL = 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ORDERS = {"gate_up first": EXPERT_PARAMETERS, "down first": EXPERT_PARAMETERS[::-1]}
LAYOUTS = {"ep2": {"tp": 1, "ep": 2}, "tp2 sp": {"tp": 2, "ep": 1}}
SOURCES = ("peft", "shardlm")
ADAPTERS = [f"{source}, {order}" for source in SOURCES for order in ORDERS]


def qwen3_moe(root, vocab: int = VOCAB, hidden: int = 32, heads: int = 4, tied: bool = False):
    """A random two-layer Qwen3-MoE (seed 0, norm weights from U(0.5, 2), routers drawn with std 0.5 so that they
    route) saved as a Hugging Face directory in `root`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                            num_attention_heads=heads, num_key_value_heads=heads // 2, head_dim=8,
                            max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[],
                            router_aux_loss_coef=0.0, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    spread_norm_weights(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(root)
    return root


def peft_written(base, out):
    """peft's own adapter directory: q/k/v/o and the experts, r=4, lora_alpha=12, rsLoRA, every factor drawn."""
    import peft
    from transformers import AutoModelForCausalLM

    config = peft.LoraConfig(r=4, lora_alpha=12, use_rslora=True, lora_dropout=0.0, target_modules=ATTENTION,
                             target_parameters=EXPERT_PARAMETERS)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), config)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    model.save_pretrained(out)
    return out


def shardlm_written(base, root):
    """shardlm's: a run with the experts adapted (B drawn, one step trained), saved, `convert --to-peft`."""
    config = from_dict({"model": {"seq_length": SEQ, "dropout": 0.0}, "data": {"text_file": "unused"},
                        "checkpoint": {"init_from": str(base)},
                        "lora": {"rank": 4, "alpha": 8.0, "targets": ["q", "k", "v", "o", "experts"]},
                        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 4, "steps": 1,
                                  "lr": 1e-2, "warmup_steps": 0, "seed": 3}})
    resolve_init(config)
    trainer = Trainer(config, ParallelContext.single(), batches(1))
    init_weights(trainer, open_source(base))
    generator = torch.Generator().manual_seed(12)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if ".lora.B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    trainer.train_step()
    save_checkpoint(trainer, root / "run")
    assert main(["convert", "--to-peft", str(root / "adapter"), "--checkpoint", str(root / "run")]) == 0
    return root / "adapter"


def in_order(adapter, out, order: list[str]):
    """A copy of adapter directory `adapter` whose adapter_config.json lists `target_parameters` in `order`."""
    shutil.copytree(adapter, out)
    settings = json.loads((out / "adapter_config.json").read_text())
    settings["target_parameters"] = order
    (out / "adapter_config.json").write_text(json.dumps(settings))
    return out


def peft_outputs(base, adapter, experts: bool = True) -> dict:
    """peft's loss on the first batch and logits on `TOKENS` with `adapter` on the transformers base (the experts'
    adapters zeroed when not `experts`)."""
    import peft
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    with torch.no_grad():
        if not experts:
            for name, param in model.named_parameters():
                if ".experts." in name and ".lora_B." in name:
                    param.zero_()
        batch = torch.from_numpy(np.stack(batches(1)))
        return {"loss": model(batch, labels=batch).loss.item(), "logits": model(TOKENS).logits}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The base, the four adapter directories ({name: path}) and peft's outputs with each."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("expert_adapters")
    base = qwen3_moe(root / "base")
    written = {"peft": peft_written(base, root / "peft"), "shardlm": shardlm_written(base, root / "shardlm")}
    adapters = {f"{source}, {order}": in_order(written[source], root / f"{source} {i}", ORDERS[order])
                for source in SOURCES for i, order in enumerate(ORDERS)}
    batch = torch.from_numpy(np.stack(batches(1)))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(base).eval()
        plain = {"loss": model(batch, labels=batch).loss.item(), "logits": model(TOKENS).logits}
    return {"base": base, "adapters": adapters, "plain": plain,
            "peft": {name: peft_outputs(base, path) for name, path in adapters.items()},
            "peft without experts": {source: peft_outputs(base, written[source], experts=False)
                                     for source in SOURCES}}


def start(base: str, adapter: str, tp: int = 1, ep: int = 1, world: int = 1) -> dict:
    """A run from `adapter` on `base` at TP=`tp` (with SP) x EP=`ep` on `world` ranks, [lora] at its defaults:
    its first loss, the adapters it loaded (gathered whole) and, on one process, its logits on `TOKENS`."""
    ctx = ParallelContext.single() if world == 1 else ParallelContext.from_process_group(tp, expert_parallel=ep)
    config = from_dict({"model": {"seq_length": SEQ, "dropout": 0.0}, "data": {"text_file": "unused"},
                        "checkpoint": {"init_from": base, "init_adapter": adapter},
                        "parallel": {"tensor": tp, "expert": ep, "sequence_parallel": tp > 1},
                        "train": {"precision": "fp32", "micro_batch_size": 4 * tp // world, "global_batch_size": 4,
                                  "steps": 1, "lr": 1e-2, "warmup_steps": 0, "seed": 3}})
    resolve_init(config)
    resolve_adapter(config)
    validate(config, world, check_paths=False)
    trainer = Trainer(config, ctx, batches(1))
    init_weights(trainer, open_source(base))
    load_adapter(trainer, adapter)
    loaded = {name: value for name, value in full_parameters(trainer.model).items() if ".lora." in name}
    out = {"adapters": loaded}
    if world == 1:
        with torch.no_grad():
            out["logits"] = trainer.model.eval()(TOKENS)[..., :VOCAB]
        trainer.model.train()
    return out | {"loss": trainer.train_step()["loss"]}


def start_at_two_ranks(base: str, adapters: dict) -> dict:
    """Worker body of the two-rank world: a run from every adapter at every layout of `LAYOUTS`."""
    return run_checks({f"{name}, {layout}": partial(start, base, str(path), world=2, **LAYOUTS[layout])
                       for name, path in adapters.items() for layout in LAYOUTS})


@pytest.fixture(scope="module")
def one_process(files):
    """{adapter name: `start`'s result at one process}, read with `alone` (an adapter that fails fails its tests)."""
    return run_checks({name: partial(start, str(files["base"]), str(path)) for name, path in files["adapters"].items()})


def alone(one_process: dict, name: str) -> dict:
    return check_result([one_process], name)[0]


@pytest.fixture(scope="module")
def two_ranks(files):
    return run_workers(2, start_at_two_ranks, str(files["base"]), files["adapters"], timeout=500)


@pytest.mark.timeout(300)
def test_peft_and_shardlm_read_both_orders_alike(files):
    assert (json.loads((files["adapters"]["peft, down first"] / "adapter_config.json").read_text())
            ["target_parameters"] == EXPERT_PARAMETERS[::-1])
    for source in SOURCES:
        first, second = (files["peft"][f"{source}, {order}"]["logits"] for order in ORDERS)
        assert torch.equal(first, second), source  # peft: either order is the same adapter
        read = [read_peft(files["adapters"][f"{source}, {order}"], open_source(files["base"]).config.model)[1]
                for order in ORDERS]
        assert read[0].keys() == read[1].keys() and all(torch.equal(v, read[1][k]) for k, v in read[0].items())
        assert any(".experts.lora.A_down." in name for name in read[0])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("names", [["down_proj", "gate_up_proj"], ["experts.gate_up_proj", "mlp.experts.down_proj"]],
                         ids=["tensor names", "module suffixes"])
def test_shorter_suffixes_name_the_same_tensors(files, tmp_path, names):
    model = open_source(files["base"]).config.model
    full = read_peft(files["adapters"]["peft, gate_up first"], model)[1]
    short = read_peft(in_order(files["adapters"]["peft, gate_up first"], tmp_path / "short", names), model)[1]
    assert short.keys() == full.keys() and all(torch.equal(v, full[k]) for k, v in short.items())


BAD_SETTINGS = {
    "down_proj only": ({"target_parameters": ["mlp.experts.down_proj"]}, "on both mlp.experts.gate_up_proj and"),
    "a third tensor": ({"target_parameters": EXPERT_PARAMETERS + ["mlp.experts.up_proj"]}, "(in any order)"),
    "one layer's": ({"target_parameters": ["model.layers.0.mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
                    "(in any order)"),
    "alpha_pattern": ({"alpha_pattern": {"q_proj": 16}}, "sets alpha_pattern (per-module ranks or alphas)"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_adapters_shardlm_cannot_load_are_one_line(files, tmp_path, case):
    change, message = BAD_SETTINGS[case]
    adapter = in_order(files["adapters"]["peft, gate_up first"], tmp_path / "bad", EXPERT_PARAMETERS)
    settings = json.loads((adapter / "adapter_config.json").read_text()) | change
    (adapter / "adapter_config.json").write_text(json.dumps(settings))
    with pytest.raises(UserError) as error:
        start(str(files["base"]), str(adapter))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ADAPTERS)
def test_one_process_starts_where_peft_does(files, one_process, name):
    ours, theirs = alone(one_process, name), files["peft"][name]
    assert abs(ours["loss"] - theirs["loss"]) <= TOL * theirs["loss"], (ours["loss"], theirs["loss"])
    assert rel(ours["logits"], theirs["logits"]) <= TOL, rel(ours["logits"], theirs["logits"])
    source = name.split(",")[0]
    for control in (files["plain"], files["peft without experts"][source]):  # the adapters, experts' too, count
        assert abs(control["loss"] - theirs["loss"]) > 10 * TOL * theirs["loss"], (control["loss"], theirs["loss"])
        assert rel(control["logits"], theirs["logits"]) > 1e-2, rel(control["logits"], theirs["logits"])
    assert {n.split(".lora.")[1] for n in ours["adapters"] if ".experts." in n} == {"A_in", "B_gate", "B_up",
                                                                                     "A_down", "B_down"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ADAPTERS)
def test_two_ranks_start_where_peft_and_one_process_do(files, one_process, two_ranks, name, layout):
    expected = files["peft"][name]["loss"]
    for rank, ours in enumerate(check_result(two_ranks, f"{name}, {layout}")):
        assert abs(ours["loss"] - expected) <= TOL * expected, (rank, ours["loss"], expected)
        expected_adapters = alone(one_process, name)["adapters"]
        assert ours["adapters"].keys() == expected_adapters.keys()
        assert all(torch.equal(value, expected_adapters[key]) for key, value in ours["adapters"].items()), rank


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["one process", *LAYOUTS])
@pytest.mark.parametrize("source", SOURCES)
def test_both_orders_load_the_same_parameters(one_process, two_ranks, source, layout):
    runs = [[alone(one_process, f"{source}, {order}")] if layout == "one process"
            else check_result(two_ranks, f"{source}, {order}, {layout}") for order in ORDERS]
    for first, second in zip(*runs, strict=True):
        assert first["adapters"].keys() == second["adapters"].keys()
        assert all(torch.equal(value, second["adapters"][key]) for key, value in first["adapters"].items())
        assert first["loss"] == second["loss"]


def lora_config_file(files, *overrides: str):
    """configs/sft-lora-qwen3.toml on the MoE base from peft's adapter (r=4, lora_alpha=12, rsLoRA, dropout 0,
    q/k/v/o and the experts), `overrides` applied as the command line would; [model] resolved."""
    adapter = files["adapters"]["peft, down first"]
    config = load_config("configs/sft-lora-qwen3.toml", [f"checkpoint.init_from={files['base']}",
                                                         f"checkpoint.init_adapter={adapter}", *overrides])
    resolve_init(config)
    return config, adapter


TAKEN = "rank=4, alpha=12.0, dropout=0.0, rslora=True, targets=['k_proj', 'o_proj', 'q_proj', 'v_proj', 'experts']"


@pytest.mark.timeout(300)
def test_the_config_files_lora_keys_give_way_to_the_adapters(files):
    config, adapter = lora_config_file(files)
    assert (config.lora.rank, config.lora.alpha, config.lora.dropout) == (16, 32.0, 0.05)  # the file's
    line = resolve_adapter(config)
    assert line == (f"lora: {TAKEN} taken from checkpoint.init_adapter={adapter} (over the config's rank=16, "
                    "alpha=32.0, dropout=0.05)"), line
    lora = config.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.rslora) == (4, 12.0, 0.0, True)  # adapter_config.json's
    assert lora.targets == ["k_proj", "o_proj", "q_proj", "v_proj", "experts"] and lora.modules_to_save == []
    assert resolve_adapter(config) is None  # repeatable: a resolved config is unchanged

    same, _ = lora_config_file(files, 'lora.targets=["all-linear", "experts"]')  # the same adapters on this model
    assert "targets" not in resolve_adapter(same) and same.lora.targets == ["all-linear", "experts"]


OTHERS = {"targets": ('lora.targets=["q_proj", "experts"]', "has adapters on experts, k, o, q, v",
                      """'lora.targets=["k_proj","o_proj","q_proj","v_proj","experts"]'"""),
          "modules_to_save": ('lora.modules_to_save=["output"]', "has []", "'lora.modules_to_save=[]'")}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", list(OTHERS))
def test_other_modules_are_one_line_naming_the_override_that_starts(files, key):
    override, has, fix = OTHERS[key]
    config, _ = lora_config_file(files, override)
    with pytest.raises(UserError) as error:
        resolve_adapter(config)
    message = str(error.value)
    assert has in message and f"pass {fix} to start from it" in message and "\n" not in message, message
    passed = re.search(r"pass '([^']+)'", message)[1]  # as a shell hands it over
    config, _ = lora_config_file(files, override, passed)
    assert resolve_adapter(config).startswith("lora: rank=4, alpha=12.0")
    validate(config, 1, check_paths=False)


CLI = ["train.steps=1", 'train.precision="fp32"', "train.micro_batch_size=1", "train.global_batch_size=1",
       "model.seq_length=256", "train.eval_interval=0", "checkpoint.save_interval=0", "log.progress=false",
       "log.tensorboard=false", "log.plot=false"]


@pytest.mark.timeout(300)
def test_the_command_line_starts_from_its_own_expert_adapter(data_dir, tmp_path, capsys):
    """The issue's three commands: train with the experts adapted, export, start again from the export with the
    config file's [lora] (rank 16, alpha 32, dropout 0.05) as it stands."""
    chat = qwen3_moe(tmp_path / "hf", vocab=151936, hidden=16, heads=2, tied=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data_dir / "chat" / "qwen3" / name, chat / name)
    records = tmp_path / "records.jsonl"
    lines = (data_dir / "chat" / "dolly-15k-first600.jsonl").read_text().splitlines()[:40]
    records.write_text("\n".join(lines) + "\n")
    common = ["train", "configs/sft-lora-qwen3.toml", f"checkpoint.init_from={chat}", f'sft.data=["{records}"]', *CLI]
    assert main([*common, 'lora.targets=["q","k","v","o","experts"]', "lora.rank=4", "lora.alpha=8.0",
                 "lora.dropout=0.0", "--run-dir", str(tmp_path / "first")]) == 0
    trains = re.search(r"lora: training [\d,]+ of [\d,]+ parameters", capsys.readouterr().out)[0]
    adapter = tmp_path / "adapter"
    assert main(["convert", "--to-peft", str(adapter), "--checkpoint", str(tmp_path / "first" / "checkpoints")]) == 0
    assert "targets k_proj, o_proj, q_proj, v_proj, experts)" in capsys.readouterr().out  # the experts named too
    assert main([*common, f"checkpoint.init_adapter={adapter}", "--run-dir", str(tmp_path / "second")]) == 0
    out = capsys.readouterr().out
    line = (f"lora: rank=4, alpha=8.0, dropout=0.0, targets=['k_proj', 'o_proj', 'q_proj', 'v_proj', 'experts'] "
            f"taken from checkpoint.init_adapter={adapter} (over the config's rank=16, alpha=32.0, dropout=0.05)")
    assert out.count(line) == 1 and f"adapters from peft directory {adapter} (r=4" in out, out
    assert trains in out, out
