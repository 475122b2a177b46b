"""DeepSeek Sparse Attention against transformers: DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`).

Two random tiny models, 3 layers (the first dense), 8 routed experts in 4 groups, MLA with a 24-rank query
latent, a 16-rank key/value latent and 16 + 8 query/key channels (v 12), and a lightning indexer of 32 heads
of 16 channels choosing 5 keys a query on rows of 20 tokens; GLM-5 with index_topk_freq 2, so its third layer
is "shared" (it reuses the second layer's choice). Nothing is the identity: the MLA and indexer projections
are scaled up, the indexer's k_norm has a random weight and bias, the routers and their score-correction
biases are random, the norm weights are spread (`hf_reference`).

shardlm's logits equal transformers' within 1e-4 at TP=1, TP=2 and EP=2 (one 2-rank world), greedy
generation with the KV cache gives transformers' tokens, and converting back gives transformers' tensors
bitwise. The comparison is meaningful: no compared query has a tie at its k-th indexer score (where
`torch.topk`'s order among equals would be arbitrary; checked on transformers' own scores), the same HF model
attending to every key gives logits far away, and converters that got the indexer's rotary layout wrong
(GLM-5's interleaved channels kept, DeepSeek-V3.2's half-split ones de-interleaved) move the logits far.
A training run started from the converted file or from the HF directory itself gives transformers' first loss, and
misconfigured sparse attention is refused in one line.
GLM-5 configs without indexer_types get transformers' derived per-layer kinds.
"""

from __future__ import annotations

import json

import pytest
import torch
from llama_reference import (
    LOGIT_TOL,
    PROMPT,
    assert_converted_matches,
    assert_layout_matches,
    assert_round_trip,
    hf_reference,
    layout_worker,
    variant_logits,
)

from shardlm.checkpoint.hf_deepseek import _permute_indexer, model_config_from_hf
from shardlm.checkpoint.state import load_consolidated
from shardlm.config import RunConfig, from_dict
from shardlm.errors import UserError
from shardlm.parallel import ParallelContext
from shardlm.validation import validate

from multiproc import run_workers

VOCAB, TOPK, ROW = 300, 5, 20
FAMILIES = ("deepseek_v32", "glm_moe_dsa")
INDEX_KEYS = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias")
"""The indexer tensors with rotary channels (weights_proj has none)."""


def hf_classes(family: str):
    """(config class, model class) of `family`."""
    import transformers

    if family == "deepseek_v32":
        return transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM
    return transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM


def hf_config(family: str):
    """The tiny config of `family` (GLM-5: indexer_types full, full, shared)."""
    extra = {"index_topk_freq": 2} if family == "glm_moe_dsa" else {}
    return hf_classes(family)[0](
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
        norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
        index_topk=TOPK, index_n_heads=32, index_head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=False, **extra)


def sharpened(model):
    """`model` (eval mode) with sharp attention, a sharp indexer and random routing, in place: a slip in the
    rotary layout, the key choice or the routing then moves the logits."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_b_proj.weight.mul_(8.0)
            attn.kv_a_proj_with_mqa.weight.mul_(4.0)
            attn.kv_b_proj.weight.mul_(4.0)
            if attn.indexer is not None:
                attn.indexer.wq_b.weight.mul_(4.0)
                attn.indexer.weights_proj.weight.mul_(4.0)
                attn.indexer.k_norm.weight.uniform_(0.5, 2.0)
                attn.indexer.k_norm.bias.uniform_(-0.5, 0.5)
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.6)
                layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return model.eval()


def indexers(model) -> list:
    """The indexers of `model`'s "full" layers (GLM-5's "shared" layers have none)."""
    return [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]


def indexers_choose(model, k: int):
    """`model` with each indexer choosing `k` keys a query (in place)."""
    for indexer in indexers(model):
        indexer.index_topk = k
    return model


def attending_to_every_key(model):
    """`model` with each indexer's top-k above every row's length (in place): dense attention."""
    return indexers_choose(model, 10 * ROW)


def hf_index_scores(model, family: str, tokens: torch.Tensor) -> list[torch.Tensor]:
    """transformers' indexer scores of `tokens` (B, T) in each full layer of `model`: (B, T, T) fp32, recomputed
    from the indexer's weights and the inputs it received (hidden states, query latent, cos/sin), with the rotary
    embedding of the family's modeling code (half-split in DeepSeek-V3.2, interleaved in GLM-5); invisible (later)
    keys -inf."""
    import sys

    inputs, hooks = [], []
    for indexer in indexers(model):
        hooks.append(indexer.register_forward_pre_hook(lambda m, args, kwargs: inputs.append((m, args)),
                                                       with_kwargs=True))
    try:
        with torch.no_grad():
            model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    code = sys.modules[type(model).__module__]
    rotate = code.apply_rotary_pos_emb if family == "deepseek_v32" else code.apply_rotary_pos_emb_interleave
    out = []
    with torch.no_grad():
        for indexer, (hidden, q_latent, (cos, sin), *_) in inputs:
            B, T, _ = hidden.shape
            rope = indexer.qk_rope_head_dim
            q = indexer.wq_b(q_latent).view(B, T, indexer.n_heads, indexer.head_dim)
            k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
            q_rot, k_rot = rotate(q[..., :rope], k[..., :rope], cos, sin, unsqueeze_dim=2)
            q, k = torch.cat((q_rot, q[..., rope:]), -1).float(), torch.cat((k_rot, k[..., rope:]), -1)[:, :, 0].float()
            per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, k) * indexer.softmax_scale)
            weights = indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5
            scores = torch.einsum("bths,bth->bts", per_head, weights)
            out.append(scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")))
    return out


def top_k_margin(scores: torch.Tensor, k: int) -> float:
    """scores (B, T, T) with invisible keys -inf -> the smallest gap between the k-th and (k+1)-th highest
    visible score over every query that sees more than k keys, relative to the largest score's magnitude."""
    visible = torch.isfinite(scores).sum(-1)
    ranked = scores.sort(dim=-1, descending=True).values
    gaps = (ranked[..., k - 1] - ranked[..., k])[visible > k]
    return (gaps.min() / scores[torch.isfinite(scores)].abs().max()).item()


def training_batch() -> torch.Tensor:
    """The first (BATCH, T + 1) batch of the training run of `test_a_run_started_from_the_directory...`."""
    from test_hf_start import BATCH
    from test_training import synthetic_data

    from shardlm.training.data import micro_batches

    return micro_batches(synthetic_data(), 0, BATCH, BATCH, 0, 1, torch.device("cpu"))[0]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Per family: `hf_reference` (saved directory, converted file, logits, greedy tokens), the model, and the
    logits of the same model attending to every key (its indexers' top-k above the row length)."""
    out = {"tokens": torch.randint(0, VOCAB, (2, ROW), generator=torch.Generator().manual_seed(1))}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = sharpened(hf_classes(family)[1](hf_config(family)))
        ref = hf_reference(model, tmp_path_factory.mktemp(family), out["tokens"], norm_seed=1)
        with torch.no_grad():
            ref["dense_logits"] = attending_to_every_key(model)(out["tokens"]).logits
        indexers_choose(model, TOPK)
        out[family] = ref | {"model": model}
    return out


@pytest.fixture(scope="module")
def world2(hf_models):
    """TP=2 and EP=2 logits and greedy tokens of each converted model (`layout_checks`), in one 2-rank world."""
    paths = {family: hf_models[family]["converted"] for family in FAMILIES}
    return run_workers(2, layout_worker, paths, hf_models["tokens"], timeout=300)


@pytest.mark.parametrize("family", FAMILIES)
def test_conversion_reads_the_indexer(hf_models, family):
    config, tensors = load_consolidated(hf_models[family]["converted"])
    m = config.model
    assert (m.attention, m.q_lora_rank, m.kv_lora_rank, m.v_head_dim) == ("mla", 24, 16, 12)
    assert (m.index_topk, m.index_heads, m.index_head_dim) == (TOPK, 32, 16)
    assert m.index_layer_types == ([] if family == "deepseek_v32" else ["full", "full", "shared"])
    assert (m.moe_num_experts, m.moe_groups, m.moe_topk_groups, m.moe_first_dense_layers) == (8, 4, 2, 1)
    has_indexer = [f"model/layers.{i}.attn.indexer.wq_b.weight" in tensors for i in range(3)]
    assert has_indexer == [True, True, family == "deepseek_v32"]
    assert tensors["model/layers.1.attn.indexer.wq_b.weight"].shape == (32 * 16, 24)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_compared_query_has_a_tie_at_its_kth_score(hf_models, family):
    """transformers' indexer scores of every compared row (the reference rows, the prompts with their greedy
    continuations, the training batch): each query's k-th and (k+1)-th visible scores differ by more than
    1e-5 of the layer's largest score (shardlm's scores agree with these within about 1e-6 of it), so
    `torch.topk`'s order among equals decides nothing and rounding cannot swap them."""
    ref = hf_models[family]
    greedy = torch.cat((ref["tokens"][:, :PROMPT], torch.tensor(ref["greedy"])), dim=1)
    for rows in (ref["tokens"], greedy, training_batch()[:, :-1]):
        scores = hf_index_scores(ref["model"], family, rows)
        assert len(scores) == (3 if family == "deepseek_v32" else 2)
        margins = [top_k_margin(layer, TOPK) for layer in scores]
        assert min(margins) > 1e-5, margins


def test_few_indexer_heads_tie_and_the_tie_check_sees_it():
    """Control of the tie check: with one indexer head most ReLU scores are 0, so queries tie at their k-th
    score and `top_k_margin` is 0."""
    config = hf_config("deepseek_v32")
    config.index_n_heads = 1
    torch.manual_seed(0)
    model = sharpened(hf_classes("deepseek_v32")[1](config))
    tokens = torch.randint(0, VOCAB, (2, ROW), generator=torch.Generator().manual_seed(1))
    assert [top_k_margin(layer, TOPK) for layer in hf_index_scores(model, "deepseek_v32", tokens)] == [0.0] * 3


@pytest.mark.parametrize("family", FAMILIES)
def test_the_choice_of_keys_matters(hf_models, family):
    """The same HF model attending to every key gives logits more than 100 x LOGIT_TOL from the sparse ones."""
    ref = hf_models[family]
    moved = (ref["dense_logits"] - ref["logits"]).abs().max().item()
    assert moved > 100 * LOGIT_TOL, moved


@pytest.mark.parametrize("family", FAMILIES)
def test_tp1_logits_and_greedy_tokens_match_transformers(hf_models, family):
    assert_converted_matches(hf_models[family])


@pytest.mark.parametrize("layout", ["tp2", "ep2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_logits_and_greedy_tokens_match_transformers(world2, hf_models, layout, family):
    assert_layout_matches(world2, f"{layout} {family}", hf_models[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_to_hf_is_bitwise_and_loads_in_transformers(hf_models, family, tmp_path):
    assert_round_trip(hf_models[family], tmp_path / "back", hf_classes(family)[1])
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["model_type"] == family
    assert written["architectures"] == [hf_classes(family)[1].__name__]
    assert (written["index_topk"], written["index_n_heads"], written["index_head_dim"]) == (TOPK, 32, 16)
    if family == "glm_moe_dsa":
        assert written["indexer_types"] == ["full", "full", "shared"]
    else:
        assert "indexer_types" not in written


def test_a_warm_up_checkpoint_exports_with_a_note(hf_models, tmp_path, capsys):
    """A checkpoint of the dense warm-up stage (`index_stage = "warmup"`: dense attention in shardlm) is written as the
    sparse model it is being trained toward, and says so on stderr; the sparse stage writes no note."""
    import dataclasses

    from shardlm.checkpoint.files import write_consolidated
    from shardlm.checkpoint.hf import to_hf
    from shardlm.checkpoint.state import load_consolidated

    config, tensors = load_consolidated(hf_models["deepseek_v32"]["converted"])
    to_hf(hf_models["deepseek_v32"]["converted"], tmp_path / "sparse")
    assert "warm-up" not in capsys.readouterr().err
    config.model = dataclasses.replace(config.model, index_stage="warmup")
    write_consolidated(tmp_path / "warmup.safetensors", tensors, dataclasses.asdict(config))
    to_hf(tmp_path / "warmup.safetensors", tmp_path / "warmup")
    assert "dense warm-up stage" in capsys.readouterr().err
    assert (tmp_path / "warmup" / "config.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_indexer_rotary_layout_is_the_familys(hf_models, family, tmp_path):
    """Control: GLM-5's indexer interleaves its rotary channels, DeepSeek-V3.2's does not. A converter that kept
    GLM-5's channels as stored (the de-interleaving undone on the converted indexer tensors), or that
    de-interleaved DeepSeek-V3.2's too, moves the logits by more than 100 times the tolerance."""
    ref = hf_models[family]
    config, _ = load_consolidated(ref["converted"])

    def wrong_layout(tensors):
        for name, value in tensors.items():
            if ".attn.indexer." in name and name.endswith(INDEX_KEYS):
                tensors[name] = _permute_indexer(value, config.model, name, inverse=family == "glm_moe_dsa")
        return tensors

    logits = variant_logits(ref, tmp_path / "wrong.safetensors", change_tensors=wrong_layout)
    moved = (logits - ref["logits"]).abs().max().item()
    assert moved > 100 * LOGIT_TOL, moved


@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_started_from_the_directory_gives_transformers_first_loss(hf_models, family):
    """`checkpoint.init_from` = the converted file, and the HF directory itself (read in place), [model] left
    empty: the first step's loss is transformers' mean next-token loss on the same batch (within 1e-5 relative)."""
    from test_hf_start import hf_loss, run_config, started_run

    ref = hf_models[family]
    expected = hf_loss(ref["model"], training_batch())
    dense = hf_loss(attending_to_every_key(ref["model"]), training_batch())
    indexers_choose(ref["model"], TOPK)
    assert abs(dense - expected) > 10 * 1e-5 * expected, (dense, expected)  # the choice shows in the loss
    run = started_run(ParallelContext.single(), run_config(ref["converted"]), steps=1)
    first = run["curve"][0][0]
    assert abs(first - expected) <= 1e-5 * expected, (first, expected)
    in_place = started_run(ParallelContext.single(), run_config(ref["root"] / "hf"), steps=1)
    assert abs(in_place["curve"][0][0] - expected) <= 1e-5 * expected, (in_place["curve"][0][0], expected)


def test_sparse_attention_needs_mla_in_one_line():
    config = from_dict({"model": {"attention": "mha", "index_topk": 4, "index_heads": 2, "index_head_dim": 8},
                        "data": {"text_file": "unused"}})
    with pytest.raises(UserError, match="model.index_topk") as error:
        validate(config, 1, check_paths=False)
    assert "\n" not in str(error.value)


def test_a_first_shared_indexer_layer_is_refused_in_one_line():
    """GLM-5's first layer must run its own indexer (a "shared" layer reuses an earlier layer's choice): refused
    in one line when converting (naming indexer_types) and in a shardlm config (naming index_layer_types)."""
    hf = hf_config("glm_moe_dsa").to_dict() | {"indexer_types": ["shared", "full", "full"]}
    with pytest.raises(UserError, match="indexer_types") as error:
        model_config_from_hf(hf)
    assert "\n" not in str(error.value)
    config = RunConfig(model=model_config_from_hf(hf_config("glm_moe_dsa").to_dict()))
    config.model.index_layer_types = ["shared", "full", "full"]
    with pytest.raises(UserError, match="index_layer_types") as error:
        validate(config, 1, check_paths=False)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("keys", [{"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                                  {"index_topk_pattern": "FSFSS"}, {}])
def test_glm_indexer_types_are_derived_as_transformers_derives_them(keys):
    """A GLM-5 config.json without indexer_types: the per-layer kinds come from index_topk_pattern, or
    index_topk_freq and index_skip_topk_offset, as transformers' GlmMoeDsaConfig derives them."""
    from transformers import GlmMoeDsaConfig

    theirs = GlmMoeDsaConfig(num_hidden_layers=5, **keys).indexer_types
    hf = {k: v for k, v in hf_config("glm_moe_dsa").to_dict().items() if k not in ("indexer_types", "index_topk_freq")}
    assert model_config_from_hf(hf | keys | {"num_hidden_layers": 5}).index_layer_types == theirs
    assert len(set(theirs)) == (1 if not keys else 2)
