"""DeepSeek-V4's multi-token prediction (`model.mtp_layers`, DeepSeek's `mtp.0`) against transformers' own pieces.

transformers neither builds nor saves DeepSeek-V4's MTP layer, so the reference is composed here from its modules,
as DeepSeek's inference code writes the layer (`MTPBlock.forward`): a 4-layer `DeepseekV4ForCausalLM` whose last layer
is the depth's block (an HCA layer, so the depth's own ratio is read); its layer 2's output streams, then

    streams = e_proj(enorm(embed(t_{i+1}))) on every stream + h_proj(hnorm(streams))
    logits  = lm_head(norm(hc_head(layer_3(streams))))      norm, hc_head: the depth's own (transformers' classes)

Its first 3 layers, with the depth's tensors, are written as a directory in DeepSeek's own names (`mtp.0.*`, and a
config with `compress_ratios` for the 3 layers and the depth, no `layer_types`), as DeepSeek publishes the model. The
model is `test_hf_deepseek_v4`'s tiny random one, every weight away from its initial value.

Checked: shardlm's per-token losses of the next token and of the depth equal the reference's within 1e-5; `--to-hf`
writes the depth back bitwise under DeepSeek's names (transformers loads that directory and ignores them) and the
written directory converts to the same tensors. Control: the depth read as a sliding-window layer (its ratio dropped)
moves its losses far beyond the tolerance.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_hf_deepseek_v4 import KINDS, ROW, VOCAB, hf_config, randomized

from shardlm.checkpoint import load_model
from shardlm.checkpoint.hf import from_hf, to_hf
from shardlm.checkpoint.hf_deepseek_v4 import original_name
from shardlm.models.mtp import rolled_targets
from shardlm.parallel import ParallelContext

TOL = 1e-5
HCA = "heavily_compressed_attention"
RATIOS = [8, 4, 0, 8]
"""DeepSeek's compress_ratios: the 3 layers' (KINDS), then the depth's (HCA)."""


def depth_tensors(hidden: int, streams: int) -> dict[str, torch.Tensor]:
    """The depth's own tensors besides its block, in DeepSeek's names, drawn away from any identity."""
    generator = torch.Generator().manual_seed(7)
    out = {f"mtp.0.{name}.weight": torch.rand(hidden, generator=generator) + 0.5
           for name in ("enorm", "hnorm", "norm")}
    out |= {f"mtp.0.{name}.weight": torch.randn(hidden, hidden, generator=generator) * 0.3
            for name in ("e_proj", "h_proj")}
    return out | {"mtp.0.hc_head_fn": torch.randn(streams, streams * hidden, generator=generator) * 0.3,
                  "mtp.0.hc_head_base": torch.randn(streams, generator=generator) * 0.5,
                  "mtp.0.hc_head_scale": torch.rand(1, generator=generator) + 0.5}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The 4-layer transformers model, DeepSeek's own directory of its first 3 layers and the depth, that directory
    converted, the rows and the reference per-token losses (next token, depth 1)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("deepseek_v4_mtp")
    torch.manual_seed(0)
    model = randomized(DeepseekV4ForCausalLM(hf_config(num_hidden_layers=4, layer_types=KINDS + [HCA],
                                                       mlp_layer_types=["hash_moe", "moe", "moe", "moe"])))
    model.save_pretrained(root / "four")
    own = {name.replace("model.layers.3.", "mtp.0.") if name.startswith("model.layers.3.") else original_name(name):
           value for name, value in load_file(str(root / "four" / "model.safetensors")).items()}
    extra = depth_tensors(model.config.hidden_size, model.config.hc_mult)
    (root / "own").mkdir()
    save_file(own | extra, str(root / "own" / "model.safetensors"))
    config = json.loads((root / "four" / "config.json").read_text())
    del config["layer_types"]
    config |= {"num_hidden_layers": 3, "mlp_layer_types": ["hash_moe", "moe", "moe"], "compress_ratios": RATIOS,
               "num_nextn_predict_layers": 1}
    (root / "own" / "config.json").write_text(json.dumps(config))

    tokens = torch.randint(0, VOCAB, (2, ROW + 1), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    rolled = rolled_targets(inputs, labels, 1)
    return {"root": root, "model": model, "extra": extra, "inputs": inputs, "labels": labels, "rolled": rolled,
            "converted": from_hf(root / "own", root / "model.safetensors"),
            "losses": reference_losses(model, extra, inputs, labels, rolled)}


def reference_losses(model, extra: dict, inputs, labels, rolled) -> torch.Tensor:
    """(2, B, T) per-token losses of the next token and of depth 1 (0 where the target is -100), from transformers'
    modules: the 4-layer model's layer 2 output streams, then the depth as the module docstring writes it."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead, DeepseekV4RMSNorm

    config, seen = model.config, {}
    hooks = [model.model.layers[2].register_forward_hook(lambda module, args, out: seen.update(streams=out)),
             model.model.layers[3].register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs=kwargs),
                                                             with_kwargs=True)]
    try:
        with torch.no_grad():
            model(inputs, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    norms = {name: DeepseekV4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
             for name in ("enorm", "hnorm", "norm")}
    head = DeepseekV4HyperHead(config)
    with torch.no_grad():
        for name, norm in norms.items():
            norm.weight.copy_(extra[f"mtp.0.{name}.weight"])
        for part in ("fn", "base", "scale"):
            getattr(head, f"hc_{part}").copy_(extra[f"mtp.0.hc_head_{part}"])
        streams, kwargs = seen["streams"], {k: v for k, v in seen["kwargs"].items() if k != "input_ids"}
        main = model.lm_head(model.model.norm(model.model.hc_head(streams)))
        x = (F.linear(norms["enorm"](model.model.embed_tokens(rolled[0])), extra["mtp.0.e_proj.weight"]).unsqueeze(2)
             + F.linear(norms["hnorm"](streams), extra["mtp.0.h_proj.weight"]))
        depth = model.lm_head(norms["norm"](head(model.model.layers[3](x, **kwargs))))
    return torch.stack([F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
                        for logits, targets in ((main, labels), (depth, rolled[1]))])


def shardlm_losses(converted, ref: dict) -> torch.Tensor:
    """(2, B, T) per-token losses of the converted model in one process."""
    model, config = load_model(converted, ParallelContext.single())
    inputs, targets = ref["rolled"]
    with torch.no_grad():
        return model(ref["inputs"], ref["labels"], mtp=(inputs[None], targets[None])), config


def test_next_token_and_depth_losses_equal_transformers_pieces(reference):
    losses, config = shardlm_losses(reference["converted"], reference)
    assert (config.model.mtp_layers, config.model.compress_ratios) == (1, RATIOS)
    valid = reference["rolled"][1] != -100
    assert valid.sum() == valid.numel() - 2 and reference["losses"][1][valid].min() > 0
    assert (losses - reference["losses"]).abs().max() < TOL
    assert (reference["losses"][1] - reference["losses"][0]).abs().max() > 100 * TOL  # the depth is not the main


def test_a_depth_read_as_a_sliding_layer_is_far_off(reference):
    """Control: the same weights with the depth's HCA ratio dropped (a sliding-window layer, its compressor unused)."""
    from shardlm.models import build_model

    model, config = load_model(reference["converted"], ParallelContext.single())
    sliding = build_model(replace(config.model, compress_ratios=RATIOS[:3]), ParallelContext.single())
    unused = sliding.load_state_dict(model.state_dict(), strict=False).unexpected_keys
    assert unused and all(".block.attn.compressor." in name for name in unused)
    inputs, targets = reference["rolled"]
    with torch.no_grad():
        losses = sliding(reference["inputs"], reference["labels"], mtp=(inputs[None], targets[None]))
    assert (losses[0] - reference["losses"][0]).abs().max() < TOL
    assert (losses[1] - reference["losses"][1]).abs().max() > 100 * TOL


def test_the_depth_round_trips_bitwise_and_transformers_ignores_it(reference, tmp_path):
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    out = to_hf(reference["converted"], tmp_path / "back")
    back = load_file(str(out / "model.safetensors"))
    written = json.loads((out / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1 and written["layer_types"][3] == HCA
    own = load_file(str(reference["root"] / "own" / "model.safetensors"))
    depth = {name for name in own if name.startswith("mtp.0.")}
    assert depth and depth == {name for name in back if name.startswith("mtp.")}
    for name in depth:
        assert torch.equal(back[name], own[name]), name
    loaded = DeepseekV4ForCausalLM.from_pretrained(out).eval()
    assert loaded.config.num_hidden_layers == 3 and len(loaded.model.layers) == 3
    again = from_hf(out, tmp_path / "again.safetensors")
    first, second = load_file(str(reference["converted"])), load_file(str(again))
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
