"""Reward models as Hugging Face's `XForSequenceClassification` with one label (what TRL's RewardTrainer trains and
saves): the family's causal-LM directory with `score.weight` (1, h) in place of `lm_head.weight`, the class renamed
(`LlamaForSequenceClassification`, `Qwen3ForSequenceClassification`, `GPT2ForSequenceClassification`, ...), one
label, and the pad token's id, which transformers' pooling needs to find each sequence's last token. Read: such a
directory opens as its language model plus the `score.weight` source (`score_source`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shardlm.checkpoint import files
from shardlm.checkpoint.hf_common import HFTensor, weight_files
from shardlm.errors import UserError

SEQUENCE_CLASSIFICATION = "ForSequenceClassification"
SCORE = "score.weight"


def sequence_classifier(hf_config: dict) -> str | None:
    """The directory's sequence-classification class, or None when it is not one."""
    return next((a for a in hf_config.get("architectures") or [] if a.endswith(SEQUENCE_CLASSIFICATION)), None)


def score_source(hf_dir: Path, hf_config: dict) -> HFTensor | None:
    """The `score.weight` of a one-label `XForSequenceClassification` directory, or None for another class; a
    classifier of several labels (not a reward model) is a one-line error."""
    name = sequence_classifier(hf_config)
    if name is None:
        return None
    labels = len(hf_config.get("id2label") or {}) or hf_config.get("num_labels", 2)
    if labels != 1:
        raise UserError(f"{hf_dir} is a {name} with {labels} labels; a reward model has one (num_labels=1)")
    located = weight_files(hf_dir)
    if SCORE not in located:
        raise UserError(f"{hf_dir} is a {name} without the tensor {SCORE}")
    return HFTensor({}, located[SCORE], SCORE)


def classifier_name(causal: str) -> str:
    """The sequence-classification class of a causal-LM class (`Qwen3ForCausalLM`, `GPT2LMHeadModel`); a one-line
    error when transformers (where installed) has no such class."""
    name = causal.replace("ForCausalLM", SEQUENCE_CLASSIFICATION).replace("LMHeadModel", SEQUENCE_CLASSIFICATION)
    try:
        import transformers
    except ImportError:
        return name
    if not hasattr(transformers, name):
        raise UserError(f"transformers has no {name}: a reward model of this family does not export to Hugging Face")
    return name


def write_reward_model(write, score: torch.Tensor, out_dir: Path) -> Path:
    """Write a reward model as `out_dir`: `write(directory)` writes its language model there (the family's `to_hf`,
    given the tensors without the head); then the head replaces the output layer and config.json names the
    classifier. Built in a temporary sibling and renamed into place, so a failed write leaves no half directory."""
    tmp = out_dir.with_name(f".{out_dir.name}.reward.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
        hf_config = json.loads((tmp / "config.json").read_text())
        name = classifier_name(hf_config["architectures"][0])
        tensors = load_file(str(tmp / "model.safetensors"))
        tensors.pop("lm_head.weight", None)
        tensors[SCORE] = score.contiguous()
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        files.ordinary_permissions(tmp / "model.safetensors")
        hf_config |= {"architectures": [name], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
        pad = pad_token_id(tmp)
        if pad is not None:
            hf_config["pad_token_id"] = pad
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.replace(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def pad_token_id(hf_dir: Path) -> int | None:
    """The id of the pad token that the directory's tokenizer files name (tokenizer_config.json's `pad_token`),
    or None."""
    config, vocabulary = hf_dir / "tokenizer_config.json", hf_dir / "tokenizer.json"
    if not (config.is_file() and vocabulary.is_file()):
        return None
    pad = json.loads(config.read_text()).get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    if not pad:
        return None
    from shardlm.data.tokenizers import shared_tokenizer

    return shared_tokenizer(vocabulary).token_to_id(pad)
