"""Data for supervised fine-tuning (SFT) of chat models: records, chat templates and loss masks, packing.

- `records`: read JSONL / Parquet records (`messages`, `prompt`/`completion`, instruction fields) into
  checked `Conversation`s (`load_conversations`).
- `template`: `ChatTemplate.from_dir(tokenizer_dir)` renders conversations exactly as transformers'
  `apply_chat_template` does (in jinja2's sandbox) and builds the assistant-token loss mask.
- `packing`: `PackedRows` packs tokenized conversations into rows (best-fit-decreasing, greedy or padded) with
  shifted labels, per-document position ids and `cu_seqlens`; `check_targets` refuses a batch with nothing
  to train on.
- `dataset`: what an `[sft]` run of `shardlm train` reads (`build_sft_datasets`, `PackedDataset`).
The attention that keeps packed documents apart is the models' (`shardlm.models.documents`); the loss over the
global batch's assistant tokens is the trainer's (`shardlm.training.data.packed_parts`). See docs/sft.md.
Submodules are imported on use.
"""
