"""`shardlm plan`: which pipeline x tensor x data (x expert) parallel layout fits, and how fast it will run.

An analytic model of one training step of shardlm's GPT (and Llama, BERT) on a cluster of GPUs:

- `hardware`     GPU and node presets (the 2019 paper's DGX-2H, SC21's DGX A100, H100 / H200 nodes);
- `models`       model presets (the papers' GPT-2, BERT, weak-scaling and SC21 models, Llama 3, the MoE
                 models Mixtral 8x7B and Qwen3-30B-A3B / 235B-A22B, DeepSeek-V3, the sparse-attention DeepSeek-V3.2
                 and GLM-5, GLM-4.5, gpt-oss, the hybrid linear-attention Qwen3-Next and Qwen3.5, Kimi Linear's
                 KDA beside MLA, the Mamba-2 hybrids Nemotron-H and Nemotron 3 Nano) and TOML configs;
- `memory`       per-rank parameters, gradients, optimizer state and activations, derived from
                 what shardlm allocates and what autograd saves in its transformer layer;
- `activations`  the same under sequence parallelism and recomputation, Korthikanti et al.'s formulas
                 for Megatron, and the peak of a pipeline rank's in-flight micro-batches;
- `experts`      what MoE layers add: activated parameters, the MoE layer's activations, all-to-all bytes;
- `linear_attention`  Qwen3-Next's and Qwen3.5's Gated DeltaNet layers: their recurrence's FLOPs, what they save,
                 their recurrent state;
- `recurrent`    Kimi Linear's Kimi Delta Attention and Nemotron-H's Mamba-2, attention, MLP and MoE blocks: their
                 parameters, FLOPs, recurrent state and what they save (Nemotron-H's MoE blocks estimated);
- `sparse_attention`  DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): the top-k attention's and the lightning
                 indexers' FLOPs, which layers hold an indexer, dense against sparse per token;
- `fsdp`         FSDP (`train.data_sharding = "full"`): sharded state, gathered units, per-layer collectives;
- `muon`         `--optimizer muon` (`train.optimizer = "muon"`): the Muon matrices of a rank, their state, and
                 the step's TP and data-sharding collectives and Newton-Schulz FLOPs;
- `stages`       the pipeline arithmetic: layers and parameters per rank, in-flight micro-batches of
                 each schedule, the bubble;
- `schedule_sim` PyTorch's own action order of each pipeline schedule replayed on a clock: the zero-bubble
                 schedules' bubble and in-flight micro-batches;
- `flops`        each family's matmul FLOPs per token of training (what MFU, the benchmarks and `timing` read);
- `timing`       compute from the FLOP formula, TP all-reduces, pipeline bubble and transfers, the DP
                 gradient all-reduce on ring cost models, with the calibration constants;
- `planner`      every valid PP x TP x DP (x EP) layout and option (data sharding included), whether it
                 fits, its step time, the recommendation;
- `kernels`      what `--implementation megatron-core` (today's Megatron-Core, Meta's Llama 3 stack) changes in
                 the time: causal flash attention, the K/V all-gather of context parallelism, DP overlap;
- `generations`  which calibration each GPU generation gets (V100, A100, Hopper) and where it comes from;
- `paper`, `sc21`  Shoeybi et al. 2019's and Narayanan et al. 2021's weak-scaling tables against the
                 model's predictions (and the fits of the calibration constants);
- `llama3`       Llama 3 405B's published H100 runs (Meta 2024, Table 4) against the predictions;
- `measure`      the same quantities measured on this CPU (for the validation tests and docs);
- `report`       the table and the JSON; `cli` the subcommand.

Nothing here imports torch at module level except `measure`; `stages` imports shardlm's stage split
(and with it torch) when a pipeline is planned, `schedule_sim` PyTorch's schedules when one is replayed.
"""
