"""`shardlm plan`: which tensor x data parallel layout fits, and how fast it will run.

An analytic model of one training step of shardlm's GPT on a cluster of GPUs:

- `hardware`  GPU and node presets (the paper's DGX-2H, today's A100 / H100 / H200 nodes);
- `models`    model presets (the paper's GPT-2, BERT and weak-scaling models) and TOML configs;
- `memory`    per-rank parameters, gradients, optimizer state and activations, derived from
              what shardlm allocates and what autograd saves in its transformer layer;
- `timing`    compute from the FLOP formula, TP all-reduces and the DP gradient all-reduce on ring
              cost models, with the calibration constants and what they were fitted on;
- `planner`   every valid TP x DP layout, whether it fits, its step time, the recommendation;
- `paper`     the paper's Table 1 weak-scaling efficiencies against the model's predictions;
- `measure`   the same quantities measured on this CPU (for the validation tests and docs);
- `report`    the table and the JSON; `cli` the subcommand.

Nothing here imports torch at module level except `measure`.
"""
