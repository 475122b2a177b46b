"""The reference model's log-probabilities precomputed over the data set (`preference.reference =
"precomputed"`): one pass of the starting weights over every training pair before the first step, at the run's
layout, saved in the run directory so a resumed run reads them instead of recomputing them from weights it no
longer has. Each table is saved with a fingerprint of the pairs it scores (`pairs_fingerprint`), so a resumed run
whose data changed (other records, another order, another held-out draw) is refused even at the same pair count,
instead of training against the log-probabilities of other pairs. The pass announces itself in one line and
shows a progress bar (rows done, time left) on the main rank, as the training steps do (`log.progress`)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from shardlm.errors import UserError
from shardlm.preference.data import empty_row
from shardlm.preference.loss import preference_parts, sequence_logps

FILE = "reference_logps.safetensors"


def precompute_references(trainer, datasets: dict) -> dict[str, torch.Tensor]:
    """`precompute_reference` of each split of `datasets` ({"train": PairDataset, "valid": ...}, None skipped),
    announced in one line and counted by one progress bar over all their rows."""
    datasets = {split: data for split, data in datasets.items() if data is not None}
    rows = {split: len(data.rows.plan(0)) for split, data in datasets.items()}
    ctx, log = trainer.ctx, trainer.config.log
    if ctx.is_main:
        pairs = " and ".join(f"{data.num_pairs} {split}" for split, data in datasets.items())
        unit = next(iter(datasets.values())).rows.stats.unit
        tqdm.write(f"preference: computing the reference log-probabilities of {pairs} {unit} ({sum(rows.values())} "
                   "rows, one forward pass each) with the starting weights, before the first step")
    with tqdm(total=sum(rows.values()), desc="reference", unit="row", dynamic_ncols=True, leave=False,
              disable=not (ctx.is_main and log.progress)) as bar:
        return {split: precompute_reference(trainer, data, bar) for split, data in datasets.items()}


@torch.no_grad()
def precompute_reference(trainer, dataset, bar: tqdm | None = None) -> torch.Tensor:
    """(pairs, 2) fp64 log-probabilities of every pair of `dataset` (a `PairDataset`) under `trainer.model` as it
    is now: epoch 0's rows (which hold every kept pair once) in micro-batches over the DP ranks, summed over DP
    (and over the pipeline group, whose last stage alone computes them: the micro-batches go through the stages
    a step's worth at a time). Every rank runs as many forwards (the last ones on empty rows where the rows run
    out): FSDP's gathers and the experts' all-to-all need every rank of their groups. `bar` (a progress bar) is
    advanced by the rows done, over all DP ranks."""
    ctx, t = trainer.ctx, trainer.config.train
    table = torch.zeros(dataset.num_pairs, 2, dtype=torch.float64, device=ctx.device)
    rows = len(dataset.rows.plan(0))
    per_step = t.micro_batch_size * ctx.dp_size
    starts = list(range(0, -(-rows // per_step) * per_step, per_step))

    def part(start: int) -> dict:
        first = start + ctx.dp_rank * t.micro_batch_size  # this DP rank's rows of the step, as training reads them
        batch = _stacked([_epoch0_row(dataset, rows, first + j) for j in range(t.micro_batch_size)], ctx.device)
        return preference_parts([batch], ctx, count_pairs=False, ld_alpha=trainer.config.preference.ld_alpha)[0]

    def record(token_losses: torch.Tensor, part: dict) -> None:
        logps = sequence_logps(token_losses, part, ctx.cp)[0]
        if "kl" in part:  # KTO: the example's sequence (side 0) is column 0
            table[part["pairs"], 0] = logps[:, 0]
        else:
            table[part["pairs"]] = logps

    def record_kl(token_losses: torch.Tensor, part: dict) -> None:  # KTO: its KL sequence is column 1
        table[part["pairs"], 1] = sequence_logps(token_losses, part, ctx.cp)[0][:, 0]

    def advance(steps: list[int]) -> None:
        if bar is not None:
            bar.update(sum(min(per_step, rows - start) for start in steps))

    trainer.model.eval()
    squares, trainer.model.log_sum_sq = trainer.model.log_sum_sq, None  # (WPO's: the policy's, in training only)
    with trainer.autocast():
        if trainer.pipeline is None:
            for start in starts:
                batch = part(start)
                record(trainer.model(batch["inputs"], batch["targets"], documents=batch["documents"]), batch)
                if "kl" in batch:
                    kl = batch["kl"]
                    record_kl(trainer.model(kl["inputs"], kl["targets"], documents=kl["documents"]), kl)
                advance([start])
        else:
            group = trainer.accumulation
            for i in range(0, len(starts), group):
                parts = [part(s) for s in starts[i:i + group]]
                trainer.pipeline.reference_pass(parts, record, contextlib.nullcontext())
                if "kl" in parts[0]:
                    trainer.pipeline.reference_pass([p["kl"] for p in parts], record_kl, contextlib.nullcontext())
                advance(starts[i:i + group])
    trainer.model.train()
    trainer.model.log_sum_sq = squares
    ctx.dp.all_reduce(table)
    if ctx.pp_size > 1:
        ctx.pp.all_reduce(table)
    return table


def _epoch0_row(dataset, rows: int, index: int) -> dict[str, np.ndarray]:
    """Row `index` of epoch 0 of a `PairDataset` (`rows` rows), or an empty row (no pair) past its end, to fill the
    last micro-batches."""
    if index < rows:
        return dataset[index]
    return empty_row(dataset.rows.seq_length, dataset.rows.pad_id, dataset.rows.with_kl)


def _stacked(rows: list[dict[str, np.ndarray]], device: torch.device) -> dict[str, torch.Tensor]:
    """Rows (dicts of (T,) arrays) -> one micro-batch: a dict of (rows, T) int64 tensors on `device`."""
    return {key: torch.from_numpy(np.stack([row[key] for row in rows])).to(device) for key in rows[0]}


def pairs_fingerprint(dataset) -> str:
    """sha256 of a split's tokenized pairs in their order (each pair's prompt, chosen and rejected ids; a KTO
    example's prompt, completion, KL completion and label): what its reference table was computed for (`dataset`: a
    `PairDataset`)."""
    digest = hashlib.sha256()
    for pair in dataset.rows.pairs:
        for ids in pair.parts:
            digest.update(np.asarray(ids, dtype=np.int64).tobytes())
            digest.update(b";")
    return digest.hexdigest()


def save_reference(tables: dict[str, torch.Tensor], run_dir: Path, fingerprints: dict[str, str],
                   ld_alpha: float = 1.0) -> Path:
    """Write the tables ({"train": (pairs, 2), "valid": ...}) to the run directory's FILE (atomically), each with its
    split's `pairs_fingerprint` in the file's metadata, and the LD-DPO weight they were summed with."""
    path = Path(run_dir) / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    save_file({f"{split}_reference_logps": table.cpu().contiguous() for split, table in tables.items()}, str(tmp),
              metadata={f"{split}_pairs_sha256": fingerprints[split] for split in tables}
              | {"ld_alpha": repr(ld_alpha)})
    tmp.replace(path)
    return path


def load_reference(run_dir: Path, pairs: dict[str, int], fingerprints: dict[str, str],
                   ld_alpha: float = 1.0) -> dict[str, torch.Tensor]:
    """The tables `save_reference` wrote, each checked against its split's pair count (`pairs`) and the fingerprint
    of its pairs (`fingerprints`; a file saved without fingerprints is checked by the counts alone), and the file
    against the run's LD-DPO weight."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: a preference run resumed with preference.reference=\"precomputed\" reads "
                        "the reference log-probabilities its first start saved there")
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as file:
        saved = file.metadata() or {}
    if float(saved.get("ld_alpha", "1.0")) != ld_alpha:
        raise UserError(f"{path} holds reference log-probabilities summed with preference.ld_alpha="
                        f"{float(saved['ld_alpha']):g}, this run's is {ld_alpha:g}: the setting changed since its "
                        "first start; restore it or start a new run directory")
    tables = {}
    for split, count in pairs.items():
        table = tensors.get(f"{split}_reference_logps")
        if table is None or table.shape != (count, 2):
            held = "none" if table is None else table.shape[0]
            raise UserError(f"{path} holds {held} {split} pairs' reference log-probabilities; the data has {count}: "
                            "the run's data or sft.valid_fraction changed since its first start")
        if saved.get(f"{split}_pairs_sha256", fingerprints[split]) != fingerprints[split]:
            raise UserError(f"{path} holds the reference log-probabilities of other {split} pairs than the data's "
                            f"{count} (their tokens differ): the run's records, their order or train.seed changed "
                            "since its first start")
        tables[split] = table
    return tables
