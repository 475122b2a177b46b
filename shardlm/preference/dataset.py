"""The trainer's datasets for a preference run: preference records -> tokenized pairs -> rows of pairs, with
[sft]'s tokenizer, template, held-out share and shuffling (`build_preference_datasets`)."""

from __future__ import annotations

from pathlib import Path

from shardlm.config import SFTConfig
from shardlm.preference.data import PairDataset, PairRows
from shardlm.preference.pairs import load_pairs, tokenize_pair
from shardlm.sft.dataset import SFTData, held_out, tokenizer_dir
from shardlm.sft.template import ChatTemplate


def build_preference_datasets(sft: SFTConfig, seq_length: int, seed: int, init_from: str = "") -> SFTData:
    """Read, split, tokenize and pack the preference records of `sft.data` (one-line UserErrors for bad input)."""
    template_source = Path(sft.template).read_text(encoding="utf-8") if sft.template else None
    template = ChatTemplate.from_dir(tokenizer_dir(sft, init_from), end_of_turn=sft.end_of_turn or None,
                                     template=template_source)
    eos = template.special_tokens.get("eos_token") or template.end_of_turn
    pairs = [tokenize_pair(template, pair, eos) for pair in load_pairs(list(sft.data))]
    valid_ids = held_out(len(pairs), sft.valid_fraction, seed)
    pad = template.special_tokens.get("pad_token") or template.end_of_turn
    pad_id = template.tokenizer.token_to_id(pad) if pad else None
    pad_id = pad_id if pad_id is not None else 0
    train = PairRows([p for i, p in enumerate(pairs) if i not in valid_ids], seq_length, pad_id,
                     seed=seed if sft.shuffle else None, strategy=sft.packing)
    valid = PairRows([p for i, p in enumerate(pairs) if i in valid_ids], seq_length, pad_id, seed=None,
                     strategy=sft.packing) if valid_ids else None
    max_id = max(max(p.prompt + p.chosen + p.rejected) for p in pairs)
    return SFTData(PairDataset(train), PairDataset(valid, epochs=1) if valid else None, template, train.stats,
                   valid.stats if valid else None, max(max_id, pad_id))
