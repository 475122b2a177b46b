"""Training started from Hugging Face weights (`checkpoint.init_from`), against transformers, and exported back.

A random `Qwen3ForCausalLM` (head_dim 12 at hidden 32, 4 query heads over 2 KV heads, sharp attention and
q/k norm weights away from 1) is saved with save_pretrained. Runs whose [model] section is left empty start
from that directory (and from its converted single file) at TP=1, TP=2, PP=2, CP=2 and DP=2 with FSDP
and with a sharded optimizer (ZeRO-1): the step-1 loss equals transformers' loss on the same batch within
1e-5, and each layout's three-step curve (losses, gradient norms) and final parameters on every rank equal
one process's start from the same weights. A random `Qwen3MoeForCausalLM` started at EP=2
(experts split over 2 ranks) gives transformers' loss too, and so does a random GPT-2 started in one process.
The TP=2 run's checkpoint, exported with `to_hf`, gives transformers logits equal to shardlm's within 1e-5,
and a run started from that checkpoint's weights (at TP=1) gives the exported model's transformers loss.
A rank reads only its own rows of an HF tensor that needs no conversion.
One world of 2 processes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe_parallel import stage_parameters
from test_training import VOCAB, synthetic_data

from shardlm.checkpoint import load_model, save_checkpoint
from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.checkpoint.init import init_weights, resolve_init
from shardlm.config import from_dict
from shardlm.parallel import ParallelContext
from shardlm.training.data import micro_batches
from shardlm.training.trainer import Trainer

from agreement import assert_trained_parameters
from multiproc import run_workers

TOL, STEPS, BATCH = 1e-5, 3, 8
PARAM_TOL = 5e-5
"""The final parameters' bound (`trained_rel`). AdamW's second and third updates divide momenta that nearly cancel
for some elements, so fp32 rounding in another summation order (another layout, or the AVX2 kernels) reaches
1.1e-5 there (measured: `layers.0.mlp.down.weight` at CP=2 and TP=2); a start that missed a weight, or the
optimizer's copy of one, trains from another random draw of it: off by order 1."""


def tiny_qwen3(moe: bool = False):
    """A random tiny Qwen3 (or Qwen3-MoE) in fp32, with weights that make a layout slip show."""
    from llama_reference import spread_norm_weights  # here: the workers, which import this module, need not

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=500.0,
                  tie_word_embeddings=False)
    torch.manual_seed(0)
    if moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                                   num_experts_per_tok=2, norm_topk_prob=True,
                                                   router_aux_loss_coef=0.0, **common))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=64, **common))
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)  # logits far from flat: a loss far from log(VOCAB)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    assert len(spread_norm_weights(model, low=0.5, high=2.0, norms=("q_norm", "k_norm"))) == 2 * len(model.model.layers)
    return model.eval()


def hf_loss(model, batch: torch.Tensor) -> float:
    """transformers' mean next-token loss on a (B, T + 1) batch."""
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


def run_config(init_from, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, micro: int = BATCH,
               sharding: str = "none"):
    """A user's config that names the weights and leaves [model] at its defaults."""
    return from_dict({
        "parallel": {"tensor": tp, "pipeline": pp, "expert": ep, "context": cp},
        "data": {"text_file": "unused"},
        "checkpoint": {"init_from": str(init_from)},
        "train": {"precision": "fp32", "micro_batch_size": micro, "global_batch_size": BATCH, "steps": STEPS,
                  "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 1, "clip_grad": 1.0, "seed": 7, "data_sharding": sharding},
    })


def start(ctx: ParallelContext, config, steps: int = STEPS, save_to=None):
    """Losses of `steps` steps of a run started from config.checkpoint.init_from (saved when `save_to`)."""
    run = started_run(ctx, config, steps, save_to)
    return [loss for loss, _ in run["curve"]], run["saved"]


def started_run(ctx: ParallelContext, config, steps: int = STEPS, save_to=None) -> dict:
    """`steps` steps of a run started from config.checkpoint.init_from: its curve [(loss, gradient norm)], every
    final parameter in the one-process layout (merged over pipeline stages) and the checkpoint it saved to
    `save_to` (or None)."""
    ctx.rng = None
    source = resolve_init(config)
    trainer = Trainer(config, ctx, synthetic_data())
    init_weights(trainer, source)
    curve = [(m["loss"], m["grad_norm"]) for m in (trainer.train_step() for _ in range(steps))]
    saved = save_checkpoint(trainer, save_to) if save_to is not None else None
    return {"curve": curve, "params": stage_parameters(trainer.model), "saved": saved}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_start")
    batch = micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]
    out = {"root": root, "batch": batch}
    for name, moe in (("dense", False), ("moe", True)):
        model = tiny_qwen3(moe)
        model.save_pretrained(root / name)
        out[name] = {"dir": root / name, "loss": hf_loss(model, batch), "model": model}
    out["file"] = from_hf(root / "dense", root / "dense.safetensors")
    gpt2 = tiny_gpt2()
    gpt2.save_pretrained(root / "gpt2")
    out["gpt2"] = {"dir": root / "gpt2", "loss": hf_loss(gpt2, batch)}
    return out


def tiny_gpt2():
    """A random tiny GPT-2 (Conv1D weights, fused [q|k|v] columns: converted, not only renamed), no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with torch.no_grad():
        model.transformer.wte.weight.mul_(20.0)  # tied output: logits far from flat
        for block in model.transformer.h:
            block.attn.c_attn.weight.mul_(4.0)
    return model.eval()


def worker(paths: dict) -> dict:
    """Every layout starts from the HF weights and trains STEPS steps: (curve, parameters, saved checkpoint)."""
    out = {}
    for name, config, save in (
            ("tp2", run_config(paths["dense"], tp=2), paths["saved"]),
            ("tp2_file", run_config(paths["file"], tp=2), None),
            ("pp2", run_config(paths["dense"], pp=2, micro=BATCH // 2), None),
            ("ep2", run_config(paths["moe"], ep=2, micro=BATCH // 2), None),
            ("fsdp_dp2", run_config(paths["dense"], micro=BATCH // 2, sharding="full"), None),
            ("zero1_dp2", run_config(paths["dense"], micro=BATCH // 2, sharding="optimizer"), None),
            ("cp2", run_config(paths["dense"], cp=2), None)):
        p = config.parallel
        ctx = ParallelContext.from_process_group(p.tensor, pipeline_parallel=p.pipeline, expert_parallel=p.expert,
                                                 context_parallel=p.context)
        run = started_run(ctx, config, STEPS, save)
        out[name] = (run["curve"], run["params"], str(run["saved"]) if save else None)
    return out


@pytest.fixture(scope="module")
def world2(models):
    paths = {"dense": str(models["dense"]["dir"]), "moe": str(models["moe"]["dir"]), "file": str(models["file"]),
             "saved": str(models["root"] / "tp2_checkpoints")}
    return run_workers(2, worker, paths, timeout=300)


def test_reference_loss_tells_weights_apart(models):
    """A model with fresh random weights is far from transformers' loss, so the comparisons below test the load."""
    ctx = ParallelContext.single()
    config = run_config(models["dense"]["dir"])
    resolve_init(config)
    fresh = Trainer(config, ctx, synthetic_data()).train_step()["loss"]
    assert abs(fresh - models["dense"]["loss"]) > 1000 * TOL


def test_one_process_started_from_hf_and_from_its_converted_file_gives_transformers_loss(models):
    for path in (models["dense"]["dir"], models["file"]):
        losses, _ = start(ParallelContext.single(), run_config(path), steps=1)
        assert abs(losses[0] - models["dense"]["loss"]) < TOL, path


def test_one_process_started_from_hf_gpt2_gives_transformers_loss(models):
    losses, _ = start(ParallelContext.single(), run_config(models["gpt2"]["dir"]), steps=1)
    assert abs(losses[0] - models["gpt2"]["loss"]) < TOL


@pytest.fixture(scope="module")
def one_process(models):
    """One process started from the same weights, STEPS steps: the dense model at the layouts' whole batch, the
    MoE at their micro-batch (its load-balancing loss is a function of each micro-batch's routing)."""
    runs = {"dense": started_run(ParallelContext.single(), run_config(models["dense"]["dir"])),
            "moe": started_run(ParallelContext.single(), run_config(models["moe"]["dir"], micro=BATCH // 2))}
    return {kind: (run["curve"], run["params"]) for kind, run in runs.items()}


LAYOUTS = ("tp2", "tp2_file", "pp2", "ep2", "fsdp_dp2", "zero1_dp2", "cp2")


def test_starts_at_every_layout_give_transformers_loss(world2, models):
    for name in LAYOUTS:
        kind = "moe" if name == "ep2" else "dense"
        for rank in world2:
            assert abs(rank[name][0][0][0] - models[kind]["loss"]) < TOL, name


@pytest.mark.parametrize("name", LAYOUTS)
def test_starts_at_every_layout_train_like_one_process(world2, one_process, name):
    """Three steps from the HF weights: every step's loss and gradient norm and every final parameter on every
    rank equal one process's start, so a layout that loaded the weights but not its optimizer's copy of them
    (a ZeRO-1 master copy, an FSDP shard) fails at step 2."""
    ref_curve, ref_params = one_process["moe" if name == "ep2" else "dense"]
    for rank in world2:
        curve, params, _ = rank[name]
        assert len(curve) == len(ref_curve) == STEPS
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(curve, ref_curve), 1):
            assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"{name} step {step}: loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= TOL * abs(ref_norm), f"{name} step {step}: grad norm {norm} vs {ref_norm}"
        assert_trained_parameters(params, ref_params, STEPS, PARAM_TOL, name)


def test_the_one_process_start_learns(one_process):
    curve = one_process["dense"][0]
    assert curve[-1][0] < curve[0][0] - 0.01, "the run should learn"


def test_exported_fine_tuned_model_gives_shardlm_logits_in_transformers(world2, models, tmp_path):
    from transformers import Qwen3ForCausalLM

    checkpoint = world2[0]["tp2"][2]
    out = to_hf(checkpoint, tmp_path / "exported")
    exported = Qwen3ForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    model, _ = load_model(checkpoint, ParallelContext.single())
    tokens = models["batch"][:, :-1]
    with torch.no_grad():
        theirs = exported(tokens).logits
        ours = model.full_logits(model(tokens))
        original = models["dense"]["model"](tokens).logits
    assert (theirs - original).abs().max() > 1000 * TOL, "the export should hold the fine-tuned weights"
    assert (ours - theirs).abs().max() < TOL


def test_start_from_the_tp2_run_checkpoint_gives_its_exports_transformers_loss(world2, models, tmp_path):
    """checkpoint.init_from a sharded checkpoint (saved at TP=2, started at TP=1): its weights, not its step."""
    from transformers import Qwen3ForCausalLM

    checkpoint = world2[0]["tp2"][2]
    exported = Qwen3ForCausalLM.from_pretrained(to_hf(checkpoint, tmp_path / "exported")).eval()
    config = run_config(checkpoint)
    losses, _ = start(ParallelContext.single(), config, steps=1)
    assert abs(losses[0] - hf_loss(exported, models["batch"])) < TOL


def test_a_rank_reads_only_its_rows_of_an_hf_tensor(models, monkeypatch):
    """A Llama-family tensor needs no conversion: a TP rank's rows are read alone, never the whole tensor."""
    from safetensors.torch import load_file

    from shardlm.checkpoint.hf_common import HFTensor
    from shardlm.checkpoint.init import open_source

    reader = open_source(models["dense"]["dir"]).reader
    monkeypatch.setattr(HFTensor, "__call__", lambda self: pytest.fail(f"read all of {self.name}"))
    rows = reader.read("model/layers.1.mlp.up.weight", 0, 32, 64)
    full = load_file(str(models["dense"]["dir"] / "model.safetensors"))["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(rows, full[32:64])
    padded = reader.read("model/wte.weight", 0, 64, 128)  # past the 100 rows: zeros (the padded vocabulary)
    assert torch.equal(padded[:36], models["dense"]["model"].model.embed_tokens.weight[64:]) and not padded[36:].any()
