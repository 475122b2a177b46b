"""The trainer's datasets for a preference run: preference records -> tokenized pairs (KTO: unpaired examples with
their KL sequences) -> rows, with [sft]'s tokenizer, template, held-out share and shuffling
(`build_preference_datasets`)."""

from __future__ import annotations

from shardlm.config import SFTConfig
from shardlm.errors import UserError
from shardlm.preference.data import PairDataset, PairRows
from shardlm.preference.pairs import load_pairs, tokenize_pair
from shardlm.preference.unpaired import load_examples, tokenize_examples
from shardlm.sft.dataset import SFTData, held_out, run_template


def build_preference_datasets(sft: SFTConfig, seq_length: int, seed: int, init_from: str = "",
                              unpaired: bool = False, kl_group: int = 0, gold: bool = False) -> SFTData:
    """Read, split, tokenize and pack the preference records of `sft.data` (one-line UserErrors for bad input).
    `unpaired`: KTO's examples; `kl_group` > 0: with KL sequences, each split's completions rotated within groups of
    that many (`shardlm.preference.unpaired`); `gold`: each pair with its gold answer (TPO)."""
    template = run_template(sft, init_from)
    eos = template.special_tokens.get("eos_token") or template.end_of_turn
    if unpaired:
        records = load_examples(list(sft.data))
        valid_ids = held_out(len(records), sft.valid_fraction, seed)
        parts = [[r for i, r in enumerate(records) if (i in valid_ids) == held] for held in (False, True)]
        if len(parts[1]) == 1 and kl_group:
            raise UserError(f"sft.valid_fraction={sft.valid_fraction:g} holds out 1 example, and KTO estimates its KL "
                            "term from other examples' completions; raise sft.valid_fraction or set it to 0")
        splits = [tokenize_examples(template, part, eos, kl_group) if part else [] for part in parts]
        tokens = [p.prompt + p.completion for split in splits for p in split]
    else:
        pairs = [tokenize_pair(template, pair, eos) for pair in load_pairs(list(sft.data), gold)]
        valid_ids = held_out(len(pairs), sft.valid_fraction, seed)
        splits = [[p for i, p in enumerate(pairs) if (i in valid_ids) == held] for held in (False, True)]
        tokens = [p.prompt + p.chosen + p.rejected + (p.gold or []) for p in pairs]
    pad = template.special_tokens.get("pad_token") or template.end_of_turn
    pad_id = template.tokenizer.token_to_id(pad) if pad else None
    pad_id = pad_id if pad_id is not None else 0
    train = PairRows(splits[0], seq_length, pad_id, seed=seed if sft.shuffle else None, strategy=sft.packing,
                     overflow=sft.overflow)
    valid = PairRows(splits[1], seq_length, pad_id, seed=None, strategy=sft.packing,
                     overflow=sft.overflow) if splits[1] else None
    max_id = max(max(ids) for ids in tokens)
    return SFTData(PairDataset(train), PairDataset(valid, epochs=1) if valid else None, template, train.stats,
                   valid.stats if valid else None, max(max_id, pad_id))
