#!/usr/bin/env bash
# The prepared GPU check of docs/benchmarks-gpu.md, for a session lent one CUDA GPU: under 8 minutes on one H200,
# its steps in priority order, each with its own time limit (cut to what is left of BUDGET), so the steps that
# matter most report even if a later one hangs. Run it from the repository root: `bash scripts/gpu_check.sh OUT_DIR`.
# Every step writes OUT_DIR/<step>.log and a line of OUT_DIR/steps.tsv (step, exit code, seconds, limit); at the
# end scripts/gpu_summary.py gathers them into OUT_DIR/summary.json. shardlm need not be installed (PYTHONPATH is
# set here), so it runs under any Python that has PyTorch with CUDA.
#
# A machine without this repository's git history or the shared data (a lent GPU machine gets the working tree
# only): first run `bash scripts/gpu_check.sh --prepare` where they are. It puts AGAINST's shardlm/ and the data
# the training steps read (Tiny Shakespeare, the GPT-2 vocabulary) under runs/gpu-carry (ignored by git); carry
# that folder along, and the check uses it.
set -u
AGAINST=46f234c  # the last recorded GPU revision, the side-by-side baseline: change it here only
BUDGET=455  # seconds for all the steps, graces included: the check ends by BUDGET + 3 s + the summary, < 8 min
carry=runs/gpu-carry
if [ "${1:-}" = --prepare ]; then
    data=${SHARDLM_DATA:-../shared/data}
    rm -rf "$carry" && mkdir -p "$carry/rev-$AGAINST" "$carry/data/corpus" "$carry/data/vocab" &&
        git archive "$AGAINST" shardlm | tar -x -C "$carry/rev-$AGAINST" &&
        git rev-parse --short=10 "$AGAINST" >"$carry/rev-$AGAINST/REVISION" &&
        cp "$data/corpus/tinyshakespeare.txt" "$carry/data/corpus/" && cp -r "$data/vocab/gpt2" "$carry/data/vocab/" &&
        echo "prepared $carry ($(du -sh "$carry" | cut -f1)): carry it to the GPU machine"
    exit
fi
out=${1:-runs/gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
: >"$out/steps.tsv"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -z "${SHARDLM_DATA:-}" ] && [ -d "$carry/data" ]; then export SHARDLM_DATA=$PWD/$carry/data; fi
against=$AGAINST
if [ -f "$carry/rev-$AGAINST/shardlm/__init__.py" ]; then
    against=$carry/rev-$AGAINST
elif ! git rev-parse --verify --quiet "$AGAINST^{commit}" >/dev/null 2>&1; then
    echo "gpu_check: $AGAINST is not here: run 'bash scripts/gpu_check.sh --prepare' where it is, carry $carry"
fi
began=$SECONDS

step() {  # step NAME LIMIT_S COMMAND...: the smaller of LIMIT_S and what is left of BUDGET
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    local left=$((BUDGET - (SECONDS - began)))
    if [ "$left" -lt "$limit" ]; then limit=$left; fi
    if [ "$limit" -lt 10 ]; then
        echo "== $name: skipped, the budget is spent"
        printf '%s\tskipped\t0\t0\n' "$name" >>"$out/steps.tsv"
        return
    fi
    echo "== $name (limit $limit s)"
    timeout -k 3 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n 12 "$out/$name.log"
    echo "== $name: exit $rc after $((SECONDS - start)) s"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$out/steps.tsv"
}

# (a) The GPU, the versions and a measured bf16 GEMM rate, as one JSON line. Expected 10 s.
step env 30 "$py" - <<'PY'
import json, shutil, subprocess, time, torch
smi = shutil.which("nvidia-smi") and subprocess.run(
    ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"], capture_output=True, text=True).stdout
nccl = torch.cuda.nccl.version()
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(10):
    a @ b
torch.cuda.synchronize()
tflops = 10 * 2 * 8192**3 / (time.perf_counter() - start) / 1e12
print(json.dumps({"env": True, "gpu": torch.cuda.get_device_name(0), "nvidia_smi": (smi or "").strip(),
                  "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
                  "gemm_bf16_tflops": round(tflops, 1)}))
PY
# (b) Multi-rank CUDA code on one GPU: 2 and 4 ranks share GPU 0 over the staged gloo group (NCCL refuses two
# ranks on one GPU) and must give one process's numbers: TP with SP, PP with virtual stages, CP, FSDP, DDP, the
# distributed optimizer and EP. Expected 50 s (two spawned worlds and the one-process references).
step staged_backend 80 env SHARDLM_BACKEND=gloo_staged "$py" -m pytest -q -p no:cacheprovider \
    tests/test_staged_backend.py
# (c) The 1.5B shape at `make bench-gpu`'s settings, side by side with AGAINST: 2 rounds ABBA, 4 processes of
# about 35 s each (torch.compile per layer, 2 warm-up and 3 timed steps of 1.4 s, the profiled step of round 0),
# then the ratio and the operators whose call counts differ. Expected 150 s; cut short, it still prints the
# summary of its complete rounds.
best="--micro-batch 16 --global-batch 64 --param-dtype half"  # `make bench-gpu`'s settings
step against_xl 180 "$py" -m shardlm.bench.gpu --compile $best --shapes gpt2-1.5b --steps 3 \
    --against "$against" --rounds 2 --profile 15
# (d) The CUDA tests: GPU and CPU agree in fp32, bf16 trains, the fused head + loss on the GPU. Expected 20 s.
step test_cuda 40 "$py" -m pytest -q -p no:cacheprovider tests/test_cuda.py
# (e) `shardlm train` under the elastic launcher: the NCCL process group, bf16, evaluation and a checkpoint on the
# GPU (a GPT-2-small-sized model on Tiny Shakespeare). Expected 25 s.
step train_nccl 45 "$py" -m shardlm train configs/tiny.toml --nproc-per-node 1 --run-dir /tmp/gpu-check-run \
    model.num_layers=12 model.hidden_size=768 model.num_heads=12 model.seq_length=1024 model.dropout=0.0 \
    train.micro_batch_size=8 train.global_batch_size=16 train.steps=40 train.lr=6e-4 train.min_lr=6e-5 \
    train.warmup_steps=10 train.precision=bf16 train.eval_interval=20 train.eval_iters=4 log.interval=10 \
    log.progress=false checkpoint.dir=/tmp/gpu-check-run/checkpoints
# (f) The tiny family configs, 20 bf16 steps each with evaluation and a checkpoint: MoE with DeepSeek routing,
# DeepSeek-V3 (MLA and a multi-token-prediction depth), gpt-oss (sinks and sliding windows in tiles, biased
# experts). Expected 15 s each.
for cfg in tiny-moe-deepseek tiny-deepseek-v3 tiny-gpt-oss; do
    step "train_$cfg" 25 "$py" -m shardlm train "configs/$cfg.toml" --nproc-per-node 1 \
        --run-dir "/tmp/gpu-check-$cfg" train.steps=20 train.precision=bf16 train.eval_interval=20 \
        log.progress=false checkpoint.dir="/tmp/gpu-check-$cfg/checkpoints"
done
# (g) Only in what is left of the budget (about 100 s when the steps above take their expected times): the other
# shapes at `make bench-gpu`'s settings, each printed as it finishes.
step bench_other 300 "$py" -m shardlm.bench.gpu --compile $best --shapes paper-1.2b gpt2-355m gpt2-774m

echo "== summary: $out/summary.json (after $((SECONDS - began)) s)"
"$py" scripts/gpu_summary.py "$out"
