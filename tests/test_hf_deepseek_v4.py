"""DeepSeek-V4 against transformers' DeepseekV4ForCausalLM (`deepseek_v4`), on a tiny random model.

3 layers: an HCA layer (entries of 8 tokens), a CSA layer (entries of 4 tokens with overlapping windows, an indexer
of 32 heads of 16 channels keeping 3 entries a query) and a sliding-only one, all with a 6-token window, 4 heads
of 32 channels (8 rotary), a 24-rank query latent, 2 output groups of rank 12, 3 hyper-connection streams, 8
experts (top 2) with one shared expert and a swiglu clip of 1, the first layer hash-routed. Nothing is the identity:
every weight is scaled up, norms, sinks, position biases, hyper-connection weights and score-correction biases are
random, the hash table is a random choice of 2 experts per token (`randomized`).

shardlm's logits equal transformers' within 1e-4 and its greedy tokens are transformers' at TP=1,
TP=2 and EP=2 (one world of 2), converting back is bitwise, and a run started from the converted file gives
transformers' first loss. Controls: the indexer's choice and the hash table move the logits far, and what shardlm
does not build is refused in one line.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    PROMPT,
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    assert_router_without_bias_exports,
    hf_reference,
    layout_worker,
    variant_logits,
)

from shardlm.checkpoint.hf_deepseek_v4 import model_config_from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext

from multiproc import run_workers

VOCAB, ROW, TOPK = 300, 20, 3
KINDS = ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"]


def hf_config(**changes):
    from transformers import DeepseekV4Config

    keys = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                num_attention_heads=4, head_dim=32, q_lora_rank=24, partial_rotary_factor=0.25, num_experts_per_tok=2,
                n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5, max_position_embeddings=64,
                layer_types=KINDS, compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                mlp_layer_types=["hash_moe", "moe", "moe"], hc_mult=3, sliding_window=6, o_groups=2, o_lora_rank=12,
                index_n_heads=32, index_head_dim=16, index_topk=TOPK, rope_theta=500.0, compress_rope_theta=2000.0,
                swiglu_limit=1.0, rms_norm_eps=1e-5)
    return DeepseekV4Config(**(keys | changes))


def randomized(model):
    """`model` (eval mode) with every weight away from its initial value, in place (module docstring)."""
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and ("norm" in name or "scale" in name):
                param.copy_(torch.rand(param.shape, generator=generator) + 0.5)
            elif param.dim() == 1 or name.endswith("position_bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
            elif name.endswith(".fn") or name.endswith("hc_fn"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
            else:
                param.mul_(8.0)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.stack([torch.randperm(8, generator=generator)[:2] for _ in range(VOCAB)]))
            else:
                gate.e_score_correction_bias.uniform_(-0.3, 0.3, generator=generator)
    return model.eval()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`hf_reference` of the randomized model (norm weights spread again by it), with the model."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = randomized(DeepseekV4ForCausalLM(hf_config()))
    tokens = torch.randint(0, VOCAB, (2, ROW), generator=torch.Generator().manual_seed(1))
    return hf_reference(model, tmp_path_factory.mktemp("deepseek_v4"), tokens, norm_seed=1) | {"model": model}


@pytest.fixture(scope="module")
def world2(reference):
    """TP=2 and EP=2 logits and greedy tokens of the converted model, in one 2-rank world."""
    return run_workers(2, layout_worker, {"v4": reference["converted"]}, reference["tokens"], timeout=300)


def test_conversion_reads_every_piece(reference):
    config, tensors = load_consolidated(reference["converted"])
    m = config.model
    assert (m.hc_mult, m.compress_ratios, m.index_topk, m.moe_hash_layers, m.moe_score) == (
        3, [8, 4, 0], TOPK, 1, "sqrtsoftplus")
    assert (m.output_groups, m.output_rank, m.swiglu_clip, m.global_rope_theta) == (2, 12, 1.0, 2000.0)
    assert "model/layers.1.attn.indexer.q_b" in tensors and "model/layers.0.attn.indexer.q_b" not in tensors
    assert "model/layers.2.attn.compressor.kv" not in tensors
    table = tensors["model/layers.0.mlp.router.tid2eid"]
    assert torch.equal(table.long(), reference["model"].model.layers[0].mlp.gate.tid2eid)


def index_scores(model, rows: torch.Tensor) -> torch.Tensor:
    """The CSA layer's index scores (B, T, W) of `rows` in shardlm's `model` (equal to transformers' here: the
    logits agree within 1e-4), from the inputs its indexer received."""
    seen = []
    indexer = model.layers["1"].attn.indexer
    hook = indexer.register_forward_pre_hook(lambda module, args: seen.append(args))
    try:
        with torch.no_grad():
            model(rows)
    finally:
        hook.remove()
    return indexer.scores(*seen[0])


def test_no_compared_query_has_a_tie_at_its_kth_score(reference):
    """Every compared row (the reference rows, the prompts with their greedy continuations, the training batch):
    each query with more than k complete entries has its k-th and (k+1)-th index scores more than 1e-5 of the
    largest score apart, so `torch.topk`'s order among equals decides nothing."""
    from test_hf_sparse_attention import training_batch

    from shardlm.checkpoint import load_model

    model, _ = load_model(reference["converted"], ParallelContext.single())
    greedy = torch.cat((reference["tokens"][:, :PROMPT], torch.tensor(reference["greedy"])), dim=1)
    for rows in (reference["tokens"], greedy, training_batch()[:, :-1]):
        scores = index_scores(model, rows)
        ranked = scores.sort(dim=-1, descending=True).values
        over_k = torch.isfinite(scores).sum(-1) > TOPK
        gaps = (ranked[..., TOPK - 1] - ranked[..., TOPK])[over_k]
        assert over_k.any() and gaps.min() > 1e-5 * scores[torch.isfinite(scores)].abs().max(), gaps.min()
    model.layers["1"].attn.indexer.weights_proj.data.zero_()  # control: every score 0, so the check sees ties
    scores = index_scores(model, reference["tokens"])
    ranked = scores.sort(dim=-1, descending=True).values
    assert ((ranked[..., TOPK - 1] - ranked[..., TOPK])[torch.isfinite(scores).sum(-1) > TOPK] == 0).any()


def test_tp1_logits_and_greedy_tokens_match_transformers(reference):
    assert_converted_matches(reference)


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, reference, layout):
    assert_layout_matches(world2, f"{layout} v4", reference)


def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(reference, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    assert_round_trip(reference, tmp_path / "back", DeepseekV4ForCausalLM)
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (written["layer_types"], written["mlp_layer_types"]) == (KINDS, ["hash_moe", "moe", "moe"])


def test_a_router_trained_without_its_bias_exports_with_a_zero_one(reference, tmp_path):
    from transformers import DeepseekV4ForCausalLM

    assert_router_without_bias_exports(reference, tmp_path, DeepseekV4ForCausalLM)


def test_deepseek_own_names_convert_to_the_same_tensors(reference, tmp_path):
    """A directory in DeepSeek's own names (no `model.` prefix; embed, norm, hc_head_fn at the top, and a piece of
    an mtp layer without its projections, which is left out) converts to the tensors of the directory transformers
    saved. (A whole depth converts: `test_hf_deepseek_v4_mtp`.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    from shardlm.checkpoint.hf_deepseek_v4 import open_hf, original_name

    saved = reference["root"] / "hf"
    tensors = {original_name(name): value for name, value in load_file(str(saved / "model.safetensors")).items()}
    (tmp_path / "own").mkdir()
    save_file(tensors | {"mtp.0.norm.weight": torch.ones(32)}, str(tmp_path / "own" / "model.safetensors"))
    shutil.copy(saved / "config.json", tmp_path / "own" / "config.json")
    assert "embed.weight" in tensors and "hc_head_fn" in tensors and "layers.1.attn.indexer.wq_b.weight" in tensors
    _, theirs = open_hf(saved)
    _, own = open_hf(tmp_path / "own")
    assert own.keys() == theirs.keys()
    for name in own:
        assert torch.equal(own[name](), theirs[name]()), name


def test_the_indexer_choice_and_the_hash_table_matter(reference, tmp_path):
    """Controls: shardlm's CSA layer keeping every entry (its indexer's top-k above the entries), or another hash
    table (each token sent to experts 0 and 1), moves the logits far beyond the tolerance."""
    from shardlm.checkpoint import load_model

    model, _ = load_model(reference["converted"], ParallelContext.single())
    model.layers["1"].attn.indexer.topk = 10 * ROW
    with torch.no_grad():
        every_entry = model.full_logits(model(reference["tokens"]))
    assert (every_entry - reference["logits"]).abs().max() > 100 * LOGIT_TOL

    def other_table(tensors):
        tensors["model/layers.0.mlp.router.tid2eid"] = torch.tensor([[0.0, 1.0]]).expand(VOCAB, 2).contiguous()

    hashed = variant_logits(reference, tmp_path / "hash.safetensors", change_tensors=other_table)
    assert (hashed - reference["logits"]).abs().max() > 100 * LOGIT_TOL


def test_yarn_on_the_compressed_layers_matches_transformers(tmp_path):
    """YaRN (factor 4 over 8 original positions) scales the compressed layers' rotary only, cos and sin unscaled:
    logits within 1e-4 of transformers, and the round trip gives transformers' logits bitwise. Control: the same
    file read without YaRN moves the logits far."""
    from transformers import DeepseekV4ForCausalLM

    from shardlm.checkpoint import load_model
    from shardlm.checkpoint.hf import from_hf, to_hf
    from shardlm.models.compressed_attention import CompressedAttention, Compressor, inverse_frequencies

    torch.manual_seed(0)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}
    model = randomized(DeepseekV4ForCausalLM(hf_config(rope_parameters=yarn)))
    tokens = torch.randint(0, VOCAB, (2, ROW), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = model(tokens).logits
    converted = from_hf(tmp_path / "hf", tmp_path / "yarn.safetensors")
    ours, _ = load_model(converted, ParallelContext.single())
    assert (ours.cfg.rope_yarn_factor, ours.cfg.rope_yarn_original_positions) == (4.0, 8)
    with torch.no_grad():
        assert (ours.full_logits(ours(tokens)) - expected).abs().max() < LOGIT_TOL
    reloaded = DeepseekV4ForCausalLM.from_pretrained(to_hf(converted, tmp_path / "back")).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, expected)
    plain = inverse_frequencies(replace(ours.cfg, rope_yarn_factor=0.0), True)
    for module in ours.modules():  # the compressing layers and their compressors without YaRN
        if isinstance(module, Compressor) or isinstance(module, CompressedAttention) and module.compressor is not None:
            module.inv_freq = plain
    with torch.no_grad():
        assert (ours.full_logits(ours(tokens)) - expected).abs().max() > 100 * LOGIT_TOL


def test_a_run_started_from_the_file_or_directory_gives_transformers_first_loss(reference):
    from test_hf_sparse_attention import training_batch
    from test_hf_start import hf_loss, run_config, started_run

    expected = hf_loss(reference["model"], training_batch())
    for source in (reference["converted"], reference["root"] / "hf"):  # the file, and the directory read in place
        run = started_run(ParallelContext.single(), run_config(source), steps=1)
        first = run["curve"][0][0]
        assert abs(first - expected) <= 1e-5 * expected, (source, first, expected)


@pytest.mark.parametrize("change, words", [
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe"]}, "hash_moe layers after"),
    ({"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 4}}, "CSA windows"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
                          "compress": {"rope_type": "default", "rope_theta": 2000.0, "partial_rotary_factor": 0.5}}},
     "one rotary width"),
    ({"swiglu_limit": 0.0}, "swiglu_limit <= 0"),
])
def test_what_shardlm_does_not_compute_is_refused_in_one_line(change, words):
    with pytest.raises(UserError, match=words) as error:
        model_config_from_hf(hf_config().to_dict() | change)
    assert "\n" not in str(error.value)


def test_packed_rows_equal_their_documents_one_by_one(reference):
    """A row packing documents of 9 and 11 tokens gives each document's logits as the document alone does (its
    windows, entries and positions start at its first token); without the documents the second one's differ."""
    from shardlm.checkpoint import load_model
    from shardlm.models.documents import Documents

    model, _ = load_model(reference["converted"], ParallelContext.single())
    tokens = reference["tokens"][:1]
    positions = torch.cat((torch.arange(9), torch.arange(11))).unsqueeze(0)
    with torch.no_grad():
        packed = model.full_logits(model(tokens, documents=Documents.from_positions(positions)))
        alone = torch.cat([model.full_logits(model(part)) for part in (tokens[:, :9], tokens[:, 9:])], dim=1)
        unpacked = model.full_logits(model(tokens))
    assert (packed - alone).abs().max() < 1e-5
    assert (unpacked[:, 9:] - alone[:, 9:]).abs().max() > 100 * LOGIT_TOL
