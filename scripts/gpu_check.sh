#!/usr/bin/env bash
# The prepared GPU check of docs/benchmarks-gpu.md, for a session lent one CUDA GPU. Run it from the
# repository root: `bash scripts/gpu_check.sh [OUT_DIR]`. shardlm need not be installed (PYTHONPATH is
# set here), so it runs under any Python that has PyTorch with CUDA; $SHARDLM_DATA must hold the shared
# data. Each step has its own time limit and writes OUT_DIR/<step>.log, so a step that hangs or fails
# costs only its own limit and the others still report.
set -u
out=${1:-runs/gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name"
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 25 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
}

step env 90 "$py" - <<'PY'
import subprocess, time, torch
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip())
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      torch.cuda.get_device_name(0))
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(10):
    a @ b
torch.cuda.synchronize()
print(f"bf16 GEMM 8192^3: {10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12:.0f} TFLOP/s")
PY
step test_cuda 180 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py
best="--micro-batch 16 --global-batch 64 --param-dtype half"  # `make bench-gpu`'s settings
step bench_xl 240 "$py" -m shardlm.bench.gpu --compile $best --shapes gpt2-1.5b --profile 15
# `shardlm train` under the elastic launcher: the NCCL process group, bf16, evaluation and a
# checkpoint on the GPU (a GPT-2-small-sized model on Tiny Shakespeare).
step train_nccl 180 "$py" -m shardlm train configs/tiny.toml --nproc-per-node 1 --run-dir /tmp/gpu-check-run \
    model.num_layers=12 model.hidden_size=768 model.num_heads=12 model.seq_length=1024 model.dropout=0.0 \
    train.micro_batch_size=8 train.global_batch_size=16 train.steps=150 train.lr=6e-4 train.min_lr=6e-5 \
    train.warmup_steps=20 train.precision=bf16 train.eval_interval=50 train.eval_iters=8 log.interval=10 \
    log.progress=false checkpoint.dir=/tmp/gpu-check-run/checkpoints
# The families that landed since the first GPU check, one short bf16 run each on the GPU: MoE with DeepSeek
# routing, DeepSeek-V3 (MLA and a multi-token-prediction depth) and gpt-oss (attention sinks and sliding
# windows in tiles, biased experts); each must train, evaluate and save without an error.
for cfg in tiny-moe-deepseek tiny-deepseek-v3 tiny-gpt-oss; do
    step "train_$cfg" 150 "$py" -m shardlm train "configs/$cfg.toml" --nproc-per-node 1 \
        --run-dir "/tmp/gpu-check-$cfg" train.steps=30 train.precision=bf16 train.eval_interval=30 \
        log.progress=false checkpoint.dir="/tmp/gpu-check-$cfg/checkpoints"
done
# Multi-rank CUDA code on one GPU: 2 and 4 ranks share GPU 0 over the staged gloo group (NCCL refuses two
# ranks on one GPU) and must give one process's numbers: TP with SP, PP with virtual stages, CP (MLA with MTP
# depths, gpt-oss's attention), FSDP, DDP, the distributed optimizer and EP (`tests/test_staged_backend.py`).
step layouts_one_gpu 300 env SHARDLM_BACKEND=gloo_staged "$py" -m pytest -q -p no:cacheprovider \
    tests/test_staged_backend.py
step bench_other 300 "$py" -m shardlm.bench.gpu --compile $best --shapes gpt2-355m gpt2-774m paper-1.2b
step bench_xl_eager 120 "$py" -m shardlm.bench.gpu $best --shapes gpt2-1.5b
