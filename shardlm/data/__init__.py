"""The data pipeline: tokenizers, Megatron indexed files, GPT/BERT datasets, corpus cleaning.

- `tokenizers.build_tokenizer`: GPT-2 BPE, BERT WordPiece or a saved `tokenizer.json`.
- `preprocess.preprocess` (`shardlm preprocess`): documents -> `PREFIX.bin` + `PREFIX.idx`.
- `indexed.IndexedDataset`: the Megatron-LM indexed format on `np.memmap`.
- `gpt_dataset.build_gpt_datasets`, `bert_dataset.build_bert_datasets`: train/valid/test samples.
- `corpus` / `overlap` (`shardlm corpus ...`): short-document filter, MinHash dedup, n-gram overlap.

Submodules are imported on use, so `import shardlm.data` stays cheap.
"""
