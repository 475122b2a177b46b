# shardlm developer commands. Everything installs into .venv; a second run reinstalls nothing.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test lint demo bench clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The stamp depends on pyproject.toml, so dependencies are installed again only when they change.
$(STAMP): pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install --quiet --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

lint: $(STAMP)
	$(VENV)/bin/ruff check shardlm tests scripts

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) -m shardlm.bench

clean:
	rm -rf $(VENV) runs *.egg-info
