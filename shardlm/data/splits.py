"""Parsing the `data.prefixes` and `data.split` settings, and splitting documents by weight."""

from __future__ import annotations

from pathlib import Path

from shardlm.errors import UserError

SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str | tuple[float, ...] | list[float]) -> tuple[float, float, float]:
    """"949,50,1" (or "98/1/1", or a sequence) -> normalised weights (train, valid, test) summing to 1.

    Fewer than three values are padded with zeros ("1" = everything in train).
    """
    if isinstance(split, str):
        parts = [p for p in split.replace("/", ",").split(",") if p.strip()]
        try:
            values = [float(p) for p in parts]
        except ValueError as exc:
            raise UserError(f"data.split={split!r} is not numbers; write it like \"949,50,1\"") from exc
    else:
        values = [float(v) for v in split]
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or sum(values) <= 0:
        raise UserError(f"data.split={split!r} needs 1-3 non-negative weights with a positive sum, "
                        "like \"949,50,1\"")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return (values[0] / total, values[1] / total, values[2] / total)


def split_document_ranges(num_documents: int, weights: tuple[float, float, float]) -> list[tuple[int, int]]:
    """Contiguous document ranges [start, end) for train, valid, test in proportion to `weights`.

    Boundaries are the rounded cumulative weights times `num_documents`, so the three ranges tile
    [0, num_documents) exactly.
    """
    bounds = [0]
    cumulative = 0.0
    for weight in weights:
        cumulative += weight
        bounds.append(int(round(cumulative * num_documents)))
    bounds[-1] = num_documents
    return [(bounds[k], bounds[k + 1]) for k in range(3)]


def parse_data_prefixes(data_prefixes: list | tuple | str) -> list[tuple[float, str]]:
    """`[prefix]` or `[w1, prefix1, w2, prefix2, ...]` -> [(normalised weight, prefix), ...]."""
    if isinstance(data_prefixes, (str, Path)):
        data_prefixes = [data_prefixes]
    items = [str(item) for item in data_prefixes]
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) == 0 or len(items) % 2:
        raise UserError(f"data.prefixes={items} must be [prefix] or [weight1, prefix1, weight2, prefix2, ...]")
    pairs = []
    for k in range(0, len(items), 2):
        try:
            weight = float(items[k])
        except ValueError as exc:
            raise UserError(f"data.prefixes entry {items[k]!r} should be a weight before {items[k + 1]!r}; "
                            "write [weight1, prefix1, weight2, prefix2, ...]") from exc
        if weight < 0:
            raise UserError(f"data.prefixes weight {weight} for {items[k + 1]} must be non-negative")
        pairs.append((weight, items[k + 1]))
    total = sum(weight for weight, _ in pairs)
    if total <= 0:
        raise UserError(f"data.prefixes={items} has no positive weight")
    return [(weight / total, prefix) for weight, prefix in pairs if weight > 0]
