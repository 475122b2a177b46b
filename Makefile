# shardlm developer commands. Everything installs into .venv; a second run reinstalls nothing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test test-learning test-bench lint demo demo-distill demo-rl bench bench-gpu bench-gpu-against clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The stamp depends on pyproject.toml and this file, so dependencies are installed again only when they change.
$(STAMP): pyproject.toml Makefile | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,eval]"
	# megatron-core for the indexed-dataset interop test only: its own dependencies (Transformer Engine, ...) are
	# not needed to read and write .bin/.idx files, and would replace the CPU torch
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "megatron-core==0.16.1"
	touch $(STAMP)

install: $(STAMP)

# Two pytest workers (pytest-xdist), a whole test file each at a time so a file's spawned worlds start once:
# most tests run one single-threaded process, so two of them fill two cores. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# One thread a process; glibc's allocator keeps freed blocks of up to 32 MiB for reuse instead of unmapping them
# (and the kernel zeroing fresh pages for the next): the TRL oracles' 151,936-entry vocabularies run a fifth faster.
# Bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE): the suite's hundreds of
# processes then compile shardlm and the test modules once, not each.
TEST_ENV := OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=1073741824 PYTHONDONTWRITEBYTECODE=
test: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not learning and not bench" tests

# The learning runs (GRPO raising the reward: about 7 minutes of one core; the tiny DPO config's held-out pairs) and
# the distillation demo's script at toy sizes, left out of `make test` for their time.
test-learning: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -m learning tests

# The benchmark harness on tiny shapes (every section's keys, ratios and report: about 4 minutes on 2 cores), left
# out of `make test` for its time; `make bench` runs it first.
test-bench: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m bench tests

lint: $(STAMP)
	$(VENV)/bin/ruff check shardlm tests scripts

demo: $(STAMP)
	$(PY) scripts/demo.py

# A student distilled from a briefly fine-tuned teacher against the same student fine-tuned alone, on the Dolly
# records: runs/distill-demo/distill_demo.json and .png (docs/distillation.md; about 9 minutes of one core).
demo-distill: $(STAMP)
	$(PY) scripts/distill_demo.py runs/distill-demo

# GRPO (DAPO) learns arithmetic after a short SFT warm-up, with a task-sized tokenizer: runs/rl-demo/rl_demo.json
# and .png, the mean reward of every step and the held-out figures before and after (docs/rl.md, "Learning"; about
# 7 minutes of one core).
demo-rl: $(STAMP)
	$(PY) scripts/rl_demo.py runs/rl-demo

# Writes BENCHMARKS.md and benchmarks.json (40 to 60 minutes on a 2-core CPU).
bench: test-bench
	$(PY) -m shardlm.bench

# One CUDA GPU: bf16 throughput, TFLOP/s and MFU of GPT-2 shapes up to 1.5B (not run in CI).
bench-gpu: $(STAMP)
	$(PY) -m shardlm.bench.gpu --compile --micro-batch 16 --global-batch 64 --param-dtype half

bench-gpu-against: $(STAMP)  # make bench-gpu-against REV=46f234c: bench-gpu's settings, REV side by side
	$(PY) -m shardlm.bench.gpu --compile --micro-batch 16 --global-batch 64 --param-dtype half --against $(REV) --profile 15

clean:
	rm -rf $(VENV) runs *.egg-info
