"""LoRA equal to peft 0.21 on one process, and adapters through peft's files both ways.

The base: a random two-layer Qwen3 from transformers (grouped-query attention, q/k norms, untied output layer,
every norm weight drawn from U(0.5, 2)), saved as a Hugging Face directory and read by shardlm in place
(`checkpoint.init_from`). peft's `LoraConfig` with the same rank, alpha, rsLoRA choice and targets (dropout 0)
on the transformers model.

- Logits: the same adapter weights (B drawn non-zero, so every adapter counts) give the same logits within
  1e-5, with all seven projections and with q/v only, rsLoRA on; the output layer trained in full too.
- Training: shardlm's trainer (constant learning rate, no clipping, weight decay 0.01) and a plain
  `torch.optim.AdamW` loop over peft's trainable parameters, from the same adapters, give the same losses
  within 1e-5 for 5 steps.
- Qwen3-MoE (4 experts, top-2, 2 layers): adapters on q/k/v/o and on every expert (peft's `target_parameters`
  on transformers' fused gate_up_proj and down_proj) give peft's logits, and 5 training steps peft's losses; its
  trained checkpoint goes through `--to-peft` and back (`checkpoint.init_adapter`) to the same logits.
- DeepSeek-V3's latent attention (q_a, q_b, kv_a with its rotary rows interleaved in transformers, kv_b, o):
  peft's logits, and greedy generation through the KV cache (kv_b folded into the query and the
  output) gives the tokens of generating without it.
- Round trip: the trained run's checkpoint, written by `shardlm convert --to-peft`, loads with
  `PeftModel.from_pretrained` to shardlm's logits; `--to-peft --merge` writes a plain Qwen3 directory whose
  transformers logits are the same; that adapter directory starts a run (`checkpoint.init_adapter`) at TP=2
  whose first loss is peft's.
"""

from __future__ import annotations

import json
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from llama_reference import spread_norm_weights
from test_moe_parallel import full_parameters

from shardlm.checkpoint import load_checkpoint, load_model, save_checkpoint
from shardlm.checkpoint.hf import from_hf
from shardlm.checkpoint.init import init_weights, open_source, resolve_init
from shardlm.checkpoint.peft import load_adapter, peft_tensors, read_peft, resolve_adapter, stacked
from shardlm.cli import main
from shardlm.config import from_dict
from shardlm.lora import LoRA
from shardlm.parallel import ParallelContext
from shardlm.training.trainer import Trainer

from agreement import rel
from multiproc import needs, run_workers

# peft is imported where it is used: the ranks this module spawns unpickle its functions, and importing peft
# (transformers with it) would cost each of them seconds
pytestmark = needs(find_spec("peft") is not None, "peft, the LoRA oracle (the dev extra installs it)")

SEQ, VOCAB, TOL = 16, 96, 1e-5
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return qwen3_directory(tmp_path_factory.mktemp("lora_peft") / "qwen3")


def qwen3_directory(root):
    """A random two-layer Qwen3 (norm weights spread, untied output layer) saved as a Hugging Face directory."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return save_random(Qwen3ForCausalLM, config, root)


def save_random(model_class, config, root, prepare=None):
    """A random transformers `model_class` of `config` (seed 0), every norm weight drawn from U(0.5, 2) and then
    `prepare(model)` applied, saved as a Hugging Face directory in `root`; returns `root`."""
    torch.manual_seed(0)
    model = model_class(config)
    spread_norm_weights(model)
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    model.save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0,
                            tie_word_embeddings=False)

    def sharp_routers(model):  # a router that routes: std 0.02 logits would tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)

    return save_random(Qwen3MoeForCausalLM, config, tmp_path_factory.mktemp("lora_peft_moe") / "qwen3_moe",
                       sharp_routers)


@pytest.fixture(scope="module")
def mla_base(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=4,
                              num_key_value_heads=4, n_routed_experts=8, n_group=4, topk_group=2, kv_lora_rank=16,
                              q_lora_rank=24,
                              qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, max_position_embeddings=64,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False)
    root = save_random(DeepseekV3ForCausalLM, config, tmp_path_factory.mktemp("lora_peft_mla") / "deepseek")
    return {"hf": root, "file": from_hf(root, root.parent / "deepseek.safetensors")}  # shardlm reads it converted


def run_config(root, steps: int = 5, **lora):
    config = from_dict({
        "model": {"seq_length": SEQ, "dropout": 0.0},
        "data": {"text_file": "unused"},
        "checkpoint": {"init_from": str(root)},
        "lora": {"rank": 4, "alpha": 8.0, **lora},
        "train": {"precision": "fp32", "micro_batch_size": 4, "global_batch_size": 4, "steps": steps, "lr": 1e-2,
                  "warmup_steps": 0,
                  "decay_style": "constant", "clip_grad": 0.0, "weight_decay": 0.01, "seed": 3},
    })
    resolve_init(config)
    return config


def batches(steps: int) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, VOCAB, size=SEQ + 1) for _ in range(4 * steps)]


def shardlm_trainer(root, ctx=None, **lora) -> Trainer:
    """A trainer on the Qwen3 base with adapters whose B is drawn (seeded) instead of zero."""
    ctx = ctx or ParallelContext.single()
    trainer = Trainer(run_config(root, **lora), ctx, batches(5))
    init_weights(trainer, open_source(root))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in trainer.model.modules():
            if isinstance(module, LoRA):
                module.B.copy_(torch.randn(module.B.shape, generator=generator) * 0.1)
    return trainer


def trained(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def peft_model(root, trainer: Trainer, targets: list[str], rslora: bool = False, save=None,
               experts: bool | list[str] = False, model_class=None):
    """peft on the transformers model in `root` (`model_class`, else AutoModelForCausalLM's) with `trainer`'s
    adapters; `experts`: adapters on the experts too (True: `EXPERT_PARAMETERS`, or the `target_parameters`)."""
    import peft
    from transformers import AutoModelForCausalLM

    from shardlm.checkpoint.peft_experts import EXPERT_PARAMETERS

    model = (model_class or AutoModelForCausalLM).from_pretrained(root)
    parameters = (EXPERT_PARAMETERS if experts is True else experts) or None
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, use_rslora=rslora,
                             modules_to_save=save, target_parameters=parameters)
    model = peft.get_peft_model(model, config)
    loaded = peft.set_peft_model_state_dict(model, peft_tensors(trained(trainer), trainer.config.model))
    assert not loaded.unexpected_keys, loaded.unexpected_keys
    return model


def shardlm_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


TOKENS = torch.from_numpy(np.random.default_rng(9).integers(0, VOCAB, size=(2, SEQ)))
CASES = {"all seven": ({"targets": ["all-linear"]}, ALL, False, None),
         "q v rslora": ({"targets": ["q_proj", "v_proj"], "rslora": True}, ["q_proj", "v_proj"], True, None),
         "output saved": ({"targets": ["q", "down"], "modules_to_save": ["output"]}, ["q_proj", "down_proj"], False,
                          ["lm_head"])}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_peft(base, case):
    lora, targets, rslora, save = CASES[case]
    trainer = shardlm_trainer(base, **lora)
    if save:  # the output layer moved too, so that a copy left behind would show
        with torch.no_grad():
            trainer.model.lm_head.weight.mul_(1.5)
    ours = shardlm_logits(trainer.model, TOKENS)
    theirs = peft_model(base, trainer, targets, rslora, save).eval()(TOKENS).logits
    assert rel(ours[..., :VOCAB], theirs) <= TOL, rel(ours[..., :VOCAB], theirs)
    plain = shardlm_logits(load_model(base, ParallelContext.single())[0], TOKENS)[..., :VOCAB]
    assert rel(plain, theirs) > 1e-2  # the adapters changed the logits


MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_moe_logits_and_training_equal_peft(moe_base, tmp_path):
    trainer = shardlm_trainer(moe_base, targets=MOE_TARGETS + ["experts"])
    assert any(".experts.lora." in n for n in trained(trainer))
    ours = shardlm_logits(trainer.model, TOKENS)[..., :VOCAB]
    model = peft_model(moe_base, trainer, MOE_TARGETS, experts=True)
    assert rel(model.eval()(TOKENS).logits, ours) <= TOL
    save_checkpoint(trainer, tmp_path / "run")
    assert main(["convert", "--to-peft", str(tmp_path / "adapter"), "--checkpoint", str(tmp_path / "run")]) == 0
    _, back = read_peft(tmp_path / "adapter", trainer.config.model)
    saved = {n: p for n, p in full_parameters(trainer.model).items() if ".lora." in n}
    assert all(torch.equal(stacked(back)[n], p) for n, p in saved.items())
    assert_trains_as_peft(trainer, model.train())


MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]  # peft 0.21 leaves DeepSeek-V3's
# dense MLP out even when named


def test_mla_logits_equal_peft_and_cached_generation(mla_base):
    from shardlm.eval.generate import SamplingConfig, generate_tokens

    trainer = shardlm_trainer(mla_base["file"], targets=MLA_TARGETS)
    assert {n.split(".")[3] for n in trained(trainer)} == {"q_a", "q_b", "kv_a", "kv_b", "o"}
    ours = shardlm_logits(trainer.model, TOKENS)[..., :VOCAB]
    assert rel(peft_model(mla_base["hf"], trainer, MLA_TARGETS).eval()(TOKENS).logits, ours) <= TOL
    model = trainer.model.eval()
    prompt = TOKENS[:, :6]
    cached = generate_tokens(model, prompt.tolist(), SamplingConfig(max_new_tokens=6, temperature=0.0,
                                                                    stop_at_eod=False))
    ids = prompt
    with torch.no_grad():
        for _ in range(6):  # no cache: the whole sequence again each step
            ids = torch.cat((ids, model.full_logits(model(ids))[:, -1, :VOCAB].argmax(-1, keepdim=True)), dim=1)
    assert [g.tokens for g in cached] == ids[:, 6:].tolist()


def assert_trains_as_peft(trainer: Trainer, model, steps: int = 5) -> None:
    """`steps` steps of `trainer` and of a plain AdamW loop over the peft model's trainable parameters: same
    losses."""
    params = [p for p in model.parameters() if p.requires_grad]
    assert sum(p.numel() for p in params) == sum(p.numel() for p in trained(trainer).values())
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, eps=1e-8)
    data = torch.from_numpy(np.stack(batches(5)))
    for step in range(steps):
        ours = trainer.train_step()["loss"]
        batch = data[4 * step:4 * step + 4]
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        assert abs(ours - loss.item()) <= TOL * loss.item(), (step, ours, loss.item())


def test_training_equals_a_plain_adamw_loop_over_peft(base):
    trainer = shardlm_trainer(base)
    model = peft_model(base, trainer, ALL).train()
    assert_trains_as_peft(trainer, model)


def started_from(root, adapter, ctx: ParallelContext | None = None, **parallel) -> tuple[Trainer, str | None]:
    """A trainer on the base `root` started from the peft adapter directory `adapter` (`checkpoint.init_adapter`), its
    [lora] keys taken from the directory (`parallel`: [parallel] keys of `ctx`'s layout); and `resolve_adapter`'s
    line naming the keys it took."""
    config = run_config(root)
    config.lora = from_dict({}).lora
    config.checkpoint.init_adapter = str(adapter)
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    line = resolve_adapter(config)
    trainer = Trainer(config, ctx or ParallelContext.single(), batches(5))
    init_weights(trainer, open_source(root))
    load_adapter(trainer, adapter)
    return trainer, line


def start_from_adapter(root: str, adapter: str) -> float:
    """TP=2 with SP: a run from the Qwen3 base and the peft adapter directory; its first loss."""
    trainer, _ = started_from(root, adapter, ParallelContext.from_process_group(2), tensor=2, sequence_parallel=True)
    return trainer.train_step()["loss"]


def test_round_trip_through_peft_and_a_start_from_its_adapter(base, tmp_path, capsys):
    import peft
    from transformers import AutoModelForCausalLM

    trainer = shardlm_trainer(base)
    for _ in range(2):
        trainer.train_step()
    save_checkpoint(trainer, tmp_path / "run")
    ours, _ = load_model(tmp_path / "run", ParallelContext.single())
    expected = shardlm_logits(ours, TOKENS)[..., :VOCAB]

    adapter = tmp_path / "adapter"
    assert main(["convert", "--to-peft", str(adapter), "--checkpoint", str(tmp_path / "run")]) == 0
    assert "peft LoRA adapter, r=4" in capsys.readouterr().out
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(settings["target_modules"]) == sorted(ALL) and settings["lora_alpha"] == 8.0
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    assert rel(loaded(TOKENS).logits, expected) <= TOL

    merged = tmp_path / "merged"
    assert main(["convert", "--to-peft", str(merged), "--checkpoint", str(tmp_path / "run"), "--merge"]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out and not (merged / "adapter_config.json").exists()
    assert rel(AutoModelForCausalLM.from_pretrained(merged).eval()(TOKENS).logits, expected) <= TOL

    batch = torch.from_numpy(np.stack(batches(5)[:4]))
    with torch.no_grad():
        peft_loss = loaded.train()(batch, labels=batch).loss.item()
    first = run_workers(2, start_from_adapter, str(base), str(adapter), timeout=300)
    assert first[0] == first[1] and abs(first[0] - peft_loss) <= TOL * peft_loss, (first, peft_loss)


def test_resume_of_a_run_from_a_hugging_face_base(base, tmp_path):
    """The base is read again from checkpoint.init_from on resume and must be the one the adapters were saved on."""
    trainer = shardlm_trainer(base)
    trainer.train_step()
    save_checkpoint(trainer, tmp_path)
    straight = trainer.train_step()["loss"]
    resumed = Trainer(run_config(base), ParallelContext.single(), batches(5))
    load_checkpoint(resumed, tmp_path)
    assert resumed.train_step()["loss"] == straight
